"""One step and one evaluation under any layout: the forward, the steps, the evaluator, the component protocol and the
handle components see."""
