"""Our GPT (gpt2 / llama flavours); Hugging Face conversion lives in dstrain.model.hf."""
from dstrain.model.gpt import GPT, Block, Embedding, GPTConfig, flops_per_token, lm_loss, num_params

__all__ = ["GPT", "Block", "Embedding", "GPTConfig", "flops_per_token", "lm_loss", "num_params"]
