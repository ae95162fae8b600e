"""4-bit asymmetric K/V quantization, grouped as KIVI does.

Keys vary most across channels, so each key channel of a block of tokens is one
group (scale and zero per block, KV head and channel). Values vary most across
tokens, so each token's head is split into groups of VALUE_GROUP channels (scale
and zero per token, KV head and group). Quantize ``q = round((x - zero) / scale)``
in 0..15 with ``zero = min``, ``scale = (max - min) / 15``; dequantize
``q * scale + zero``. Codes are packed two per byte; scales and zeros are fp16.
"""
from __future__ import annotations

import torch

INT4_LEVELS = 15
VALUE_GROUP = 32
_MIN_SCALE = 1e-6


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 with an even last dimension -> bytes holding two codes each."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantize_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed codes (..., tokens, heads, d/2), scale and zero (..., heads, d): one group per channel over tokens."""
    lo, hi = x.amin(dim=-3), x.amax(dim=-3)
    scale = ((hi - lo) / INT4_LEVELS).clamp_min(_MIN_SCALE).half()
    zero = lo.half()
    q = torch.round((x - zero.float().unsqueeze(-3)) / scale.float().unsqueeze(-3))
    return pack_nibbles(q.clamp(0, INT4_LEVELS).to(torch.uint8)), scale, zero


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 keys from quantize_keys' output."""
    return unpack_nibbles(packed).float() * scale.float().unsqueeze(-3) + zero.float().unsqueeze(-3)


def quantize_values(x: torch.Tensor, group: int = VALUE_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed codes (..., heads, d/2), scale and zero (..., heads, d/group): groups of channels per token."""
    grouped = x.unflatten(-1, (-1, group))
    lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = ((hi - lo) / INT4_LEVELS).clamp_min(_MIN_SCALE).half()
    zero = lo.half()
    q = torch.round((grouped - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1))
    return pack_nibbles(q.clamp(0, INT4_LEVELS).to(torch.uint8).flatten(-2)), scale, zero


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      group: int = VALUE_GROUP) -> torch.Tensor:
    """fp32 values from quantize_values' output."""
    codes = unpack_nibbles(packed).float().unflatten(-1, (-1, group))
    return (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)
