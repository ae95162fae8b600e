"""Several sequences run in one model step give what each gives alone: batched decode, and a prefill
chunk of one sequence in the same step as the decode of others."""
import pytest
import torch
from core_helpers import prefill

from cabinllm.runtime.errors import OutOfBlocks
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.interface import Span

VOCAB = 20  # the tiny model's vocabulary is small
PROMPTS = [[5, 17, 3, 2, 9], [i % VOCAB for i in range(40, 87)], [11, 7, 7, 4, 3, 12, 19, 15, 1]]
STEPS = 12


def batched_decode(model, cache, seqs, tokens):
    """One token of each sequence appended and run in one model step, as the server's scheduler decodes."""
    spans = [Span([token], len(seq), seq) for seq, token in zip(seqs, tokens)]
    for seq, token in zip(seqs, tokens):
        cache.append(seq, [token])
    return model.step(spans, cache)


def single_decode(engine, kv_mode, prompt):
    """Greedy tokens and per-step logits of one sequence decoded alone on its own cache."""
    cache = engine.new_cache(KvCacheConfig(kv_mode, 1 << 20))
    seq = Sequence()
    logits, _, _ = prefill(engine.model, cache, seq, prompt)
    tokens, all_logits = [], [logits]
    for _ in range(STEPS):
        tokens.append(int(logits.argmax()))
        position = len(seq)
        cache.append(seq, tokens[-1:])
        logits = engine.model.forward(tokens[-1:], position, cache, seq)
        all_logits.append(logits)
    return tokens, torch.stack(all_logits)


# A single sequence's decode step runs fused in C (runtime/kernels/decode_step.c: its own sums for norms and
# RoPE), a batched step runs the layers' torch ops around the linear kernel: one-row and many-row paths round
# differently in fp32 (logits of about 10 differ by up to 2e-4), and fp16 storage may then round a stored K/V
# element to the neighbouring fp16 value (a relative step of 1e-3), hence its wider tolerance.
@pytest.mark.parametrize("kv_mode, tolerance", [("fp32", 1e-3), ("int8", 1e-3), ("fp16", 1e-2)])
def test_batched_decode_equals_single_sequence_decodes(tiny_engine, kv_mode, tolerance):
    want = [single_decode(tiny_engine, kv_mode, prompt) for prompt in PROMPTS]
    cache = tiny_engine.new_cache(KvCacheConfig(kv_mode, 1 << 20))
    seqs = [Sequence() for _ in PROMPTS]
    logits = torch.stack([prefill(tiny_engine.model, cache, seq, prompt)[0] for seq, prompt in zip(seqs, PROMPTS)])
    tokens, all_logits = [[] for _ in PROMPTS], [logits]
    for _ in range(STEPS):
        step = [int(row.argmax()) for row in logits]
        for out, token in zip(tokens, step):
            out.append(token)
        logits = batched_decode(tiny_engine.model, cache, seqs, step)
        all_logits.append(logits)
    got = torch.stack(all_logits, dim=1)
    for index, (want_tokens, want_logits) in enumerate(want):
        assert tokens[index] == want_tokens
        torch.testing.assert_close(got[index], want_logits, rtol=0, atol=tolerance)
    cache.blocks.check_invariants()


def test_prefill_chunk_steps_with_decodes(tiny_engine):
    """A step mixing one sequence's prompt chunk with another's decode token matches running them apart."""
    model = tiny_engine.model
    cache = tiny_engine.new_cache(KvCacheConfig("int8", 1 << 20))
    first, second = Sequence(), Sequence()
    prefill(model, cache, first, PROMPTS[0])
    cache.append(first, [6])
    cache.allocate(second, PROMPTS[1])
    mixed = model.step([Span([6], len(PROMPTS[0]), first), Span(PROMPTS[1], 0, second)], cache)
    alone_cache = tiny_engine.new_cache(KvCacheConfig("int8", 1 << 20))
    alone_first, alone_second = Sequence(), Sequence()
    prefill(model, alone_cache, alone_first, PROMPTS[0])
    alone_cache.append(alone_first, [6])
    want_first = model.forward([6], len(PROMPTS[0]), alone_cache, alone_first)
    want_second = prefill(model, alone_cache, alone_second, PROMPTS[1])[0]
    torch.testing.assert_close(mixed, torch.stack([want_first, want_second]), rtol=1e-4, atol=1e-4)


def test_batched_decode_out_of_blocks_extends_nothing(tiny_engine):
    cache = tiny_engine.new_cache(KvCacheConfig("int8", cache_bytes(tiny_engine, 2)))
    tpb = cache.tokens_per_block
    seqs = [Sequence(), Sequence()]
    for seq in seqs:
        cache.allocate(seq, list(range(1, tpb + 1)))  # one full block each: the next token needs a new block
    with pytest.raises(OutOfBlocks, match="KV blocks"):
        batched_decode(tiny_engine.model, cache, seqs, [3, 4])
    assert [len(seq) for seq in seqs] == [tpb, tpb]
    cache.blocks.check_invariants()


def cache_bytes(engine, blocks):
    config = engine.kv_cache_config(KvCacheConfig("int8", 1 << 20))
    return config.bytes_per_token(engine.model.kv_layout) * config.tokens_per_block * blocks
