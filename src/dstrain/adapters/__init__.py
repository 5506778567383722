"""Adapters (LoRA): the recipe's ``lora:`` section (config.py, torch-free), the layer and its injection into the
built GPT from outside model/gpt.py (lora.py), and the PEFT folder format users load (peft_format.py)."""
