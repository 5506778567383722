"""Our GPT (gpt2 / llama flavours): config.py its torch-free configuration, gpt.py the model, pipe.py its pipeline
form, hf.py the Hugging Face conversion, convert.py pipeline/TP <-> plain state dicts."""
