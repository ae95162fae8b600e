"""INT4 KV (KIVI-style) and quantize/dequantize error bounds of every KV cache mode."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.kv.int4 import (VALUE_GROUP, Int4KV, buffers_per_sequence, dequantize_keys, dequantize_values,
                                      pack_nibbles, quantize_keys, quantize_values, unpack_nibbles)
from cabinllm.runtime.kv.modes import REFERENCE_KV_MODES, bytes_per_token
from cabinllm.runtime.kv.quant import fp8_scale
from cabinllm.runtime.kv.storage import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=64)
TPB = 8


def _kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, 2, 64, generator=gen) * torch.linspace(0.5, 12, 64)  # channel-dependent key ranges
    v = torch.randn(tokens, 2, 64, generator=gen) * torch.linspace(0.2, 3, tokens)[:, None, None]
    return k, v


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8)
    assert pack_nibbles(codes).shape == (5, 3, 32)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), tokens=st.integers(1, 40), spread=st.floats(0.01, 100))
def test_int4_error_is_at_most_half_a_step_per_group(seed, tokens, spread):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 2, 64, generator=gen) * spread + spread * torch.rand(1, generator=gen)
    packed, scale, zero = quantize_keys(x)
    err = (dequantize_keys(packed, scale, zero) - x).abs()
    # Per channel over tokens; fp16 storage of zero adds at most 2^-11 of the range's end.
    bound = scale.float() / 2 + x.abs().amax(0) * 2 ** -10 + 1e-6
    assert torch.all(err <= bound)
    packed, scale, zero = quantize_values(x)
    err = (dequantize_values(packed, scale, zero) - x).abs().unflatten(-1, (-1, VALUE_GROUP))
    bound = scale.float() / 2 + x.abs().unflatten(-1, (-1, VALUE_GROUP)).amax(-1) * 2 ** -10 + 1e-6
    assert torch.all(err <= bound[..., None])


def _cache(mode: str, blocks: int = 12, scales: KVScales | None = None, window: int = 0) -> PagedKVCache:
    budget = bytes_per_token(LAYOUT, mode, TPB) * TPB * blocks
    if mode == "int4":
        budget += Int4KV.reserved_bytes(LAYOUT, TPB, window=window)
    options = {"window": window} if mode == "int4" else {}
    return PagedKVCache(LAYOUT, KvCacheConfig(mode, budget, TPB), scales, **options)


def _write_dialogue(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, prefill: int) -> Sequence:
    """Prefill, then decode one token at a time, as generation does; returns the sequence."""
    seq = Sequence()
    cache.allocate(seq, list(range(prefill)))
    for layer in range(LAYOUT.num_layers):
        cache.storage.write(layer, cache.slots(seq, 0, prefill), k[:prefill] * (layer + 1), v[:prefill])
    for t in range(prefill, len(k)):
        cache.append(seq, [t])
        for layer in range(LAYOUT.num_layers):
            cache.storage.write(layer, cache.slots(seq, t, t + 1), k[t:t + 1] * (layer + 1), v[t:t + 1])
    return seq


@pytest.mark.parametrize("mode", REFERENCE_KV_MODES)
def test_every_mode_reads_back_within_its_error_bound(mode):
    k, v = _kv(43, seed=7)
    k_amax, v_amax = [float(k.abs().max() * (layer + 1)) for layer in range(2)], [float(v.abs().max())] * 2
    scales = KVScales(k=[a / 127 for a in k_amax], v=[a / 127 for a in v_amax])
    cache = _cache(mode, scales=scales)
    seq = _write_dialogue(cache, k, v, prefill=13)
    got_k, got_v = cache.read(1, seq)
    want_k = k * 2
    if mode == "fp32":
        k_bound, v_bound = torch.zeros(()), torch.zeros(())
    elif mode == "fp16":
        k_bound, v_bound = want_k.abs() * 2 ** -11, v.abs() * 2 ** -11
    elif mode == "int8":
        k_bound = v_bound = torch.tensor(scales.shared()[1] / 2 * 1.0001)
    elif mode == "int8-separate":
        k_bound, v_bound = torch.tensor(scales.k[1] / 2 * 1.0001), torch.tensor(scales.v[1] / 2 * 1.0001)
    elif mode == "fp8":  # half an e4m3 step: 2^-4 of the value, 2^-10 of the scale below the smallest normal
        step = fp8_scale(scales.shared()[1])
        k_bound, v_bound = want_k.abs() * 2 ** -4 + step * 2 ** -10, v.abs() * 2 ** -4 + step * 2 ** -10
    elif mode == "int8-dynamic":
        k_bound = want_k.abs().amax(-1, keepdim=True) / 127 * 0.5 * 1.01
        v_bound = v.abs().amax(-1, keepdim=True) / 127 * 0.5 * 1.01
    else:  # int4 without a window: half a step of a 16-level group; the newest partial block stays fp16
        k_bound = torch.cat([(want_k[:40].unflatten(0, (5, TPB)).amax(1) - want_k[:40].unflatten(0, (5, TPB)).amin(1))
                             .repeat_interleave(TPB, 0) / 30 * 1.01, want_k[40:].abs() * 2 ** -11])
        grouped = v.unflatten(-1, (-1, VALUE_GROUP))
        v_bound = ((grouped.amax(-1) - grouped.amin(-1)) / 30 * 1.01).repeat_interleave(VALUE_GROUP, -1)
        v_bound[40:] = v[40:].abs() * 2 ** -11
        assert torch.equal(got_k[40:], want_k[40:].half().float())
    assert torch.all((got_k - want_k).abs() <= k_bound + 1e-6)
    assert torch.all((got_v - v).abs() <= v_bound + 1e-6)


def test_int4_bytes_per_token_counts_codes_and_scales():
    # codes: 2 x 128 channels / 2; key scale+zero per block and channel; value scale+zero per token and group
    per_layer_block = TPB * 128 + 128 * 4 + TPB * (128 // VALUE_GROUP) * 4
    assert bytes_per_token(LAYOUT, "int4", TPB) == -(-per_layer_block * 2 // TPB)
    cache = _cache("int4", blocks=5, window=20)
    pool = cache.storage
    stored = sum(t.numel() * t.element_size() for t in (pool.k_codes, pool.v_codes, pool.k_scale, pool.k_zero,
                                                        pool.v_scale, pool.v_zero))
    assert stored == cache.stats().blocks_total * TPB * cache.bytes_per_token()
    # a 20-token window touches up to 3 full blocks of 8, plus the partial block being written
    assert buffers_per_sequence(TPB, 20) == 4
    assert cache.stats().window_bytes == bytes_per_token(LAYOUT, "fp16", TPB) * TPB * 4
    assert bytes_per_token(LAYOUT, "int4", 32) * 3 < bytes_per_token(LAYOUT, "fp16", 32)
    with pytest.raises(ValueError, match="head size divisible by 32"):
        bytes_per_token(KVLayout(1, 1, 48), "int4", 32)


def test_int4_windows_follow_partial_blocks_through_copy_and_free():
    k, v = _kv(20, seed=3)
    cache = _cache("int4", blocks=8)
    first = _write_dialogue(cache, k, v, prefill=20)  # blocks: 8 + 8 quantized, 4 tokens in the window
    assert len(cache.storage._buffers) == 1
    before = cache.read(0, first)
    # A second sequence with the same prefix reuses the two full blocks; its own last block needs a window.
    second = Sequence()
    assert cache.allocate(second, list(range(20)) + [99]) == 16
    for layer in range(LAYOUT.num_layers):
        cache.storage.write(layer, cache.slots(second, 16, 21), torch.cat([k[16:20] * (layer + 1), k[:1]]),
                            torch.cat([v[16:], v[:1]]))
    after = cache.read(0, first)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert len(cache.storage._buffers) == 2
    assert cache.stats().window_bytes == 2 * Int4KV.reserved_bytes(LAYOUT, TPB, window=0)
    cache.free(second)
    cache.free(first)
    assert not cache.storage._buffers and cache.stats().bytes_used == 0


@pytest.mark.parametrize("prefill", [3, 30])
def test_int4_window_keeps_the_newest_tokens_in_fp16(prefill):
    k, v = _kv(45, seed=11)
    window = 12
    cache = _cache("int4", blocks=8, window=window)
    seq = _write_dialogue(cache, k, v, prefill=prefill)
    got_k, got_v = cache.read(0, seq)
    # tokens 32..44 share blocks with the newest 12 tokens (blocks 4 and 5): exact fp16
    assert torch.equal(got_k[32:], k[32:].half().float()) and torch.equal(got_v[32:], v[32:].half().float())
    # older blocks are 4-bit: within half a step of their key groups, and not exact
    older = k[:32].unflatten(0, (4, TPB))
    bound = ((older.amax(1) - older.amin(1)) / 30 * 1.01).repeat_interleave(TPB, 0) + 1e-6
    assert torch.all((got_k[:32] - k[:32]).abs() <= bound) and not torch.equal(got_k[:32], k[:32].half().float())
    assert len(cache.storage._buffers) <= buffers_per_sequence(TPB, window)
    # freed, the full window blocks are quantized and stay cached; a new sequence reuses them
    cache.free(seq)
    assert not cache.storage._buffers
    reuser = Sequence()
    assert cache.allocate(reuser, list(range(40)) + [7]) == 40
    reused_k, _ = cache.storage.read(0, cache.block_table(reuser), 40)
    assert torch.all((reused_k[32:40] - k[32:40]).abs() <= (k[32:40].amax(0) - k[32:40].amin(0)) / 30 * 1.01 + 1e-6)


def test_int4_window_of_a_shared_prefix_stays_fp16_while_one_sequence_needs_it():
    k, v = _kv(16, seed=2)
    cache = _cache("int4", blocks=10, window=16)
    first = _write_dialogue(cache, k, v, prefill=16)
    second = Sequence()
    assert cache.allocate(second, list(range(16)) + list(range(100, 120))) == 16  # both blocks of the first reused
    for layer in range(LAYOUT.num_layers):
        cache.storage.write(layer, cache.slots(second, 16, 36), torch.randn(20, 2, 64), torch.randn(20, 2, 64))
    got_k, _ = cache.read(0, first)
    assert torch.equal(got_k[:8], k[:8].half().float())  # the first sequence still has block 0 in its window
    cache.free(first)
    got_k, _ = cache.storage.read(0, cache.block_table(second), 8)
    assert not torch.equal(got_k, k[:8].half().float())  # no window holds it any more: quantized
