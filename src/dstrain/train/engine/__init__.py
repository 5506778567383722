"""The DeepSpeed engine and what is applied to the model from outside it: sequence parallelism, tiling, Muon under
ZeRO, host checkpoints, the schedule, the gradient norm."""
