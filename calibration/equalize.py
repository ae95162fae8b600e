"""KV equalization: fold per-channel factors into the weights so one shared INT8 scale per layer fits K and V.

Attention is linear in V (``softmax(QK^T) V W_o``) and, per RoPE pair, in K
(``q.k`` is unchanged if a pair of k is scaled by ``a`` and the same pair of q by
``1/a``; RoPE rotates both channels of a pair by the same angle). So:

- V channel c of KV head g: ``v`` row of ``qkv`` times ``a``, matching ``dense``
  column of every query head in group g divided by ``a``;
- K pair (j, j + head_size/2) of KV head g: both ``k`` rows times ``b``, the same
  pair of ``q`` rows of every query head in group g divided by ``b``.

Where RoPE rotates only the first ``rotary_dim`` channels (Phi-3), its pairs are (j, j + rotary_dim/2) and every
other channel scales on its own. Where each k head passes an RMSNorm after the projection (``qk_layernorm``:
Qwen3, Gemma 3), a factor in ``k`` rows would be normalized away: K factors go into the norm's weight, which
every KV head shares, so they are one per channel (the largest range over the heads sets it) and the query
norm's weight takes the inverse; the first token's K stays off the grid (a rotation is no norm weight).

Factors bring every channel's calibrated range (its clip by the calibration
method, else its abs-max) to the layer's geometric mean (within [1/MAX_FACTOR,
MAX_FACTOR]), so the shared scale quantizes like a static per-channel scale. With full-precision KV the model's outputs do not change:
up to float rounding with exact factors, bit for bit (in fp32 and fp16 weights
alike) with ``power_of_two`` factors, which fit the shared scale less tightly.

Given the token every sequence starts with (``first_token``: the chat template's ``<|im_start|>``), its K and V
are the same in every sequence (position 0 attends to itself only, RoPE leaves it as it is), and it is the
attention sink: most queries read it, so its rounding error is a bias they all share, not noise that averages
out. Equalization then also puts that token's K and V on the INT8 grid of the shared scale, so they are
stored exactly: each RoPE pair of K is multiplied by the nearest complex number (a rotation within the pair,
which commutes with RoPE, and a scale in [MIN_PAIR_SCALE, 1]) that lands it on integer steps, the matching
query pair by its inverse; each KV head of V turns, in the plane of its first-token vector and the nearest
grid point no longer than it, onto that point, the ``dense`` columns by the inverse.
"""
from __future__ import annotations

import torch

from dataclasses import dataclass

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.checkpoint import ModelConfig, layer_prefix
from cabinllm.runtime.formats.scales_file import KVScales, LayerRanges
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.kv.quant import INT8_MAX
from cabinllm.runtime.model.transformer import Transformer

MAX_FACTOR = 64.0  # bounds factors so fp16 weights neither overflow nor lose precision
FIRST_TOKEN = "first_token"  # kv_scales.json's data key: the token every calibration sequence starts with
MIN_PAIR_SCALE = 0.8  # a K pair moved onto the grid keeps at least this share of its range (a coarser grid costs)


def calibrated_ranges(ranges: LayerRanges) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V range per channel that equalization fits: the method's clip if stored, else the abs-max."""
    k = ranges.k_channel_clip if ranges.k_channel_clip is not None else ranges.k_channel_amax
    v = ranges.v_channel_clip if ranges.v_channel_clip is not None else ranges.v_channel_amax
    return torch.tensor(k, dtype=torch.float64), torch.tensor(v, dtype=torch.float64)


@dataclass(frozen=True)
class KeyGrouping:
    """Which K channels must share a factor: RoPE pairs within the first ``rotated`` channels (None: all), and
    every KV head alike where ``shared_heads`` (a k norm's weight after the projection)."""

    rotated: int | None = None
    shared_heads: bool = False

    @classmethod
    def of(cls, config: ModelConfig) -> "KeyGrouping":
        """The grouping of a model's keys."""
        return cls(config.rotary_dim, config.qk_layernorm)


def rope_pair_max(k_range: torch.Tensor, grouping: KeyGrouping = KeyGrouping()) -> torch.Tensor:
    """(kv_heads, head_size): each K channel's range raised to the largest of the channels it shares a factor with
    (its RoPE pair (j, j + rotated / 2), and the same channel of every KV head where they share one)."""
    d = k_range.shape[1]
    half = (grouping.rotated or d) // 2
    pair = torch.maximum(k_range[:, :half], k_range[:, half:2 * half])
    out = torch.cat([pair, pair, k_range[:, 2 * half:]], dim=1)
    return out.amax(0, keepdim=True).expand_as(out).clone() if grouping.shared_heads else out


