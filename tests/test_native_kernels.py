"""The native decode kernels compute what the torch path computes, and fall back cleanly without a compiler."""
import dataclasses
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import BUILDS

from cabinllm.calibration.gguf_weights import to_int4_g32, to_int8_head
from cabinllm.runtime.formats.checkpoint import load_checkpoint
from cabinllm.runtime.formats.engine_folder import EngineFolder
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.formats.weight_formats import weight_format
from cabinllm.runtime.kernels import bindings as native_kernels
from cabinllm.runtime.kernels.bindings import StoredKV
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.kv.modes import kv_mode
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.interface import Span
from cabinllm.runtime.model.transformer import Transformer, grouped_attention

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the kernels")


@pytest.mark.parametrize("rows, cols, with_bias, tokens", [(49, 576, False, 1), (960, 576, True, 1), (3, 7, True, 1),
                                                           (1, 1, False, 1), (49, 576, True, 3), (6, 7, False, 16)])
def test_matvec_equals_linear(rows, cols, with_bias, tokens):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(rows, cols, generator=gen), torch.randn(tokens, cols, generator=gen)
    bias = torch.randn(rows, generator=gen) if with_bias else None
    got = native_kernels.matvec()(x, weight, bias)
    assert got.shape == (tokens, rows)
    assert torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5 * math.sqrt(cols))
    alone = torch.cat([native_kernels.matvec()(row[None], weight, bias) for row in x])
    assert torch.equal(got, alone)  # a token's row does not depend on the others of its step


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("rows, cols, with_bias, tokens", [(49, 576, False, 1), (7, 20, True, 3), (6, 7, False, 16),
                                                           (10, 64, False, 5)])
def test_matvec_over_fp16_weights_equals_linear_on_their_fp32_values(rows, cols, with_bias, tokens, build):
    """fp16 weights (F16C or, built with -DGENERIC, half.h) give what fp32 copies of them give, in every build; each
    token's row as it is alone."""
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(rows, cols, generator=gen).half(), torch.randn(tokens, cols, generator=gen)
    bias = torch.randn(rows, generator=gen) if with_bias else None
    kernel = native_kernels.MatVec(native_kernels._load("matvec", BUILDS[build]))
    got = kernel(x, weight, bias)
    assert torch.allclose(got, F.linear(x, weight.float(), bias), rtol=1e-5, atol=1e-5 * math.sqrt(cols))
    assert torch.equal(got, kernel(x, weight.float(), bias))  # the same sums as fp32 rows
    assert torch.equal(got, torch.cat([kernel(row[None], weight, bias) for row in x]))


@pytest.mark.parametrize("x_shape", [(2, 9), (17, 8), (8,)])
def test_matvec_rejects_a_wrong_shape(x_shape):
    with pytest.raises(ValueError, match=r"\(n, 8\)"):
        native_kernels.matvec()(torch.randn(*x_shape), torch.randn(4, 8))


@pytest.mark.parametrize("mode, kv_heads, group, head_size, tokens_per_block, context", [
    ("int8-separate", 3, 3, 64, 32, 2049), ("int8", 2, 1, 16, 5, 1), ("int8-separate", 1, 4, 32, 7, 96),
    ("int8", 4, 2, 128, 16, 333), ("fp16", 3, 3, 64, 32, 300), ("fp32", 2, 2, 16, 4, 37),
    ("int4", 3, 3, 64, 32, 300), ("int4", 2, 1, 32, 8, 5), ("int8-dynamic", 3, 3, 64, 32, 300),
    ("int8-dynamic", 2, 2, 16, 3, 20), ("int8", 2, 2, 64, 256, 600)])
