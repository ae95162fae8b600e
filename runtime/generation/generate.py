"""The token loop: prefill new tokens of a sequence, then decode until a stop rule (``stops.ReplyStream``) ends
the reply; and what a backend's model offers the loops (``ModelRunner``, ``ModelRunner``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from cabinllm.runtime.errors import CapacityError, OutOfBlocks
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.generation.grammar import GrammarState
from cabinllm.runtime.generation.sampling import SamplingParams, make_generator, sample
from cabinllm.runtime.generation.stops import ReplyStream
from cabinllm.runtime.kv.blocks import MediaSpan, Sequence
from cabinllm.runtime.kv.cache import PagedKVCache, sized_config
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.interface import MediaTable, ModelRunner, Span


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


@dataclass
class MediaFeed:
    """The pictures among a feed's tokens: where they are (positions from the feed's first token) and their input
    rows by digest (cabinllm.runtime.model.vision)."""

    spans: list[MediaSpan]
    rows: MediaTable


def prefill(model: ModelRunner, cache: PagedKVCache, seq: Sequence, new_ids: list[int],
            media: MediaFeed | None = None) -> tuple[torch.Tensor, int, int]:
    """Feed new tokens (``media``: the pictures among them) to a sequence (allocated if empty).

    Returns the last logits, the tokens reused from the cache (history, or a prefix
    shared with another sequence) and the tokens computed now.

    Raises CapacityError, leaving the cache unchanged, when they do not fit.
    """
    existing = bool(seq)
    start = len(seq)
    limit = model.config.max_position_embeddings
    if start + len(new_ids) > limit:
        raise CapacityError(f"{start + len(new_ids)} tokens exceed the model's context of {limit}")
    spans = [span.shifted(start) for span in media.spans] if media else []
    try:
        if existing:
            cache.append(seq, new_ids, spans)
            computed_from = 0
        else:
            computed_from = cache.allocate(seq, new_ids, spans)
    except OutOfBlocks as err:
        raise CapacityError(str(err)) from err
    try:
        logits = model.forward(new_ids[computed_from:], start + computed_from, cache, seq,
                               media=media.rows if media else None)
    except BaseException:  # e.g. a picture's rows not at hand: the sequence goes, no block keeps unwritten K/V
        cache.discard(seq, start + computed_from)
        raise
    return logits, start + computed_from, len(new_ids) - computed_from


def generate(model: ModelRunner, cache: PagedKVCache, seq: Sequence, new_ids: list[int], params: SamplingParams,
             decode_text: Callable[[list[int]], str], on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None, grammar: GrammarState | None = None,
             media: MediaFeed | None = None) -> GenerationResult:
    """Prefill new_ids (``media``: the pictures among them) into the sequence, then sample until a stop rule ends
    the reply.

    The last sampled token is not fed back (a stop token needs no KV); the caller
    feeds it with the next turn. ``should_stop`` lets a UI interrupt a reply; ``grammar`` constrains it.
    """
    t0 = time.perf_counter()
    logits, reused, computed = prefill(model, cache, seq, new_ids, media)
    generator = make_generator(params.seed)
    reply = ReplyStream(params, decode_text, on_text, grammar)
    ended, ttft, t_first = None, 0.0, 0.0  # ended: a reason of this loop's own
    while True:
        token = sample(reply.constrain(logits), params, generator)
        if not reply.ids:
            t_first = time.perf_counter()
            ttft = t_first - t0
        reply.push(token)
        if reply.finish_reason:
            break
        if should_stop and should_stop():
            ended = "interrupted"
            break
        position = len(seq)
        if position >= model.config.max_position_embeddings or not _try_append(cache, seq, token):
            ended = "capacity"
            break
        logits = model.forward([token], position, cache, seq)
    reply.close(ended)
    return GenerationResult(reply.ids, reply.text, reply.finish_reason, computed, reused, ttft,
                            time.perf_counter() - t_first)


def generate_choices(model: ModelRunner, cache: PagedKVCache, seq: Sequence, new_ids: list[int],
                     params: list[SamplingParams], decode_text: Callable[[list[int]], str],
                     grammars: list[GrammarState | None] | None = None) -> list[GenerationResult]:
    """``len(params)`` replies from one prefill of ``new_ids``: the first in ``seq``, the others in forks of it
    (its blocks shared, copy-on-write), decoded together, one model step for all; the forks are freed at the end.
    As ``generate``, the last sampled token of each reply is not fed."""
    t0 = time.perf_counter()
    logits, reused, computed = prefill(model, cache, seq, new_ids)
    seqs = [seq] + [Sequence() for _ in params[1:]]
    for child in seqs[1:]:
        cache.fork(seq, child)
    replies = [ReplyStream(p, decode_text, grammar=g) for p, g in zip(params, grammars or [None] * len(params))]
    generators = [make_generator(p.seed) for p in params]
    ended: list[str | None] = [None] * len(params)
    live, rows = list(range(len(params))), [logits] * len(params)
    ttft = 0.0
    try:
        while live:
            spans, still = [], []
            for i, row in zip(live, rows):
                replies[i].push(sample(replies[i].constrain(row), params[i], generators[i]))
                ttft = ttft or time.perf_counter() - t0
                if replies[i].finish_reason:
                    continue
                position = len(seqs[i])
                if position >= model.config.max_position_embeddings or not _try_append(cache, seqs[i],
                                                                                        replies[i].ids[-1]):
                    ended[i] = "capacity"
                    continue
                spans.append(Span(replies[i].ids[-1:], position, seqs[i]))
                still.append(i)
            live, rows = still, (model.step(spans, cache) if spans else [])
    finally:
        for child in seqs[1:]:
            if child:
                cache.free(child)
    decode_s = time.perf_counter() - t0 - ttft
    results = []
    for reply, end in zip(replies, ended):
        reply.close(end)
        results.append(GenerationResult(reply.ids, reply.text, reply.finish_reason, computed, reused, ttft, decode_s))
    return results


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


def run_tokens(model: ModelRunner, token_ids: list[int], kv_mode: str = "fp32", scales: KVScales | None = None,
               all_logits: bool = False, cache: PagedKVCache | None = None, chunk: int | None = None,
               media: MediaFeed | None = None) -> Prefilled:
    """Run the model over token_ids (``media``: the pictures among them) on a fresh cache sized to them (or on
    ``cache``, empty) and hand back its K/V.

    A fresh cache keeps every layer's K/V of every token, sliding-window layers' too (their attention still sees
    their window only), so that calibration reads them all. They go through the model at once, or in pieces of
    ``chunk`` tokens. Modes that keep a window of recent tokens at higher precision are prefilled block by block at
    most, so every position sees the window as it would while decoding.
    """
    if cache is None:
        layout = replace(model.kv_layout, windows=())
        cache = PagedKVCache(layout, sized_config(layout, kv_mode, len(token_ids)), scales)
    seq = Sequence()
    chunk = min(chunk or len(token_ids), cache.tokens_per_block if cache.mode.recent_window else len(token_ids))
    logits = []
    for start in range(0, len(token_ids), chunk):
        piece = token_ids[start:start + chunk]
        spans = [span for span in media.spans if start <= span.start < start + chunk] if media else []
        if start == 0:
            cache.allocate(seq, piece, spans)
        else:
            cache.append(seq, piece, spans)
        logits.append(model.forward(piece, start, cache, seq, all_logits=all_logits,
                                    media=media.rows if media else None))
    return Prefilled(cache, seq, torch.cat(logits) if all_logits else logits[-1])
