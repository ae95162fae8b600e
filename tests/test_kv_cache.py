"""Paged KV cache: bytes per token, quantization error, budget, copy-on-write, reuse."""
import pytest
import torch

from runtime.kv_cache import KVLayout, KVScales, PagedKVCache
from runtime.kv_quant import INT8_MAX, quantize_per_token, dequantize_per_token, quantize_static

SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_size=64)
TINY = KVLayout(num_layers=2, num_kv_heads=2, head_size=8)


def test_default_model_bytes_per_token():
    fp16 = SMOLLM2.bytes_per_token("fp16")
    assert fp16 == 23040  # DESIGN.md
    assert SMOLLM2.bytes_per_token("fp32") == 2 * fp16
    for mode in ("int8", "int8-separate", "int8-dynamic"):
        assert SMOLLM2.bytes_per_token(mode) <= 0.53 * fp16, mode
    assert SMOLLM2.bytes_per_token("int8-dynamic") > SMOLLM2.bytes_per_token("int8")  # scales are counted


def test_unknown_mode_and_tiny_budget_are_clear_errors():
    with pytest.raises(ValueError, match="unknown KV cache mode"):
        TINY.bytes_per_token("int3")
    with pytest.raises(ValueError, match="raise the budget"):
        PagedKVCache(TINY, "fp16", 10, 4)
    with pytest.raises(ValueError, match="needs static scales"):
        PagedKVCache(TINY, "int8", 1 << 20, 4)


def test_static_int8_error_is_at_most_half_a_step():
    x = torch.randn(50, 2, 8) * 4
    scale = float(x.abs().max()) / INT8_MAX
    restored = quantize_static(x, scale).float() * scale
    assert (restored - x).abs().max() <= scale / 2 + 1e-6


def test_dynamic_int8_error_is_bounded_per_token_and_head():
    x = torch.randn(50, 2, 8) * torch.logspace(-2, 2, 50)[:, None, None]
    codes, scale = quantize_per_token(x)
    err = (dequantize_per_token(codes, scale) - x).abs()
    step = x.abs().amax(-1) / INT8_MAX
    assert bool((err.amax(-1) <= step * 0.5 * 1.01 + 1e-7).all())  # 1% for the fp16 rounding of the scale


@pytest.mark.parametrize("mode", ["fp32", "fp16", "int8", "int8-separate", "int8-dynamic"])
def test_write_read_round_trip(mode):
    torch.manual_seed(0)
    k, v = torch.randn(37, 2, 8), torch.randn(37, 2, 8) * 0.1
    scales = KVScales(k=[float(k.abs().max()) / INT8_MAX] * 2, v=[float(v.abs().max()) / INT8_MAX] * 2)
    cache = PagedKVCache(TINY, mode, 1 << 20, 5, scales)
    cache.allocate(7, list(range(37)))
    cache.write(1, cache.slots(7, 0, 37), k, v)
    got_k, got_v = cache.read(1, cache.block_table(7), 37)
    tolerance = {"fp32": 0, "fp16": 2e-3, "int8": scales.shared()[0], "int8-separate": scales.k[0],
                 "int8-dynamic": 0.03}[mode]
    assert (got_k - k).abs().max() <= tolerance
    v_tol = {"int8": scales.shared()[0], "int8-separate": scales.v[0] / 2 + 1e-6}.get(mode, tolerance * 0.1 + 1e-6)
    assert (got_v - v).abs().max() <= v_tol


def test_budget_bounds_the_pool_and_stats_count_usage():
    budget = 10_000
    cache = PagedKVCache(TINY, "fp16", budget, 4)
    s = cache.stats()
    assert s.bytes_reserved <= budget and s.bytes_reserved == s.blocks_total * 4 * TINY.bytes_per_token("fp16")
    cache.allocate(0, list(range(9)))
    s = cache.stats()
    assert s.blocks_in_use == 3 and s.bytes_used == 3 * 4 * TINY.bytes_per_token("fp16")


def test_fork_copies_the_shared_block_before_writing():
    cache = PagedKVCache(TINY, "fp32", 1 << 20, 4)
    cache.allocate(0, [1, 2, 3, 4, 5, 6])
    k = torch.arange(6 * 16, dtype=torch.float32).view(6, 2, 8)
    cache.write(0, cache.slots(0, 0, 6), k, k)
    cache.blocks.fork(0, 1)
    cache.append(1, [7])
    assert cache.block_table(1)[1] != cache.block_table(0)[1]
    cache.write(0, cache.slots(1, 6, 7), torch.full((1, 2, 8), -1.0), torch.full((1, 2, 8), -1.0))
    parent_k, _ = cache.read(0, cache.block_table(0), 6)
    child_k, _ = cache.read(0, cache.block_table(1), 7)
    assert torch.equal(parent_k, k) and torch.equal(child_k[:6], k) and bool((child_k[6] == -1).all())


def test_new_sequence_reuses_cached_prefix_blocks():
    cache = PagedKVCache(TINY, "fp16", 1 << 20, 4)
    prompt = list(range(10))
    assert cache.allocate(0, prompt) == 0
    cache.free(0)
    assert cache.allocate(1, prompt + [99]) == 8
    assert cache.stats().reuse_hits == 2


@pytest.mark.parametrize("mode", ["int8", "int8-separate", "fp16"])
def test_unscaled_read_times_its_scales_is_the_dequantized_read(mode):
    torch.manual_seed(1)
    k, v = torch.randn(20, 2, 8), torch.randn(20, 2, 8) * 0.1
    scales = KVScales(k=[0.02, 0.03], v=[0.001, 0.002])
    cache = PagedKVCache(TINY, mode, 1 << 20, 8, scales)
    cache.allocate(0, list(range(20)))
    cache.write(1, cache.slots(0, 0, 20), k, v)
    table = cache.block_table(0)
    raw_k, raw_v, k_scale, v_scale = cache.read_unscaled(1, table, 20)
    want_k, want_v = cache.read(1, table, 20)
    assert torch.allclose(raw_k * k_scale, want_k, atol=1e-7) and torch.allclose(raw_v * v_scale, want_v, atol=1e-7)
    assert (k_scale, v_scale) != (1.0, 1.0) or mode == "fp16"
