"""Downstream tasks scored by log-likelihood: the formats (``formats``), their items from files or the Hub
(``loading``), and the scorer that the training loop and ``dstrain eval`` share (``scoring``)."""