@pytest.mark.parametrize("build", BUILDS)
def test_decode_attention_equals_torch_path(mode, kv_heads, group, head_size, tokens_per_block, context, build):
    """This CPU's loops (the query heads of a KV head at once with AVX-512's registers), AVX2's and the plain ones
    (-DGENERIC, other CPUs) all equal torch."""
    cache, seq, q = history(mode, kv_heads, group, head_size, tokens_per_block, context)
    table = cache.block_table(seq)
    k, v, k_scale, v_scale = cache.storage.read_unscaled(1, table, context)
    want = grouped_attention(q[None] * k_scale, k, v, context - 1) * v_scale
    stored = cache.storage.stored_kv(1, table, context)
    defines = {**native_kernels.ELEMENT_DEFINES[stored.k.dtype], "HEAD_SIZE": head_size, "GROUP": group}
    kernel = native_kernels.DecodeAttention(native_kernels._load("decode_attention", {**defines, **BUILDS[build]}),
                                            stored.k.dtype, head_size, group)
    assert torch.max(torch.abs(kernel(q, stored, context) - want)) <= 1e-5
    first = context // 3  # a sliding window's start: the tokens before it not attended to
    window = grouped_attention(q[None] * k_scale, k, v, context - 1, window=context - first) * v_scale
    assert torch.max(torch.abs(kernel(q, stored, context, first) - window)) <= 1e-5


@pytest.mark.parametrize("mode", ["int8", "fp16", "int8-dynamic"])
def test_decode_attention_gives_the_same_result_on_any_thread_count(keep_threads, mode):
    """A long history is split over torch's threads (by runs of blocks, combined in order); 1 and 2 threads agree
    exactly."""
    cache, seq, q = history(mode, 3, 3, 64, 32, 1000)
    stored = cache.storage.stored_kv(1, cache.block_table(seq), 1000)
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs.append(native_kernels.decode_attention(stored.k.dtype, 64, 3)(q, stored, 1000))
    assert torch.equal(*runs)


def history(mode: str, kv_heads: int, group: int, head_size: int, tokens_per_block: int, context: int):
    """A paged cache holding one sequence's random K/V (in blocks out of pool order) and a query for it."""
    layout = KVLayout(num_layers=2, num_kv_heads=kv_heads, head_size=head_size)
    scales = KVScales(k=[0.03, 0.05], v=[0.02, 0.04])
    blocks = math.ceil(context / tokens_per_block) + 4
    storage = kv_mode(mode)
    budget = storage.bytes_per_token(layout, tokens_per_block) * tokens_per_block * blocks
    budget += storage.reserved_bytes(layout, tokens_per_block)  # int4: the fp16 window; 0 for the others
    cache = PagedKVCache(layout, KvCacheConfig(mode, budget, tokens_per_block), scales)
    # Another sequence first, freed, so this one's blocks are not in pool order.
    other, seq = Sequence(), Sequence()
    cache.allocate(other, list(range(3 * tokens_per_block)))
    cache.allocate(seq, list(range(1000, 1000 + context)))
    cache.free(other)
    gen = torch.Generator().manual_seed(context)
    keys = torch.randn(context, kv_heads, head_size, generator=gen) * 2
    values = torch.randn(context, kv_heads, head_size, generator=gen)
    cache.storage.write(1, cache.slots(seq, 0, context), keys, values)
    return cache, seq, torch.randn(kv_heads * group, head_size, generator=gen)


def test_int4_dequantize_equals_torch(monkeypatch):
    from cabinllm.runtime.kv.int4 import dequantize_keys, dequantize_values, quantize_keys, quantize_values
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(5, 8, 2, 64, generator=gen), torch.randn(5, 8, 2, 64, generator=gen) * 4
    k, v = quantize_keys(keys), quantize_values(values)
    table = torch.tensor([4, 0, 2])
    got_k, got_v = native_kernels.int4_dequantize(64, 32)(k, v, table)
    want_k = dequantize_keys(k[0][table], k[1][table], k[2][table])
    want_v = dequantize_values(v[0][table], v[1][table], v[2][table])
    assert torch.allclose(got_k, want_k, atol=1e-5) and torch.allclose(got_v, want_v, atol=1e-5)


