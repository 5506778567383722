"""The training objectives, torch-free: what each one is to the recipe, the checks, the strategy and the planner
(dstrain.objectives.objective.Objective), one record per objective in dstrain.objectives.registry. Each one's torch
side (its forward, step, metrics component and evaluation) is dstrain.train.objectives.<name>."""
