"""Static INT8 KV scales from collected statistics: clip each layer's K and V range, scale = clip / 127.

Methods:
- ``max``: the abs-max seen (no clipping);
- ``percentile``: the given percentile of |x| (e.g. 99.99), clipping the rare largest values;
- ``mse``: the clip that minimizes the mean squared INT8 quantization error over the histogram.

The same method also gives a clip per channel, which KV equalization uses to
choose its factors (calibration.equalize).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from calibration.stats import KVStats, RangeStats, bin_edges
from runtime.kv_cache import KVScales
from runtime.kv_quant import INT8_MAX
from runtime.kv_scales import LayerRanges

METHODS = ("max", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99
MSE_LOWEST_CLIP = 0.2  # the mse search looks at clips from this fraction of the abs-max up to the abs-max
MSE_CANDIDATES = 81


@dataclass
class LayerClips:
    """Clip values of K and V per layer with the share of values each clips, and clips per channel."""

    k: list[float]
    v: list[float]
    k_clip_rate: list[float]
    v_clip_rate: list[float]
    k_channel: torch.Tensor  # (layers, kv_heads, head_size)
    v_channel: torch.Tensor

    def scales(self) -> KVScales:
        """INT8 scales (clip / 127)."""
        return KVScales(k=[c / INT8_MAX for c in self.k], v=[c / INT8_MAX for c in self.v])


def _centers() -> torch.Tensor:
    edges = bin_edges()
    return (edges[:-1] + edges[1:]) / 2


def percentile_clips(hist: torch.Tensor, amax: torch.Tensor, percentile: float) -> torch.Tensor:
    """The |x| below which ``percentile`` % of the values lie (at most the abs-max), per histogram.

    ``hist`` is (..., HIST_BINS), ``amax`` (...); the result is float64 of shape (...).
    """
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    cumulative = (hist.cumsum(-1) / hist.sum(-1, keepdim=True)).contiguous()
    target = torch.full((*hist.shape[:-1], 1), percentile / 100, dtype=torch.float64)
    index = torch.searchsorted(cumulative, target).squeeze(-1)
    upper_edge = bin_edges()[(index + 1).clamp(max=hist.shape[-1])]
    return torch.minimum(upper_edge, amax.double())


def quantization_mse(hist: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
    """Mean squared error of symmetric INT8 with each clip, estimated from |x| histograms.

    ``hist`` is (..., HIST_BINS) and ``clips`` (..., candidates); the result is (..., candidates).
    """
    x = _centers()
    c = clips.double()[..., None]
    step = c / INT8_MAX
    inside = torch.where(x < step / 2, x * x, step * step / 12)  # values below half a step round to 0
    error = torch.where(x <= c, inside, (x - c) ** 2)
    return (error * hist[..., None, :]).sum(-1) / hist.sum(-1, keepdim=True)


def mse_clips(hist: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per histogram, the clip in [MSE_LOWEST_CLIP * amax, amax] with the least quantization error."""
    candidates = amax.double()[..., None] * torch.linspace(MSE_LOWEST_CLIP, 1.0, MSE_CANDIDATES, dtype=torch.float64)
    best = quantization_mse(hist, candidates).argmin(-1, keepdim=True)
    return candidates.gather(-1, best).squeeze(-1)


def clip_rates(hist: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
    """Share of the values whose |x| exceeds the clip, per histogram (at bin resolution)."""
    above = bin_edges()[:-1] >= clips.double()[..., None]
    return (hist * above).sum(-1) / hist.sum(-1)


def _clip(hist: torch.Tensor, amax: torch.Tensor, method: str, percentile: float) -> torch.Tensor:
    if method == "max":
        return amax.double()
    if method == "percentile":
        return percentile_clips(hist, amax, percentile)
    return mse_clips(hist, amax)


def _layer_clips(stats: RangeStats, method: str, percentile: float) -> tuple[list[float], list[float]]:
    hist, amax = stats.layer_hist, stats.layer_amax
    empty = ((amax <= 0) | (hist.sum(-1) == 0)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"layer {empty[0]}: no K/V values collected; calibrate on at least one dialogue")
    clips = _clip(hist, amax, method, percentile)
    rates = torch.where(clips < amax.double(), clip_rates(hist, clips), 0.0)
    return clips.tolist(), rates.tolist()


def _channel_clips(stats: RangeStats, method: str, percentile: float) -> torch.Tensor:
    out = torch.empty(stats.channel_amax.shape, dtype=torch.float64)
    for layer in range(out.shape[0]):
        for head in range(out.shape[1]):  # one head at a time bounds the mse search's memory
            out[layer, head] = _clip(stats.channel_hist[layer, head], stats.channel_amax[layer, head], method,
                                     percentile)
    return out


def compute_clips(stats: KVStats, method: str, percentile: float = DEFAULT_PERCENTILE) -> LayerClips:
    """Per-layer K and V clips (and clip rates), and per-channel clips, by one of METHODS."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    k, k_rate = _layer_clips(stats.k, method, percentile)
    v, v_rate = _layer_clips(stats.v, method, percentile)
    return LayerClips(k, v, k_rate, v_rate, _channel_clips(stats.k, method, percentile),
                      _channel_clips(stats.v, method, percentile))


def layer_ranges(stats: KVStats, clips: LayerClips) -> list[LayerRanges]:
    """Per-layer channel abs-max, channel clips and clip rates in the form ``kv_scales.json`` stores."""
    return [LayerRanges(stats.k.channel_amax[i].tolist(), stats.v.channel_amax[i].tolist(),
                        clips.k_clip_rate[i], clips.v_clip_rate[i],
                        clips.k_channel[i].tolist(), clips.v_channel[i].tolist())
            for i in range(stats.k.channel_amax.shape[0])]
