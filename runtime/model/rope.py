"""Rotary position embedding (GPT-NeoX style), with llama3-style frequency scaling."""
from __future__ import annotations

import math

import torch

from cabinllm.runtime.errors import ConfigError


def inverse_frequencies(head_size: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies, rescaled as Llama 3.1 does when ``scaling`` says llama3."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind is None or kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind != "llama3":
        raise ConfigError(f"unsupported rotary_scaling type {kind!r}; supported: linear, llama3")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def rope_table(head_size: int, max_positions: int, base: float, scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_positions, head_size)."""
    inv_freq = inverse_frequencies(head_size, base, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (tokens, heads, head_size) by per-token cos/sin of shape (tokens, head_size)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
