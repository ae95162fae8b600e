"""KV equalization: fold per-channel factors into the weights so one shared INT8 scale per layer fits K and V.

Attention is linear in V (``softmax(QK^T) V W_o``) and, per RoPE pair, in K
(``q.k`` is unchanged if a pair of k is scaled by ``a`` and the same pair of q by
``1/a``; RoPE rotates both channels of a pair by the same angle). So:

- V channel c of KV head g: ``v`` row of ``qkv`` times ``a``, matching ``dense``
  column of every query head in group g divided by ``a``;
- K pair (j, j + head_size/2) of KV head g: both ``k`` rows times ``b``, the same
  pair of ``q`` rows of every query head in group g divided by ``b``.

Factors bring every channel's calibrated range (its clip by the calibration
method, else its abs-max) to the layer's geometric mean (within [1/MAX_FACTOR,
MAX_FACTOR]), so the shared scale quantizes like a static per-channel scale. With full-precision KV the model's outputs do not change:
up to float rounding with exact factors, bit for bit (in fp32 and fp16 weights
alike) with ``power_of_two`` factors, which fit the shared scale less tightly.
"""
from __future__ import annotations

import torch

from runtime.checkpoint import ModelConfig, layer_prefix
from runtime.kv_cache import KVScales
from runtime.kv_quant import INT8_MAX
from runtime.kv_scales import LayerRanges

MAX_FACTOR = 64.0  # bounds factors so fp16 weights neither overflow nor lose precision


def calibrated_ranges(ranges: LayerRanges) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V range per channel that equalization fits: the method's clip if stored, else the abs-max."""
    k = ranges.k_channel_clip if ranges.k_channel_clip is not None else ranges.k_channel_amax
    v = ranges.v_channel_clip if ranges.v_channel_clip is not None else ranges.v_channel_amax
    return torch.tensor(k, dtype=torch.float64), torch.tensor(v, dtype=torch.float64)


def rope_pair_max(k_range: torch.Tensor) -> torch.Tensor:
    """(kv_heads, head_size / 2): the larger range of each RoPE pair (j, j + head_size / 2) of K."""
    half = k_range.shape[1] // 2
    return torch.maximum(k_range[:, :half], k_range[:, half:])


def equalization_factors(ranges: LayerRanges, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V factors of one layer, each (kv_heads, head_size) float64; K factors are equal within a RoPE pair.

    ``power_of_two`` rounds each factor to the nearest power of two, so folding it changes no bit of the outputs.
    """
    k_range, v_range = calibrated_ranges(ranges)
    pair_range = rope_pair_max(k_range)
    measured = torch.cat([pair_range.flatten(), v_range.flatten()])
    measured = measured[measured > 0]
    if measured.numel() == 0:
        raise ValueError("a layer has no non-zero K/V range; calibrate on real dialogues before equalizing")
    target = measured.log().mean().exp()

    def factor(channel_range: torch.Tensor) -> torch.Tensor:
        safe = torch.where(channel_range > 0, channel_range, target)
        f = (target / safe).clamp(1 / MAX_FACTOR, MAX_FACTOR)
        return 2.0 ** f.log2().round() if power_of_two else f

    k_factor = factor(pair_range)
    return torch.cat([k_factor, k_factor], dim=1), factor(v_range)


def equalized_ranges(ranges: list[LayerRanges], power_of_two: bool = False) -> list[LayerRanges]:
    """The channel abs-max and clips each layer will have once its equalization factors are folded in."""
    out = []
    for layer in ranges:
        k_factor, v_factor = equalization_factors(layer, power_of_two)
        k_clip, v_clip = calibrated_ranges(layer)
        k = torch.tensor(layer.k_channel_amax, dtype=torch.float64) * k_factor
        v = torch.tensor(layer.v_channel_amax, dtype=torch.float64) * v_factor
        out.append(LayerRanges(k.tolist(), v.tolist(), layer.k_clip_rate, layer.v_clip_rate,
                               (k_clip * k_factor).tolist(), (v_clip * v_factor).tolist()))
    return out


def equalize(config: ModelConfig, weights: dict[str, torch.Tensor],
             ranges: list[LayerRanges], power_of_two: bool = False) -> tuple[dict[str, torch.Tensor], KVScales]:
    """Weights with equalization folded into ``qkv`` and ``dense``, and the scales (amax / 127) that fit them.

    ``ranges`` are the calibrated per-channel K/V ranges of the original weights
    (``ScalesFile.ranges``). Tensors keep their dtype; untouched ones are shared.
    A stored ``kv_cache_scaling_factor`` is replaced by the new shared scale.
    """
    if len(ranges) != config.num_hidden_layers:
        raise ValueError(f"ranges cover {len(ranges)} layers, the model has {config.num_hidden_layers}; "
                         "calibrate this model again")
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_size
    group = heads // kv_heads
    q_out, kv_out = heads * d, kv_heads * d
    out = dict(weights)
    new_ranges = equalized_ranges(ranges, power_of_two)
    for layer, layer_ranges in enumerate(ranges):
        k_factor, v_factor = equalization_factors(layer_ranges, power_of_two)
        if tuple(k_factor.shape) != (kv_heads, d):
            raise ValueError(f"layer {layer}: ranges have shape {list(k_factor.shape)}, the model needs "
                             f"[{kv_heads}, {d}]; calibrate this model again")
        q_factor = (1 / k_factor).repeat_interleave(group, dim=0).flatten()  # query head h is in group h // group
        row_factor = torch.cat([q_factor, k_factor.flatten(), v_factor.flatten()])
        p = layer_prefix(layer)
        rows = out[f"{p}.attention.qkv.weight"].shape[0]
        if rows != q_out + 2 * kv_out:
            raise ValueError(f"layer {layer}: qkv has {rows} rows, expected {q_out + 2 * kv_out}")
        for name in (f"{p}.attention.qkv.weight", f"{p}.attention.qkv.bias"):
            if name in out:
                t = out[name]
                shape = (-1,) + (1,) * (t.dim() - 1)
                out[name] = (t.double() * row_factor.view(shape)).to(t.dtype)
        dense = out[f"{p}.attention.dense.weight"]
        column_factor = (1 / v_factor).repeat_interleave(group, dim=0).flatten()
        out[f"{p}.attention.dense.weight"] = (dense.double() * column_factor[None, :]).to(dense.dtype)
    fitted = [calibrated_ranges(r) for r in new_ranges]
    scales = KVScales(k=[float(k.max()) / INT8_MAX for k, _ in fitted], v=[float(v.max()) / INT8_MAX for _, v in fitted])
    for layer, shared in enumerate(scales.shared()):
        name = f"{layer_prefix(layer)}.attention.kv_cache_scaling_factor"
        if name in out:
            out[name] = torch.tensor([shared], dtype=torch.float32)
    return out, scales
