"""Conversion between our GPT and Hugging Face transformers, per family."""
