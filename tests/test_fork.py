"""Forked sequences on the tiny engine, in every reference KV mode: a fork shares its parent's blocks (no block
taken), the first write into the shared partial last block copies it, and parent and child then read back and
compute exactly what two sequences that never shared anything do; freeing one leaves the other whole."""
import pytest
import torch

from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.kv.modes import REFERENCE_KV_MODES

PROMPT = [5, 9, 2, 7, 7, 3, 1, 8, 4, 6]  # 10 tokens: two full blocks of 4 and a partial one
TPB = 4


def grown(engine, cache, seq: Sequence, tokens: list[int]) -> torch.Tensor:
    """Append one token at a time through the model; the last logits."""
    for token in tokens:
        cache.append(seq, [token])
        logits = engine.model.forward([token], len(seq) - 1, cache, seq)
    return logits


def prefilled(engine, cache) -> Sequence:
    seq = Sequence()
    cache.allocate(seq, PROMPT)
    engine.model.forward(PROMPT, 0, cache, seq)
    return seq


def kv(cache, seq: Sequence) -> list[torch.Tensor]:
    return [torch.cat(cache.read(layer, seq)) for layer in range(cache.layout.num_layers)]


@pytest.mark.parametrize("mode", REFERENCE_KV_MODES)
def test_a_fork_shares_then_copies_and_reads_what_separate_sequences_read(tiny_engine, mode):
    cache = tiny_engine.new_cache(KvCacheConfig(mode, 1 << 20, TPB))
    parent = prefilled(tiny_engine, cache)
    in_use = cache.stats().blocks_in_use
    child = Sequence()
    cache.fork(parent, child)
    assert cache.stats().blocks_in_use == in_use and child.block_table == parent.block_table
    shared_tail = parent.block_table[-1]
    parent_logits = grown(tiny_engine, cache, parent, [11, 12, 13])
    child_logits = grown(tiny_engine, cache, child, [14, 15])
    assert child.block_table[:2] == parent.block_table[:2]  # the full blocks stay shared
    assert shared_tail in parent.block_table[2:] + child.block_table[2:]  # one keeps it, the other got a copy
    assert parent.block_table[2] != child.block_table[2]
    assert cache.stats().blocks_in_use == in_use + 1 + 1  # the copy, and the parent's next block

    alone = tiny_engine.new_cache(KvCacheConfig(mode, 1 << 20, TPB))
    expected = {}
    for name, tokens in (("parent", [11, 12, 13]), ("child", [14, 15])):
        seq = prefilled(tiny_engine, alone)
        expected[name] = (grown(tiny_engine, alone, seq, tokens), kv(alone, seq))
    assert torch.equal(parent_logits, expected["parent"][0]) and torch.equal(child_logits, expected["child"][0])
    for got, want in zip(kv(cache, parent) + kv(cache, child), expected["parent"][1] + expected["child"][1]):
        assert torch.equal(got, want)

    cache.free(parent)
    assert [torch.equal(a, b) for a, b in zip(kv(cache, child), expected["child"][1])] == [True] * len(
        expected["child"][1])
    cache.free(child)
    cache.blocks.check_invariants()
    assert cache.stats().blocks_in_use == 0
