"""The token loop: prefill new tokens of a sequence, then decode until a stop condition."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.block_manager import OutOfBlocks
from runtime.kv_cache import PagedKVCache
from runtime.model import Transformer
from runtime.sampling import SamplingParams, make_generator, sample
from runtime.streaming import TextStream


class CapacityError(RuntimeError):
    """The tokens to prefill do not fit the KV budget or the model's context."""


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


def prefill(model: Transformer, cache: PagedKVCache, seq_id: int, new_ids: list[int]) -> tuple[torch.Tensor, int, int]:
    """Feed new tokens to a sequence (created if needed).

    Returns the last logits, the tokens reused from the cache (history, or a prefix
    shared with another sequence) and the tokens computed now.

    Raises CapacityError, leaving the cache unchanged, when they do not fit.
    """
    existing = cache.blocks.has_sequence(seq_id)
    start = cache.blocks.num_tokens(seq_id) if existing else 0
    limit = model.config.max_position_embeddings
    if start + len(new_ids) > limit:
        raise CapacityError(f"{start + len(new_ids)} tokens exceed the model's context of {limit}")
    try:
        if existing:
            cache.append(seq_id, new_ids)
            computed_from = 0
        else:
            computed_from = cache.allocate(seq_id, new_ids)
    except OutOfBlocks as err:
        raise CapacityError(str(err)) from err
    logits = model.forward(new_ids[computed_from:], start + computed_from, cache, seq_id)
    return logits, start + computed_from, len(new_ids) - computed_from


def generate(model: Transformer, cache: PagedKVCache, seq_id: int, new_ids: list[int], params: SamplingParams,
             decode_text: Callable[[list[int]], str], on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> GenerationResult:
    """Prefill new_ids into the sequence, then sample up to max_new_tokens.

    The last sampled token is not fed back (a stop token needs no KV); the caller
    feeds it with the next turn. ``should_stop`` lets a UI interrupt a reply.
    """
    t0 = time.perf_counter()
    logits, reused, computed = prefill(model, cache, seq_id, new_ids)
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
        if any(s in stream.text for s in params.stop_strings):
            finish = "stop"
            break
        if len(stream.ids) >= params.max_new_tokens:
            break
        if should_stop and should_stop():
            finish = "interrupted"
            break
        position = cache.blocks.num_tokens(seq_id)
        if position >= model.config.max_position_embeddings or not _try_append(cache, seq_id, token):
            finish = "capacity"
            break
        logits = model.forward([token], position, cache, seq_id)
    text = stream.text
    for s in params.stop_strings:
        text = text.split(s)[0] if s in text else text
    return GenerationResult(stream.ids, text, finish, computed, reused, ttft,
                            time.perf_counter() - t_first)


def _try_append(cache: PagedKVCache, seq_id: int, token: int) -> bool:
    try:
        cache.append(seq_id, [token])
    except OutOfBlocks:
        return False
    return True
