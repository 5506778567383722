"""dstrain: DeepSpeed training recipes for GPT-style language models."""
