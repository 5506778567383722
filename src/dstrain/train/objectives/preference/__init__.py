"""Preference tuning (a recipe's preference:): the losses, the forward, the step and the reference scores."""