def equalization_factors(ranges: LayerRanges, power_of_two: bool = False,
                         grouping: KeyGrouping = KeyGrouping()) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V factors of one layer, each (kv_heads, head_size) float64; K factors are equal within what
    ``grouping`` shares.

    ``power_of_two`` rounds each factor to the nearest power of two, so folding it changes no bit of the outputs.
    """
    k_range, v_range = calibrated_ranges(ranges)
    k_shared = rope_pair_max(k_range, grouping)
    measured = torch.cat([k_shared.flatten(), v_range.flatten()])
    measured = measured[measured > 0]
    if measured.numel() == 0:
        raise ConfigError("a layer has no non-zero K/V range; calibrate on real dialogues before equalizing")
    target = measured.log().mean().exp()

    def factor(channel_range: torch.Tensor) -> torch.Tensor:
        safe = torch.where(channel_range > 0, channel_range, target)
        f = (target / safe).clamp(1 / MAX_FACTOR, MAX_FACTOR)
        return 2.0 ** f.log2().round() if power_of_two else f

    return factor(k_shared), factor(v_range)


def equalized_ranges(ranges: list[LayerRanges], power_of_two: bool = False,
                     grouping: KeyGrouping = KeyGrouping()) -> list[LayerRanges]:
    """The channel abs-max and clips each layer will have once its equalization factors are folded in."""
    out = []
    for layer in ranges:
        k_factor, v_factor = equalization_factors(layer, power_of_two, grouping)
        k_clip, v_clip = calibrated_ranges(layer)
        k = torch.tensor(layer.k_channel_amax, dtype=torch.float64) * k_factor
        v = torch.tensor(layer.v_channel_amax, dtype=torch.float64) * v_factor
        out.append(LayerRanges(k.tolist(), v.tolist(), layer.k_clip_rate, layer.v_clip_rate,
                               (k_clip * k_factor).tolist(), (v_clip * v_factor).tolist()))
    return out


def equalize(config: ModelConfig, weights: dict[str, torch.Tensor], ranges: list[LayerRanges],
             power_of_two: bool = False, first_token: int | None = None) -> tuple[dict[str, torch.Tensor], KVScales]:
    """Weights with equalization folded into ``qkv`` and ``dense``, and the scales (amax / 127) that fit them.

    ``ranges`` are the calibrated per-channel K/V ranges of the original weights
    (``ScalesFile.ranges``). Tensors keep their dtype; untouched ones are shared.
    A stored ``kv_cache_scaling_factor`` is replaced by the new shared scale.
    With ``first_token``, that token's K and V at position 0 are put on the grid of the shared scale.
    """
    if power_of_two and first_token is not None:
        raise ConfigError("power-of-two factors keep outputs bit for bit, a first token on the grid does not: "
                         "choose one")
    if len(ranges) != config.num_hidden_layers:
        raise ConfigError(f"ranges cover {len(ranges)} layers, the model has {config.num_hidden_layers}; "
                         "calibrate this model again")
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_size
    group = heads // kv_heads
    q_out, kv_out = heads * d, kv_heads * d
    out, grouping = dict(weights), KeyGrouping.of(config)
    new_ranges = equalized_ranges(ranges, power_of_two, grouping)
    for layer, layer_ranges in enumerate(ranges):
        k_factor, v_factor = equalization_factors(layer_ranges, power_of_two, grouping)
        if tuple(k_factor.shape) != (kv_heads, d):
            raise ConfigError(f"layer {layer}: ranges have shape {list(k_factor.shape)}, the model needs "
                             f"[{kv_heads}, {d}]; calibrate this model again")
        p = layer_prefix(layer)
        if grouping.shared_heads:  # the k norm's weight takes the factors, the q norm's their inverse
            for name, f in ((f"{p}.attention.k_layernorm.weight", k_factor[0]),
                            (f"{p}.attention.q_layernorm.weight", 1 / k_factor[0])):
                out[name] = (out[name].double() * f).to(out[name].dtype)
            k_factor = torch.ones_like(k_factor)
        q_factor = (1 / k_factor).repeat_interleave(group, dim=0).flatten()  # query head h is in group h // group
        row_factor = torch.cat([q_factor, k_factor.flatten(), v_factor.flatten()])
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
    if first_token is not None:
        out = align_first_token(config, out, scales.shared(), first_token)
    return out, scales


def first_token_kv(config: ModelConfig, weights: dict[str, torch.Tensor],
                   token: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K and V, each (kv_heads, head_size) float64, of every layer for ``token`` at position 0."""
    run = run_tokens(Transformer(config, weights), [token])
    return [(k[0].double(), v[0].double()) for k, v in (run.kv(layer) for layer in range(config.num_hidden_layers))]


