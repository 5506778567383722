"""The strategy layer, torch-free where it can be: a ds_config resolved against a recipe (resolve), DeepSpeed's
schema (ds_schema), parallel layouts and their checks (parallel), the memory model (memory, activations)."""
