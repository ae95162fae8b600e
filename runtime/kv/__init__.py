"""The KV cache: its modes (registry), storage classes, quantization math, blocks and the paged cache."""
