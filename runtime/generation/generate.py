"""The token loop: prefill new tokens of a sequence, then decode until a stop condition."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from cabinllm.runtime.errors import CapacityError, OutOfBlocks
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.generation.sampling import SamplingParams, make_generator, sample
from cabinllm.runtime.generation.streaming import TextStream
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import PagedKVCache, sized_config
from cabinllm.runtime.model.transformer import Span, Transformer


@dataclass
class GenerationResult:
    """What one call of ``generate`` produced and what it cost."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length", "capacity" or "interrupted"
    prefill_tokens: int
    reused_tokens: int
    ttft_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        """Decode speed over the tokens after the first."""
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


def prefill(model: Transformer, cache: PagedKVCache, seq: Sequence, new_ids: list[int]) -> tuple[torch.Tensor, int, int]:
    """Feed new tokens to a sequence (allocated if empty).

    Returns the last logits, the tokens reused from the cache (history, or a prefix
    shared with another sequence) and the tokens computed now.

    Raises CapacityError, leaving the cache unchanged, when they do not fit.
    """
    existing = bool(seq)
    start = len(seq)
    limit = model.config.max_position_embeddings
    if start + len(new_ids) > limit:
        raise CapacityError(f"{start + len(new_ids)} tokens exceed the model's context of {limit}")
    try:
        if existing:
            cache.append(seq, new_ids)
            computed_from = 0
        else:
            computed_from = cache.allocate(seq, new_ids)
    except OutOfBlocks as err:
        raise CapacityError(str(err)) from err
    logits = model.forward(new_ids[computed_from:], start + computed_from, cache, seq)
    return logits, start + computed_from, len(new_ids) - computed_from


def generate(model: Transformer, cache: PagedKVCache, seq: Sequence, new_ids: list[int], params: SamplingParams,
             decode_text: Callable[[list[int]], str], on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> GenerationResult:
    """Prefill new_ids into the sequence, then sample up to max_new_tokens.

    The last sampled token is not fed back (a stop token needs no KV); the caller
    feeds it with the next turn. ``should_stop`` lets a UI interrupt a reply.
    """
    t0 = time.perf_counter()
    logits, reused, computed = prefill(model, cache, seq, new_ids)
    generator = make_generator(params.seed)
    stream = TextStream(decode_text)
    stop_ids = set(params.stop_token_ids)
    finish, ttft, t_first = "length", 0.0, 0.0
    while True:
        token = sample(logits, params, generator)
        if not stream.ids:
            t_first = time.perf_counter()
            ttft = t_first - t0
        if token in stop_ids:
            stream.ids.append(token)
            finish = "stop"
            break
        piece = stream.push(token)
        if on_text and piece:
            on_text(piece)
        if params.stops(stream.text):
            finish = "stop"
            break
        if len(stream.ids) >= params.max_new_tokens:
            break
        if should_stop and should_stop():
            finish = "interrupted"
            break
        position = len(seq)
        if position >= model.config.max_position_embeddings or not _try_append(cache, seq, token):
            finish = "capacity"
            break
        logits = model.forward([token], position, cache, seq)
    return GenerationResult(stream.ids, params.cut_at_stop(stream.text), finish, computed, reused, ttft,
                            time.perf_counter() - t_first)


def decode_batch(model: Transformer, cache: PagedKVCache, seqs: list[Sequence], tokens: list[int]) -> torch.Tensor:
    """Append one token to each sequence and run them all in one model step (the weights read once).

    Returns the next-token logits of each sequence, shape (len(seqs), vocab). Raises OutOfBlocks, with
    no sequence extended, when the pool cannot take the new tokens.
    """
    positions = [len(seq) for seq in seqs]
    needed = sum(cache.blocks.blocks_needed(seq, 1) for seq in seqs)
    if needed > cache.blocks.num_free_blocks():
        raise OutOfBlocks(f"need {needed} KV blocks for one more token of {len(seqs)} sequences but only "
                          f"{cache.blocks.num_free_blocks()} are free or evictable")
    for seq, token in zip(seqs, tokens):
        cache.append(seq, [token])
    return model.step([Span([token], position, seq) for seq, token, position in zip(seqs, tokens, positions)], cache)


def _try_append(cache: PagedKVCache, seq: Sequence, token: int) -> bool:
    try:
        cache.append(seq, [token])
    except OutOfBlocks:
        return False
    return True


@dataclass
class Prefilled:
    """A cache holding one sequence's K/V after the model ran over its tokens, and the logits it gave."""

    cache: PagedKVCache
    seq: Sequence
    logits: torch.Tensor

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K (post-RoPE) and V of every token in one layer, shape (tokens, kv_heads, head_size)."""
        return self.cache.read(layer, self.seq)


def run_tokens(model: Transformer, token_ids: list[int], kv_mode: str = "fp32", scales: KVScales | None = None,
               all_logits: bool = False, cache: PagedKVCache | None = None, chunk: int | None = None) -> Prefilled:
    """Run the model over token_ids on a fresh cache sized to them (or on ``cache``, empty) and hand back its K/V.

    They go through the model at once, or in pieces of ``chunk`` tokens. Modes that keep a window of recent
    tokens at higher precision are prefilled block by block at most, so every position sees the window as it
    would while decoding.
    """
    if cache is None:
        cache = PagedKVCache(model.kv_layout, sized_config(model.kv_layout, kv_mode, len(token_ids)), scales)
    seq = Sequence()
    chunk = min(chunk or len(token_ids), cache.tokens_per_block if cache.mode.recent_window else len(token_ids))
    logits = []
    for start in range(0, len(token_ids), chunk):
        piece = token_ids[start:start + chunk]
        if start == 0:
            cache.allocate(seq, piece)
        else:
            cache.append(seq, piece)
        logits.append(model.forward(piece, start, cache, seq, all_logits=all_logits))
    return Prefilled(cache, seq, torch.cat(logits) if all_logits else logits[-1])
