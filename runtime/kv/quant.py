"""Quantize and dequantize K/V for the cache's storage modes.

INT8 follows TensorRT-LLM: quantize ``round(x / s)``, dequantize ``q * s`` with
``s = amax / 127``. Static scales are one number per layer; dynamic scales are
one fp16 number per token and KV head, kept beside the block.
"""
from __future__ import annotations

import torch

INT8_MAX = 127.0


def quantize_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """INT8 codes of x with one fixed scale."""
    return torch.clamp(torch.round(x / scale), -INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes and fp16 scales of x (tokens, heads, head_size), one scale per token and head."""
    amax = x.abs().amax(dim=-1)
    scale = (amax / INT8_MAX).clamp_min(1e-8).to(torch.float16)
    codes = torch.clamp(torch.round(x / scale.float()[..., None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize_per_token(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of per-token INT8 codes."""
    return codes.float() * scale.float()[..., None]
