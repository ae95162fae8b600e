"""Paged KV cache: bytes per token, quantization error, budget, reuse."""
import pytest
import torch

from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import DEFAULT_TOKENS_PER_BLOCK, KvCacheConfig, PagedKVCache
from cabinllm.runtime.kv.modes import bytes_per_token
from cabinllm.runtime.kv.quant import INT8_MAX, dequantize_per_token, quantize_per_token, quantize_static
from cabinllm.runtime.kv.storage import KVLayout

SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_size=64)
TINY = KVLayout(num_layers=2, num_kv_heads=2, head_size=8)


def test_default_model_bytes_per_token():
    tpb = DEFAULT_TOKENS_PER_BLOCK
    fp16 = bytes_per_token(SMOLLM2, "fp16", tpb)
    assert fp16 == 23040  # 30 layers x 3 KV heads x 64 channels x (K, V) x 2 bytes
    assert bytes_per_token(SMOLLM2, "fp32", tpb) == 2 * fp16
    for mode in ("int8", "int8-separate", "int8-dynamic"):
        assert bytes_per_token(SMOLLM2, mode, tpb) <= 0.53 * fp16, mode
    assert bytes_per_token(SMOLLM2, "int8-dynamic", tpb) > bytes_per_token(SMOLLM2, "int8", tpb)  # scales are counted


def test_unknown_mode_and_tiny_budget_are_clear_errors():
    with pytest.raises(ValueError, match="unknown KV cache mode"):
        bytes_per_token(TINY, "int3", 4)
    with pytest.raises(ValueError, match="raise the budget"):
        PagedKVCache(TINY, KvCacheConfig("fp16", 10, 4))
    with pytest.raises(ValueError, match="needs static scales"):
        PagedKVCache(TINY, KvCacheConfig("int8", 1 << 20, 4))


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


@pytest.mark.parametrize("mode", ["fp32", "fp16", "int8", "int8-separate", "int8-dynamic", "fp8"])
def test_write_read_round_trip(mode):
    torch.manual_seed(0)
    k, v = torch.randn(37, 2, 8), torch.randn(37, 2, 8) * 0.1
    scales = KVScales(k=[float(k.abs().max()) / INT8_MAX] * 2, v=[float(v.abs().max()) / INT8_MAX] * 2)
    cache = PagedKVCache(TINY, KvCacheConfig(mode, 1 << 20, 5), scales)
    seq = Sequence()
    cache.allocate(seq, list(range(37)))
    cache.storage.write(1, cache.slots(seq, 0, 37), k, v)
    got_k, got_v = cache.storage.read(1, cache.block_table(seq), 37)
    tolerance = {"fp32": 0, "fp16": 2e-3, "int8": scales.shared()[0], "int8-separate": scales.k[0],
                 "int8-dynamic": 0.03, "fp8": float(k.abs().max()) / 16}[mode]  # fp8: half a step of 3 bits
    assert (got_k - k).abs().max() <= tolerance
    v_tol = {"int8": scales.shared()[0], "int8-separate": scales.v[0] / 2 + 1e-6}.get(mode, tolerance * 0.1 + 1e-6)
    assert (got_v - v).abs().max() <= v_tol


def test_budget_bounds_the_pool_and_stats_count_usage():
    budget = 10_000
    cache = PagedKVCache(TINY, KvCacheConfig("fp16", budget, 4))
    s = cache.stats()
    assert s.bytes_reserved <= budget and s.bytes_reserved == s.blocks_total * 4 * bytes_per_token(TINY, "fp16", 4)
    cache.allocate(Sequence(), list(range(9)))
    s = cache.stats()
    assert s.blocks_in_use == 3 and s.bytes_used == 3 * 4 * bytes_per_token(TINY, "fp16", 4)


def test_new_sequence_reuses_cached_prefix_blocks():
    cache = PagedKVCache(TINY, KvCacheConfig("fp16", 1 << 20, 4))
    prompt = list(range(10))
    first, second = Sequence(), Sequence()
    assert cache.allocate(first, prompt) == 0
    cache.free(first)
    assert cache.allocate(second, prompt + [99]) == 8
    assert cache.stats().reuse_hits == 2


@pytest.mark.parametrize("mode", ["int8", "int8-separate", "fp16", "fp8"])
def test_unscaled_read_times_its_scales_is_the_dequantized_read(mode):
    torch.manual_seed(1)
    k, v = torch.randn(20, 2, 8), torch.randn(20, 2, 8) * 0.1
    scales = KVScales(k=[0.02, 0.03], v=[0.001, 0.002])
    cache = PagedKVCache(TINY, KvCacheConfig(mode, 1 << 20, 8), scales)
    seq = Sequence()
    cache.allocate(seq, list(range(20)))
    cache.storage.write(1, cache.slots(seq, 0, 20), k, v)
    table = cache.block_table(seq)
    raw_k, raw_v, k_scale, v_scale = cache.storage.read_unscaled(1, table, 20)
    want_k, want_v = cache.storage.read(1, table, 20)
    assert torch.allclose(raw_k * k_scale, want_k, atol=1e-7) and torch.allclose(raw_v * v_scale, want_v, atol=1e-7)
    assert (k_scale, v_scale) != (1.0, 1.0) or mode == "fp16"