def test_half_bits_convert_exactly():
    """Every finite fp16 value, normal and subnormal, through the fp16 attention kernel's conversion."""
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[torch.isfinite(halves)]
    pool = halves[: len(halves) // 64 * 64].view(-1, 1, 1, 64)
    kernel = native_kernels.decode_attention(torch.float16, 64, 1)
    ones = torch.zeros(1, 64)  # equal scores: the output is the mean of the values, kept exact with 1 token
    for block in range(0, pool.shape[0], 997):
        got = kernel(ones, StoredKV(pool, pool, torch.tensor([block])), 1)
        assert torch.equal(got[0], pool[block, 0, 0].float())


def test_decode_attention_rejects_another_models_pools():
    kernel = native_kernels.decode_attention(torch.int8, 16, 2)
    codes = torch.zeros(4, 8, 3, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="head size 16 and group 2"):
        kernel(torch.zeros(6, 32), StoredKV(codes, codes, torch.arange(4)), 10)
    codes = torch.zeros(4, 8, 3, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="fp16 token scales"):
        kernel(torch.zeros(6, 16), StoredKV(codes, codes, torch.arange(4), k_token_scales=torch.zeros(4, 8, 3)), 10)
    with pytest.raises(ValueError, match="int64 block ids"):
        kernel(torch.zeros(6, 16), StoredKV(codes, codes, torch.arange(4, dtype=torch.int32)), 10)
    with pytest.raises(ValueError, match="do not fit the 1 blocks"):
        kernel(torch.zeros(6, 16), StoredKV(codes, codes, torch.arange(1)), 10)


def test_int4_dequantize_rejects_other_value_groups():
    codes, half = torch.zeros(2, 8, 1, 32, dtype=torch.uint8), torch.zeros(2, 1, 64, dtype=torch.float16)
    value_scales = torch.zeros(2, 8, 1, 4, dtype=torch.float16)  # groups of 16
    with pytest.raises(ValueError, match="value groups of 32"):
        native_kernels.int4_dequantize(64, 32)((codes, half, half), (codes, value_scales, value_scales),
                                               torch.arange(2))


@pytest.mark.parametrize("mode", ["int8", "fp16", "int4", "int8-dynamic"])
def test_decode_on_native_kernels_matches_the_torch_path(engine, mode):
    """Same prompt, greedy decode: the first step's logits agree to storage rounding, all tokens are identical.

    Each step stores K/V computed from hidden states that differ by float rounding (about 1e-5), so a
    stored element (or, in int8-dynamic, a token's fp16 scale) can land one step apart: 4e-4 in the
    first step's logits with fp16 KV on the default model, and more as such tokens pile up (up to about
    0.2 after 12 steps in int8-dynamic, whichever of the two kernels is swapped for torch).
    """
    model = engine.model
    tokenizer = engine.tokenizer
    messages = [{"role": "user", "content": "Name three things a car dashboard shows."}]
    prompt = tokenizer.encode_prompt(tokenizer.render(messages))
    runs = []
    for native in (True, False):
        model.native_kernels = native
        cache = engine.new_cache(KvCacheConfig(mode, 8 << 20))
        seq = Sequence()
        cache.allocate(seq, prompt)
        logits = model.forward(prompt, 0, cache, seq)
        tokens, steps = [], []
        for pos in range(len(prompt), len(prompt) + 12):
            tokens.append(int(logits.argmax()))
            cache.append(seq, tokens[-1:])
            logits = model.forward(tokens[-1:], pos, cache, seq)
            steps.append(logits)
        runs.append((tokens, torch.stack(steps)))
    model.native_kernels = True
    assert runs[0][0] == runs[1][0]
    assert torch.max(torch.abs(runs[0][1][0] - runs[1][1][0])) < 2e-3


def test_no_compiler_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CABIN_KERNEL_DIR", str(tmp_path / "kernels"))
    native_kernels.matvec.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no-such-cc.*torch path"):
            assert native_kernels.matvec() is None
    finally:
        native_kernels.matvec.cache_clear()


def test_build_is_cached_and_keyed_by_its_defines(monkeypatch, tmp_path):
    monkeypatch.setenv("CABIN_KERNEL_DIR", str(tmp_path))
    defines = {"ELEMENT": "int8_t", "HEAD_SIZE": 8, "GROUP": 1}
    first = native_kernels._build("decode_attention", defines)
    built_at = first.stat().st_mtime_ns
    assert native_kernels._build("decode_attention", defines) == first
    assert first.stat().st_mtime_ns == built_at
    assert native_kernels._build("decode_attention", {**defines, "GROUP": 2}) != first
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".so", ".so"]  # no temp files left behind


