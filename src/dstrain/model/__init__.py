"""Our GPT (gpt2 / llama flavours): config.py its torch-free configuration, gpt.py the model (and its optimizer
parameter groups), pipe.py its pipeline form, hf.py the Hugging Face conversion."""
