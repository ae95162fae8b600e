"""Static INT8 KV scales from collected statistics: clip each layer's K and V range, scale = clip / 127.

Methods:
- ``max``: the abs-max seen (no clipping);
- ``percentile``: the given percentile of |x| (e.g. 99.99), clipping the rare largest values;
- ``mse``: the clip that minimizes the mean squared INT8 quantization error over the histogram.

The same method also gives a clip per channel, which KV equalization uses to
choose its factors (cabinllm.calibration.equalize).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cabinllm.calibration.stats import KVStats, RangeStats, bin_edges
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.scales_file import KVScales, LayerRanges
from cabinllm.runtime.kv.quant import INT8_MAX

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
        raise ConfigError(f"percentile must be in (0, 100], got {percentile}")
    cumulative = (hist.cumsum(-1) / hist.sum(-1, keepdim=True)).contiguous()
    target = torch.full((*hist.shape[:-1], 1), percentile / 100, dtype=torch.float64)
    index = torch.searchsorted(cumulative, target).squeeze(-1)
    upper_edge = bin_edges()[(index + 1).clamp(max=hist.shape[-1])]
    return torch.minimum(upper_edge, amax.double())


def quantization_mse(hist: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
    """Mean squared error of symmetric INT8 with each clip, estimated from |x| histograms.

    ``hist`` is (..., HIST_BINS) and ``clips`` (..., candidates); the result is (..., candidates). A value below
    half a step rounds to 0 (error x^2), one up to the clip rounds (step^2 / 12), one above is clipped
    ((x - clip)^2); each part is a difference of prefix sums over the bins, so no (candidates x bins) tensor.
    """
    x = _centers()
    h = hist.double()

    def prefix(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t.cumsum(-1), (1, 0))

    count, first, second = prefix(h), prefix(h * x), prefix(h * x * x)
    c = clips.double()
    step = c / INT8_MAX
    low = torch.searchsorted(x, (step / 2).contiguous())  # bins with x < step / 2
    high = torch.searchsorted(x, c.contiguous(), right=True)  # bins with x <= c

    def upto(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t.gather(-1, index)

    total_n, total_1, total_2 = count[..., -1:], first[..., -1:], second[..., -1:]
    below = upto(second, low)
    inside = (upto(count, high) - upto(count, low)) * step * step / 12
    above = ((total_2 - upto(second, high)) - 2 * c * (total_1 - upto(first, high))
             + c * c * (total_n - upto(count, high)))
    return (below + inside + above) / total_n


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
        raise ConfigError(f"layer {empty[0]}: no K/V values collected; calibrate on at least one dialogue")
    clips = _clip(hist, amax, method, percentile)
    rates = torch.where(clips < amax.double(), clip_rates(hist, clips), 0.0)
    return clips.tolist(), rates.tolist()


def _channel_clips(stats: RangeStats, method: str, percentile: float) -> torch.Tensor:
    return _clip(stats.channel_hist, stats.channel_amax, method, percentile)


def compute_clips(stats: KVStats, method: str, percentile: float = DEFAULT_PERCENTILE) -> LayerClips:
    """Per-layer K and V clips (and clip rates), and per-channel clips, by one of METHODS."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
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


def kind_ranges(stats: KVStats, clips: LayerClips) -> dict:
    """Where the data shows pictures or holds clips: per kind of position (text, image, audio), the positions seen
    and per layer the K and V abs-max and the share of values (%) beyond the layer's clip; JSON-ready, {} for
    text-only data."""
    channels = stats.k.channel_amax[0].numel()
    ranges = {}
    for kind, (k, v) in stats.by_kind.items():
        ranges[kind] = {"positions": int(k.layer_hist[0].sum()) // channels,
                        "k_amax": [round(x, 4) for x in k.layer_amax.tolist()],
                        "v_amax": [round(x, 4) for x in v.layer_amax.tolist()],
                        "k_clipped_pct": [round(100 * x, 4) for x in clip_rates(k.layer_hist, torch.tensor(clips.k))
                                          .tolist()],
                        "v_clipped_pct": [round(100 * x, 4) for x in clip_rates(v.layer_hist, torch.tensor(clips.v))
                                          .tolist()]}
    return ranges
