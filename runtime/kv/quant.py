"""Quantize and dequantize K/V for the cache's storage modes.

INT8 follows TensorRT-LLM: quantize ``round(x / s)``, dequantize ``q * s`` with
``s = amax / 127``. Static scales are one number per layer; dynamic scales are
one fp16 number per token and KV head, kept beside the block. FP8 (e4m3) follows
TensorRT-LLM too: ``x / s`` rounded to e4m3 (saturating at 448) with ``s = amax / 448``.
"""
from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """INT8 codes of x with one fixed scale."""
    return torch.clamp(torch.round(x / scale), -INT8_MAX, INT8_MAX).to(torch.int8)


def fp8_scale(int8_scale: float) -> float:
    """The FP8 scale (amax / 448) of a layer whose INT8 scale (amax / 127, what kv_scales.json holds) is given."""
    return int8_scale * INT8_MAX / FP8_E4M3_MAX


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float8_e4m3fn values of x / scale, rounded to nearest even and saturated at +-448."""
    return torch.clamp(x / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes and fp16 scales of x (tokens, heads, head_size), one scale per token and head."""
    amax = x.abs().amax(dim=-1)
    scale = (amax / INT8_MAX).clamp_min(1e-8).to(torch.float16)
    codes = torch.clamp(torch.round(x / scale.float()[..., None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize_per_token(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of per-token INT8 codes."""
    return codes.float() * scale.float()[..., None]
