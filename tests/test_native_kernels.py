"""The native decode kernels compute what the torch path computes, and fall back cleanly without a compiler."""
import math
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

from runtime import native_kernels
from runtime.kv_cache import KVLayout, KVScales, PagedKVCache
from runtime.model import grouped_attention

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the kernels")


@pytest.mark.parametrize("rows, cols, with_bias", [(49, 576, False), (960, 576, True), (3, 7, True), (1, 1, False)])
def test_matvec_equals_linear(rows, cols, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(rows, cols, generator=gen), torch.randn(1, cols, generator=gen)
    bias = torch.randn(rows, generator=gen) if with_bias else None
    got = native_kernels.matvec()(x, weight, bias)
    assert got.shape == (1, rows)
    assert torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5 * math.sqrt(cols))


def test_matvec_rejects_a_wrong_shape():
    with pytest.raises(ValueError, match=r"\(1, 8\)"):
        native_kernels.matvec()(torch.randn(2, 8), torch.randn(4, 8))


@pytest.mark.parametrize("kv_heads, group, head_size, tokens_per_block, context",
                         [(3, 3, 64, 32, 2049), (2, 1, 16, 5, 1), (1, 4, 32, 7, 96), (4, 2, 128, 16, 333)])
def test_int8_decode_attention_equals_torch_path(kv_heads, group, head_size, tokens_per_block, context):
    layout = KVLayout(num_layers=2, num_kv_heads=kv_heads, head_size=head_size)
    scales = KVScales(k=[0.03, 0.05], v=[0.02, 0.04])
    blocks = math.ceil(context / tokens_per_block) + 4
    cache = PagedKVCache(layout, "int8-separate", layout.bytes_per_token("int8") * tokens_per_block * blocks,
                         tokens_per_block, scales)
    # Another sequence first, freed, so this one's blocks are not in pool order.
    cache.allocate(7, list(range(3 * tokens_per_block)))
    cache.allocate(0, list(range(1000, 1000 + context)))
    cache.free(7)
    gen = torch.Generator().manual_seed(context)
    keys = torch.randn(context, kv_heads, head_size, generator=gen) * 2
    values = torch.randn(context, kv_heads, head_size, generator=gen)
    cache.write(1, cache.slots(0, 0, context), keys, values)
    q = torch.randn(kv_heads * group, head_size, generator=gen)
    table = cache.block_table(0)
    k, v, k_scale, v_scale = cache.read_unscaled(1, table, context)
    want = grouped_attention(q[None] * k_scale, k, v, context - 1) * v_scale
    k_codes, v_codes, k_scale, v_scale = cache.int8_codes(1)
    got = native_kernels.int8_decode_attention(head_size, group)(q, k_codes, v_codes, table, context, k_scale, v_scale)
    assert torch.max(torch.abs(got - want)) <= 1e-5


def test_int8_decode_attention_rejects_another_models_pools():
    kernel = native_kernels.int8_decode_attention(16, 2)
    codes = torch.zeros(4, 8, 3, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="head size 16 and group 2"):
        kernel(torch.zeros(6, 32), codes, codes, torch.arange(4), 10, 1.0, 1.0)


def test_decode_on_native_kernels_matches_the_torch_path(default_engine):
    """Same prompt, greedy decode on an int8 cache: logits agree to float rounding, tokens are identical."""
    model = default_engine.model
    tokenizer = default_engine.tokenizer
    prompt = tokenizer.encode_prompt(tokenizer.render([{"role": "user", "content": "Name three things a car dashboard shows."}]))
    runs = []
    for native in (True, False):
        model.native_kernels = native
        cache = default_engine.new_cache("int8", 8 << 20)
        cache.allocate(0, prompt)
        logits = model.forward(prompt, 0, cache, 0)
        tokens, steps = [], []
        for pos in range(len(prompt), len(prompt) + 12):
            tokens.append(int(logits.argmax()))
            cache.append(0, tokens[-1:])
            logits = model.forward(tokens[-1:], pos, cache, 0)
            steps.append(logits)
        runs.append((tokens, torch.stack(steps)))
    model.native_kernels = True
    assert runs[0][0] == runs[1][0]
    assert torch.max(torch.abs(runs[0][1] - runs[1][1])) < 1e-3


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
    first = native_kernels._build("int8_decode_attention", {"HEAD_SIZE": 8, "GROUP": 1})
    built_at = first.stat().st_mtime_ns
    assert native_kernels._build("int8_decode_attention", {"HEAD_SIZE": 8, "GROUP": 1}) == first
    assert first.stat().st_mtime_ns == built_at
    assert native_kernels._build("int8_decode_attention", {"HEAD_SIZE": 8, "GROUP": 2}) != first
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".so", ".so"]  # no temp files left behind


def test_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("CABIN_NATIVE_KERNELS", "0")
    assert not native_kernels.native_kernels_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.delenv("CABIN_NATIVE_KERNELS")
        assert native_kernels.native_kernels_enabled()
