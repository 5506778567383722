"""Checkpoints: writing and publishing tags (store, background), their record, DeepSpeed's file names
(ds_files), resharding to another layout (reshard), one fp32 state dict of any tag (consolidate), NVMe parts."""
