"""Paged attention over the block pool equals dense attention on the same stored values."""
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.kv.modes import bytes_per_token
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.transformer import grouped_attention

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=16)
HEADS = 6


def dense_attention(q, keys, values, start_pos):
    """Textbook attention with repeated KV heads and an explicit causal loop."""
    n, heads, d = q.shape
    group = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        visible = start_pos + i + 1
        scores = torch.einsum("hd,thd->ht", q[i].double(), keys[:visible].double()) / math.sqrt(d)
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), values[:visible].double())
    return out.reshape(n, heads * d).float()


@settings(max_examples=40, deadline=None)
@given(block_size=st.integers(1, 17), context=st.integers(1, 150), new=st.integers(1, 20), seed=st.integers(0, 99))
def test_paged_fp16_attention_matches_dense(block_size, context, new, seed):
    new = min(new, context)
    start = context - new
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(context, 2, 16, generator=gen) * 3
    values = torch.randn(context, 2, 16, generator=gen)
    q = torch.randn(new, HEADS, 16, generator=gen)
    blocks = math.ceil(context / block_size) + 3 * math.ceil(8 / block_size)
    budget = bytes_per_token(LAYOUT, "fp16", block_size) * block_size * blocks
    cache = PagedKVCache(LAYOUT, KvCacheConfig("fp16", budget, block_size))
    # A few other sequences first, so this one's blocks are scattered in the pool.
    others = [Sequence() for _ in range(3)]
    for index, other in enumerate(others):
        cache.allocate(other, [1000 + index] * (seed % 7 + 1))
    cache.free(others[1])
    seq = Sequence()
    cache.allocate(seq, [0])
    if context > 1:
        cache.append(seq, list(range(1, context)))
    slots = cache.slots(seq, 0, context)
    cache.storage.write(1, slots, keys, values)
    got_k, got_v = cache.read(1, seq)
    got = grouped_attention(q, got_k, got_v, start)
    want = dense_attention(q, keys.half().float(), values.half().float(), start)
    assert torch.max(torch.abs(got - want)) <= 1e-5