def test_loading_the_kernels_keeps_subnormal_floats():
    native_kernels.matvec()
    native_kernels.decode_attention(torch.int8, 64, 3)
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


def test_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("CABIN_NATIVE_KERNELS", "0")
    assert not native_kernels.native_kernels_enabled()
    monkeypatch.delenv("CABIN_NATIVE_KERNELS")
    assert native_kernels.native_kernels_enabled()


def test_an_fp16_lm_head_is_read_as_fp16_with_the_same_logits(tiny_engine_dir):
    """A checkpoint's fp16 lm_head stays fp16 for the kernels and decodes as its fp32 copy does."""
    config, weights = load_checkpoint(EngineFolder(tiny_engine_dir).checkpoint)
    half = weights["lm_head.weight"].half()
    as_half = Transformer(config, {**weights, "lm_head.weight": half})
    as_float = Transformer(config, {**weights, "lm_head.weight": half.float()})
    assert as_half.lm_head.dtype == torch.float16 and as_float.lm_head.dtype == torch.float32
    prompt, steps = [1, 5, 9, 2, 7, 3], []
    for model in (as_half, as_float):
        cache = PagedKVCache(model.kv_layout, KvCacheConfig("fp32", 1 << 20, 16))
        seq = Sequence()
        cache.allocate(seq, prompt + [4])
        model.forward(prompt, 0, cache, seq)
        steps.append(model.forward([4], len(prompt), cache, seq))  # a one-token step: on the kernels
    assert torch.equal(steps[0], steps[1])


@pytest.mark.parametrize("mode", ["fp32", "fp16", "int8", "int8-separate"])
@pytest.mark.parametrize("weights", ["fp32", "fp16 + qkv bias", "int4-g32 + int8 head", "int4-g32-a8 + int8 head"])
def test_fused_decode_step_equals_the_step_layer_by_layer(tiny_engine_dir, tiny_engine, mode, weights):
    """decode_step.c stores what the per-layer step stores (fp32 and fp16 to rounding, int8 codes within one step
    of each other) and gives its logits, for each element type, weight format (int8 activations included) and a
    qkv bias."""
    config, tensors = load_checkpoint(EngineFolder(tiny_engine_dir).checkpoint)
    if weights.startswith("int4-g32"):  # rounded to Q4_1 / Q8_0 blocks (no GGUF source)
        config, tensors, _ = to_int4_g32(config, tensors, None, weight_format(weights.split()[0]))
        config, tensors, _ = to_int8_head(config, tensors, None)
    elif weights != "fp32":
        gen = torch.Generator().manual_seed(3)
        tensors = {name: t.half() if name.endswith("weight") and "norm" not in name else t
                   for name, t in tensors.items()}
        tensors.update({f"transformer.layers.{i}.attention.qkv.bias": torch.randn(256, generator=gen) / 10
                        for i in range(config.num_hidden_layers)})
        config = dataclasses.replace(config, qkv_bias=True)
    model = Transformer(config, tensors)
    prompt, steps = [1, 5, 9, 2, 7, 3, 8, 4], 6
    runs = []
    for fused in (True, False):
        cache = tiny_engine.new_cache(KvCacheConfig(mode, 1 << 20, tokens_per_block=4))
        if not fused:
            cache.storage.static_pools = lambda: None  # the per-layer step (same kernels for its linear ops)
        seq = Sequence()
        cache.allocate(seq, prompt)
        logits, out = model.forward(prompt, 0, cache, seq), []
        for position in range(len(prompt), len(prompt) + steps):
            token = int(logits.argmax())
            cache.append(seq, [token])
            logits = model.forward([token], position, cache, seq)
            out.append(logits)
        slots = cache.slots(seq, len(prompt), len(prompt) + steps)
        stored = [pool.flatten(1, 2)[:, slots].float() for pool in (cache.storage.k_data, cache.storage.v_data)]
        runs.append((torch.stack(out), stored))
    (fused_logits, fused_kv), (layered_logits, layered_kv) = runs
    assert model._step_weights is not None
    # on int8 activations an input a rounding apart between the two paths can land on the next int8 code: ~1%
    assert torch.allclose(fused_logits, layered_logits, atol=(2e-2 if "a8" in weights else 2e-3)
                          * layered_logits.abs().max())
    for got, want in zip(fused_kv, layered_kv):
        if mode.startswith("int8"):
            assert (got - want).abs().max() <= 1 and (got == want).float().mean() > 0.99
        else:
            assert torch.allclose(got, want, rtol=2e-3, atol=5e-4 * want.abs().max())


