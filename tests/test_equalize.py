"""KV equalization keeps full-precision outputs (on the tiny model and the default one) and makes one shared INT8
scale per layer fit better (on the default model: a property of real weights)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cabinllm.calibration.clips import compute_clips, layer_ranges
from cabinllm.calibration.equalize import (MAX_FACTOR, MIN_PAIR_SCALE, equalization_factors, equalize, equalized_ranges,
                                           first_token_kv, grid_rotation, pair_multipliers)
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.calibration.stats import collect_stats
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.checkpoint import layer_prefix, load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.formats.scales_file import LayerRanges
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.kv.modes import bytes_per_token
from cabinllm.runtime.model.transformer import Transformer


@pytest.fixture(scope="module")
def calibrate() -> Callable[[Engine], tuple]:
    """An engine's weights, per-channel ranges and scales from a few short train dialogues and the token ids of a
    held-out one (96 tokens each: the tiny model's word-level tokenizer makes some dialogues shorter), computed
    once per engine in this module."""
    done: dict[Path, tuple] = {}

    def get(engine: Engine) -> tuple:
        if engine.folder not in done:
            config, weights = load_checkpoint(engine.folder / CHECKPOINT_DIR)
            train, _ = prepare_dialogues("builtin", "train", 4, 0, engine.tokenizer, max_tokens=96, min_tokens=96)
            stats = collect_stats(engine.model, train, progress=False)
            clips = compute_clips(stats, "max")
            held, _ = prepare_dialogues("builtin", "heldout", 1, 0, engine.tokenizer, max_tokens=96, min_tokens=96)
            done[engine.folder] = config, weights, layer_ranges(stats, clips), clips.scales(), held[0].token_ids
        return done[engine.folder]

    return get


@pytest.fixture
def calibrated(engine, calibrate) -> tuple:
    """The engine's weights, per-channel ranges and scales, and held-out token ids."""
    return calibrate(engine)


def _logits(model: Transformer, ids: list[int], mode: str = "fp32", scales=None) -> torch.Tensor:
    layout = model.kv_layout
    cache = PagedKVCache(layout, KvCacheConfig(mode, bytes_per_token(layout, mode, 32) * 32 * 4, 32), scales)
    seq = Sequence()
    cache.allocate(seq, ids)
    return model.forward(ids, 0, cache, seq, all_logits=True)


def test_factors_are_shared_within_rope_pairs_and_bounded():
    k = [[1.0, 8.0, 4.0, 0.5], [2.0, 2.0, 2.0, 2.0]]
    v = [[0.25, 0.0, 1.0, 1e-9], [2.0, 2.0, 2.0, 2.0]]
    k_factor, v_factor = equalization_factors(LayerRanges(k, v))
    assert torch.equal(k_factor[:, :2], k_factor[:, 2:])
    pair = torch.tensor([[4.0, 8.0], [2.0, 2.0]])
    assert torch.allclose(k_factor[:, :2] * pair, (k_factor[0, 0] * pair[0, 0]).expand(2, 2).double())
    assert v_factor[0, 1] == 1.0  # an all-zero channel is left alone
    assert v_factor.max() <= MAX_FACTOR and v_factor[0, 3] == MAX_FACTOR
    pow2_k, pow2_v = equalization_factors(LayerRanges(k, v), power_of_two=True)
    assert torch.equal(pow2_k.log2(), pow2_k.log2().round()) and torch.equal(pow2_v.log2(), pow2_v.log2().round())
    (eq,) = equalized_ranges([LayerRanges(k, v)])
    assert max(max(h) for h in eq.k_channel_amax) == pytest.approx(max(max(h) for h in eq.v_channel_amax))


def test_factors_fit_the_calibrated_clips_when_the_file_has_them():
    amax = [[4.0, 4.0], [4.0, 4.0]]
    clipped = LayerRanges(amax, amax, k_channel_clip=[[1.0, 1.0], [4.0, 4.0]], v_channel_clip=amax)
    k_factor, v_factor = equalization_factors(clipped)
    assert torch.allclose(k_factor[0] * 1.0, v_factor[0] * 4.0) and torch.allclose(k_factor[1], v_factor[1])
    (eq,) = equalized_ranges([clipped])
    assert eq.k_channel_clip[0] == pytest.approx(eq.v_channel_clip[0])
    assert eq.k_channel_amax[0][0] == pytest.approx(4 * eq.k_channel_clip[0][0])  # values above the clip saturate


# Float rounding of the folded weights, as the network amplifies it: logits move by up to 7e-5 on the default model
# (largest logit 38), by up to 2.4e-4 on the tiny random one (largest 12: its random weights make attention sharp).
@pytest.mark.parametrize("model, tolerance", [("tiny", 5e-4), pytest.param("default", 1e-4, marks=pytest.mark.slow)])
def test_equalization_leaves_full_precision_logits_unchanged(request, calibrate, model, tolerance):
    config, weights, ranges, _, ids = calibrate(request.getfixturevalue(f"{model}_engine"))
    reference = _logits(Transformer(config, weights), ids)
    exact, eq_scales = equalize(config, weights, ranges)
    assert float((_logits(Transformer(config, exact), ids) - reference).abs().max()) <= tolerance
    assert eq_scales.k == pytest.approx(eq_scales.v)  # every channel of K and V now reaches the same range
    pow2, _ = equalize(config, weights, ranges, power_of_two=True)
    assert torch.equal(_logits(Transformer(config, pow2), ids), reference)
    qkv = f"{layer_prefix(min(3, config.num_hidden_layers - 1))}.attention.qkv.weight"
    assert exact[qkv].dtype == weights[qkv].dtype and not torch.equal(exact[qkv], weights[qkv])
    assert exact["lm_head.weight"] is weights["lm_head.weight"]


def test_equalized_shared_int8_beats_plain_shared_int8(default_engine, calibrate):
    config, weights, ranges, scales, ids = calibrate(default_engine)
    model = Transformer(config, weights)
    reference = _logits(model, ids).log_softmax(-1)
    eq_weights, eq_scales = equalize(config, weights, ranges)

    def kl(logits: torch.Tensor) -> float:
        return float((reference.exp() * (reference - logits.log_softmax(-1))).sum(-1).mean())

    plain = kl(_logits(model, ids, "int8", scales))
    equalized = kl(_logits(Transformer(config, eq_weights), ids, "int8", eq_scales))
    assert equalized < plain / 3
    assert eq_scales.k == pytest.approx(eq_scales.v)  # every channel of K and V now reaches the same range


def test_equalize_rewrites_a_stored_shared_scale_and_rejects_other_models(calibrated):
    config, weights, ranges, _, _ = calibrated
    name = f"{layer_prefix(0)}.attention.kv_cache_scaling_factor"
    out, scales = equalize(config, {**weights, name: torch.tensor([9.0])}, ranges)
    assert float(out[name]) == pytest.approx(scales.shared()[0])
    with pytest.raises(ValueError, match="ranges cover 2 layers"):
        equalize(config, weights, ranges[:2])


def test_pair_multipliers_put_rope_pairs_on_integer_steps():
    k = torch.tensor([[3.3, 10.2, 0.2, 0.4, -5.7, 0.1]], dtype=torch.float64)  # pairs (3.3, 0.4), (10.2, -5.7), (0.2, 0.1)
    c = pair_multipliers(k)
    moved = c * torch.complex(k[:, :3], k[:, 3:])
    assert torch.allclose(moved[:, :2].real, moved[:, :2].real.round()) and torch.allclose(moved[:, :2].imag,
                                                                                          moved[:, :2].imag.round())
    assert bool(((c[:, :2].abs() >= MIN_PAIR_SCALE) & (c[:, :2].abs() <= 1 + 1e-12)).all())
    assert c[0, 2] == 1  # no grid point within reach of a pair this small: left alone


def test_grid_rotation_turns_a_vector_onto_the_grid_without_lengthening_it():
    v = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 5
    m = grid_rotation(v)
    assert torch.allclose(m @ v, (m @ v).round(), atol=1e-9) and (m @ v).norm() <= v.norm()
    scale = (m @ v).norm() / v.norm()
    assert torch.allclose(m @ m.T / scale ** 2, torch.eye(64, dtype=torch.float64), atol=1e-12)


def test_first_token_is_stored_exactly_and_full_precision_logits_stay(calibrated):
    config, weights, ranges, _, ids = calibrated
    reference = _logits(Transformer(config, weights), ids)
    aligned, scales = equalize(config, weights, ranges, first_token=ids[0])
    _, plain_scales = equalize(config, weights, ranges)
    assert scales.shared() == plain_scales.shared()
    # the turns add float rounding of their own: 5.2e-4 on the tiny model, 5.7e-5 on the default one
    assert float((_logits(Transformer(config, aligned), ids) - reference).abs().max()) <= 1e-3
    for (k, v), step in zip(first_token_kv(config, aligned, ids[0]), scales.shared()):
        assert float((v / step - (v / step).round()).abs().max()) < 1e-3
        half = k.shape[1] // 2
        pairs = torch.stack([k[:, :half], k[:, half:]], dim=-1) / step
        reachable = pairs.norm(dim=-1) >= 9  # a pair this long always has a grid point within its multiplier's reach
        assert bool(reachable.any()) and bool(((pairs - pairs.round()).abs()[reachable] < 1e-3).all())
    with pytest.raises(ValueError, match="choose one"):
        equalize(config, weights, ranges, power_of_two=True, first_token=ids[0])
