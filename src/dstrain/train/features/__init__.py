"""The run's features, one component each, and the builders list that assembles them."""