@pytest.mark.parametrize("mode", ["fp32", "int8"])
@pytest.mark.parametrize("weights", ["fp32", "int4-g32 + int8 head", "int4-g32-a8 + int8 head"])
def test_a_fused_step_of_several_sequences_gives_each_what_it_gives_alone(tiny_engine_dir, tiny_engine, mode,
                                                                          weights):
    """Three sequences of other lengths decode in one fused step (the weights read once for the three tokens): the
    logits and the K/V stored are those of three one-sequence steps, exactly."""
    config, tensors = load_checkpoint(EngineFolder(tiny_engine_dir).checkpoint)
    if weights != "fp32":
        config, tensors, _ = to_int4_g32(config, tensors, None, weight_format(weights.split()[0]))
        config, tensors, _ = to_int8_head(config, tensors, None)
    model = Transformer(config, tensors)
    prompts = [[1, 5, 9, 2, 7], [3, 8, 4, 6, 2, 9, 1, 5, 7, 3, 2], [6, 4]]
    runs = []
    for together in (True, False):
        cache = tiny_engine.new_cache(KvCacheConfig(mode, 1 << 20, tokens_per_block=4), 3)
        seqs = [Sequence() for _ in prompts]
        spans = []
        for seq, prompt in zip(seqs, prompts):
            cache.allocate(seq, prompt)
            token = int(model.forward(prompt, 0, cache, seq).argmax())
            cache.append(seq, [token])
            spans.append(Span([token], len(prompt), seq))
        logits = model.step(spans, cache) if together else torch.cat([model.step([span], cache) for span in spans])
        stored = [pool.flatten(1, 2)[:, torch.cat([cache.slots(s, 0, len(s)) for s in seqs])].clone()
                  for pool in (cache.storage.k_data, cache.storage.v_data)]
        runs.append((logits, stored))
    (logits, stored), (alone, stored_alone) = runs
    assert model._step_weights is not None and logits.shape == (3, config.vocab_size)
    assert torch.equal(logits, alone) and all(torch.equal(a, b) for a, b in zip(stored, stored_alone))


def test_fused_decode_step_rejects_another_models_pools(tiny_engine):
    kernel = native_kernels.decode_step(torch.int8, 16, 2)
    pools = native_kernels.StaticPools(torch.zeros(3, 2, 4, 2, 32, dtype=torch.int8),
                                       torch.zeros(3, 2, 4, 2, 32, dtype=torch.int8), torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="head size 16"):
        kernel(tiny_engine.model._step_weights, torch.zeros(1, 128), 1e-5, torch.zeros(1, 32), torch.zeros(1, 32),
               pools, [torch.arange(2)], [0], [1])
