"""Rotary position embedding (GPT-NeoX style) of a head's first ``rotary_dim`` channels, with linear, llama3 and
longrope (Phi-3) frequency scaling.

LongRoPE's rows hold the short factors for positions below ``original_max_position_embeddings`` and the long ones
from there on, both times its attention factor: what transformers computes for a token decoded at that position
(it switches the whole forward call to the long factors once any of its positions passes the boundary; vLLM's
tables are per position as here).
"""
from __future__ import annotations

import copy
import math

import torch

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.kv.blocks import MediaSpan


def scaling_kind(scaling: dict | None) -> str | None:
    """The rope_type of a rotary_scaling object (TensorRT-LLM 0.12 reads "type", later releases "rope_type")."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type"))


def inverse_frequencies(head_size: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies, rescaled as Llama 3.1 does when ``scaling`` says llama3."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    kind = scaling_kind(scaling)
    if kind in (None, "default", "mrope"):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "longrope":
        return (inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float()
    if kind != "llama3":
        raise ConfigError(f"unsupported rotary_scaling type {kind!r}; supported: linear, llama3, longrope, mrope")
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
        self.mrope_section = (scaling or {}).get("mrope_section") if scaling_kind(scaling) == "mrope" else None

    def to(self, device: torch.device | str) -> "Rope":
        """This RoPE computing its rows on ``device`` (for positions there)."""
        moved = copy.copy(self)
        moved.inv_freq = self.inv_freq.to(device)
        moved.long_inv_freq = None if self.long_inv_freq is None else self.long_inv_freq.to(device)
        return moved

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (tokens, rotated) for integer positions (tokens,), or M-RoPE's (3, tokens): the
        frequencies of each ``mrope_section`` turned by the temporal, height and width position in turn."""
        positions = positions.to(torch.float32)
        if positions.dim() == 2:
            sections = (positions[i % 3, :, None] * freqs[None, :] for i, freqs in
                        enumerate(self.inv_freq.split(self.mrope_section)))
            angles = torch.cat(list(sections), dim=-1)
            angles = torch.cat([angles, angles], dim=-1)
            return angles.cos(), angles.sin()
        angles = positions[:, None] * self.inv_freq[None, :]
        if self.long_inv_freq is not None:  # torch.where, not a masked write: no host sync on a GPU
            angles = torch.where(positions[:, None] >= self.boundary, positions[:, None] * self.long_inv_freq[None, :],
                                 angles)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * self.factor, angles.sin() * self.factor


def mrope_positions(start: int, end: int, media: list[MediaSpan]) -> torch.Tensor:
    """M-RoPE positions (3, end - start) of a sequence's tokens [start, end): an image's tokens at (t, h, w) of its
    grid plus the position it starts at, text one position after another, the text after an image ``max(h, w)``
    positions after the image's start (transformers' Qwen2VLModel.get_rope_index)."""
    out = torch.arange(start, end).repeat(3, 1)
    offset = 0  # what the images so far shift the positions after them by
    for span in media:
        if span.start >= end:
            break
        t, h, w = span.grid
        lo, hi = max(span.start, start), min(span.end, end)
        if lo < hi:
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            out[:, lo - start:hi - start] = grid.reshape(3, -1)[:, lo - span.start:hi - span.start] + span.start + offset
        shift = max(h, w) - span.length
        out[:, max(span.end - start, 0):] += shift
        offset += shift
    return out


def mrope_offset(position: int, media: list[MediaSpan]) -> int:
    """What images before ``position`` (a text token's) shift its M-RoPE position by."""
    return sum(max(span.grid[1], span.grid[2]) - span.length for span in media if span.end <= position)


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
