"""Where a model comes from (default, GGUF, HF folder, checkpoint, engine folder) and its import."""
