"""Rotary position embedding (GPT-NeoX style) of a head's first ``rotary_dim`` channels, with linear, llama3 and
longrope (Phi-3) frequency scaling.

LongRoPE's rows hold the short factors for positions below ``original_max_position_embeddings`` and the long ones
from there on, both times its attention factor: what transformers computes for a token decoded at that position
(it switches the whole forward call to the long factors once any of its positions passes the boundary; vLLM's
tables are per position as here).
"""
from __future__ import annotations

import math

import torch

from cabinllm.runtime.errors import ConfigError


def scaling_kind(scaling: dict | None) -> str | None:
    """The rope_type of a rotary_scaling object (TensorRT-LLM 0.12 reads "type", later releases "rope_type")."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type"))


def inverse_frequencies(head_size: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies, rescaled as Llama 3.1 does when ``scaling`` says llama3."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    kind = scaling_kind(scaling)
    if kind is None or kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "longrope":
        return (inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float()
    if kind != "llama3":
        raise ConfigError(f"unsupported rotary_scaling type {kind!r}; supported: linear, llama3, longrope")
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


class Rope:
    """cos and sin of any positions, computed when asked (no table of the whole context: at 131,072 positions of
    256 channels one would hold 256 MiB)."""

    def __init__(self, rotated: int, base: float, scaling: dict | None = None) -> None:
        """``rotated``: the channels of each head RoPE rotates."""
        self.inv_freq = inverse_frequencies(rotated, base, scaling)
        self.long_inv_freq, self.boundary = None, None
        if scaling_kind(scaling) == "longrope":
            self.long_inv_freq = inverse_frequencies(rotated, base, {**scaling, "short_factor": scaling["long_factor"]})
            self.boundary = scaling["original_max_position_embeddings"]
        self.factor = longrope_attention_factor(scaling)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (len(positions), rotated) for integer positions."""
        positions = positions.to(torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            long = positions >= self.boundary
            angles[long] = positions[long][:, None] * self.long_inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * self.factor, angles.sin() * self.factor


def longrope_attention_factor(scaling: dict | None) -> float:
    """LongRoPE's scale of cos and sin (1 for other kinds): sqrt(1 + ln(factor) / ln(original context))."""
    if scaling_kind(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x (tokens, heads, head_size) by per-token cos/sin (tokens, rotated
    channels); the other channels pass."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
