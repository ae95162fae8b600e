"""The reference model: the transformer's forward pass, the linear op of each weight format, RoPE, tokenizer."""