def pair_multipliers(k_steps: torch.Tensor) -> torch.Tensor:
    """Complex multiplier per RoPE pair (kv_heads, head_size / 2) that puts the pair of ``k_steps`` (K in INT8 steps,
    (kv_heads, head_size)) on integer steps, the one nearest 1 with modulus in [MIN_PAIR_SCALE, 1]; 1 where none is."""
    half = k_steps.shape[1] // 2
    pair = torch.complex(k_steps[:, :half], k_steps[:, half:])[..., None]
    offsets = torch.arange(-2.0, 4.0, dtype=torch.float64)
    real, imag = torch.broadcast_tensors((pair.real.floor() + offsets)[..., :, None],
                                         (pair.imag.floor() + offsets)[..., None, :])
    candidates = torch.complex(real, imag).flatten(-2) / pair
    fits = (candidates.abs() >= MIN_PAIR_SCALE) & (candidates.abs() <= 1) & (pair.abs() > 0)
    cost = torch.where(fits, (candidates - 1).abs(), torch.inf)
    best = candidates.gather(-1, cost.argmin(-1, keepdim=True)).squeeze(-1)
    return torch.where(fits.any(-1), best, torch.ones_like(best))


def grid_rotation(v_steps: torch.Tensor) -> torch.Tensor:
    """(head_size, head_size): a rotation in the plane of ``v_steps`` (one KV head's V in INT8 steps) and the nearest
    grid point no longer than it, scaled to turn ``v_steps`` onto that point."""
    point = v_steps.round()
    if point.norm() > v_steps.norm():
        point = v_steps.trunc()
    eye = torch.eye(len(v_steps), dtype=torch.float64)
    if point.norm() == 0:
        return eye
    u = v_steps / v_steps.norm()
    cos = float((u @ point / point.norm()).clamp(-1, 1))
    w = point / point.norm() - cos * u
    if w.norm() < 1e-12:  # already along a grid direction
        return eye * (point.norm() / v_steps.norm())
    w = w / w.norm()
    sin = (1 - cos * cos) ** 0.5
    rotation = eye + (cos - 1) * (torch.outer(u, u) + torch.outer(w, w)) + sin * (torch.outer(w, u) - torch.outer(u, w))
    return rotation * (point.norm() / v_steps.norm())


def _mix_pairs(rows: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Rows (head_size, ...) of one head with each RoPE pair (j, j + half) multiplied by c[j] (complex), half =
    len(c); rows past the rotated channels pass."""
    half = len(c)
    shape = (-1,) + (1,) * (rows.dim() - 1)
    re, im = c.real.view(shape), c.imag.view(shape)
    first, second = rows[:half], rows[half:2 * half]
    return torch.cat([re * first - im * second, im * first + re * second, rows[2 * half:]])


def align_first_token(config: ModelConfig, weights: dict[str, torch.Tensor], shared: list[float],
                      token: int) -> dict[str, torch.Tensor]:
    """Equalized weights turned so that ``token``'s K and V at position 0 fall on the INT8 grid of each layer's
    ``shared`` scale (exact under int8 with those scales); full-precision outputs do not change."""
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_size
    group = heads // kv_heads
    out, rotated = dict(weights), config.rotated_channels
    for layer, (k, v) in enumerate(first_token_kv(config, weights, token)):
        multipliers = pair_multipliers(k[:, :rotated] / shared[layer])
        if config.qk_layernorm:
            multipliers = torch.ones_like(multipliers)
        rotations = [grid_rotation(v[g] / shared[layer]) for g in range(kv_heads)]
        p = layer_prefix(layer)
        for name in (f"{p}.attention.qkv.weight", f"{p}.attention.qkv.bias"):
            if name not in out:
                continue
            t = out[name].double()
            blocks = list(t.split(d))  # heads query blocks, then kv_heads K blocks, then kv_heads V blocks
            for g in range(kv_heads):
                c = multipliers[g]
                blocks[heads + g] = _mix_pairs(blocks[heads + g], c)
                for h in range(g * group, (g + 1) * group):
                    blocks[h] = _mix_pairs(blocks[h], c / c.abs() ** 2)
                v_rows = blocks[heads + kv_heads + g]
                blocks[heads + kv_heads + g] = (rotations[g] @ v_rows.reshape(d, -1)).reshape(v_rows.shape)
            out[name] = torch.cat(blocks).to(out[name].dtype)
        dense = out[f"{p}.attention.dense.weight"]
        columns = list(dense.double().split(d, dim=1))
        for h in range(heads):
            columns[h] = columns[h] @ torch.linalg.inv(rotations[h // group])
        out[f"{p}.attention.dense.weight"] = torch.cat(columns, dim=1).to(dense.dtype)
    return out
