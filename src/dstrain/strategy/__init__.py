"""What a run is, torch-free where it can be: a ds_config resolved against a recipe (resolve), DeepSpeed's schema
(ds_schema), parallel layouts and their checks (parallel), the optimizer section, tiling, the topology a checkpoint
records. What a layout costs (the memory model behind ``estimate``) is ``dstrain.plan``'s."""
