"""Static INT8 KV scales from collected statistics: clip each layer's K and V range, scale = clip / 127.

Methods:
- ``max``: the abs-max seen (no clipping);
- ``percentile``: the given percentile of |x| (e.g. 99.99), clipping the rare largest values;
- ``mse``: the clip that minimizes the mean squared INT8 quantization error over the histogram.
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


@dataclass
class LayerClips:
    """Clip values of K and V per layer, with the share of values each clips."""

    k: list[float]
    v: list[float]
    k_clip_rate: list[float]
    v_clip_rate: list[float]

    def scales(self) -> KVScales:
        """INT8 scales (clip / 127)."""
        return KVScales(k=[c / INT8_MAX for c in self.k], v=[c / INT8_MAX for c in self.v])


def _centers() -> torch.Tensor:
    edges = bin_edges()
    return (edges[:-1] + edges[1:]) / 2


def percentile_clip(hist: torch.Tensor, amax: float, percentile: float) -> float:
    """The |x| below which ``percentile`` % of one layer's values lie (at most the abs-max)."""
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile}")
    cumulative = hist.cumsum(0) / hist.sum()
    index = int(torch.searchsorted(cumulative, torch.tensor(percentile / 100, dtype=torch.float64)))
    upper_edge = float(bin_edges()[min(index + 1, len(hist))])
    return min(upper_edge, amax)


def quantization_mse(hist: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
    """Mean squared error of symmetric INT8 with each clip, estimated from one layer's |x| histogram."""
    x = _centers()[None, :]
    c = clips.double()[:, None]
    step = c / INT8_MAX
    inside = torch.where(x < step / 2, x * x, step * step / 12)  # values below half a step round to 0
    error = torch.where(x <= c, inside, (x - c) ** 2)
    return (error * hist[None, :]).sum(1) / hist.sum()


def mse_clip(hist: torch.Tensor, amax: float) -> float:
    """The clip in [MSE_LOWEST_CLIP * amax, amax] with the least quantization error."""
    edges = bin_edges()
    candidates = edges[(edges >= MSE_LOWEST_CLIP * amax) & (edges < amax)]
    candidates = torch.cat([candidates, torch.tensor([amax], dtype=torch.float64)])
    return float(candidates[int(quantization_mse(hist, candidates).argmin())])


def clip_rate(hist: torch.Tensor, clip: float) -> float:
    """Share of one layer's values whose |x| exceeds ``clip`` (from the histogram, at bin resolution)."""
    edges = bin_edges()
    above = hist[edges[:-1] >= clip].sum()
    return float(above / hist.sum())


def _clips(stats: RangeStats, method: str, percentile: float) -> tuple[list[float], list[float]]:
    clips, rates = [], []
    for layer, amax in enumerate(stats.layer_amax.tolist()):
        hist = stats.hist[layer]
        if amax <= 0 or hist.sum() == 0:
            raise ValueError(f"layer {layer}: no K/V values collected; calibrate on at least one dialogue")
        if method == "max":
            clip = amax
        elif method == "percentile":
            clip = percentile_clip(hist, amax, percentile)
        else:
            clip = mse_clip(hist, amax)
        clips.append(clip)
        rates.append(clip_rate(hist, clip) if clip < amax else 0.0)
    return clips, rates


def compute_clips(stats: KVStats, method: str, percentile: float = DEFAULT_PERCENTILE) -> LayerClips:
    """Per-layer K and V clips (and clip rates) by one of METHODS."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    k, k_rate = _clips(stats.k, method, percentile)
    v, v_rate = _clips(stats.v, method, percentile)
    return LayerClips(k, v, k_rate, v_rate)


def layer_ranges(stats: KVStats, clips: LayerClips) -> list[LayerRanges]:
    """Per-layer channel abs-max and clip rates in the form ``kv_scales.json`` stores."""
    return [LayerRanges(stats.k.channel_amax[i].tolist(), stats.v.channel_amax[i].tolist(),
                        clips.k_clip_rate[i], clips.v_clip_rate[i])
            for i in range(stats.k.channel_amax.shape[0])]
