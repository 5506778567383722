"""Training: `deepspeed --module dstrain.train --recipe R --deepspeed_config C [key=value ...]`."""
