"""Which tokens run in the next step, and what their logits become: admission, chunked prefill, forks, beams, KV
reservation, sampling and finishing, for every request the engine core holds.

A bounded FIFO ``waiting`` queue of requests and a ``running`` list of at most ``max_sessions`` sequences.
``schedule`` admits waiting requests in arrival order while a session slot is free and the pool can hold the prompt
plus its whole reply next to what every running sequence may still grow to (``fork_blocks`` is the one formula for
forks and beams), so a running sequence never runs out of blocks; a request that cannot be admitted blocks those
behind it (fair), and one that cannot fit with nothing else running ends with finish_reason "capacity". It then
plans one decode token of every running sequence past its prompt plus, within ``prefill_chunk`` tokens, the next
prompt chunks of sequences still prefilling, oldest first: one pass over the weights. A new sequence starts from
the longest prefix of full blocks the cache already holds (block hashes, cabinllm.runtime.kv.blocks); a request
that continues a sequence (a dialogue's history) appends to it.

``postprocess`` samples each sequence's next token under its grammar (``ReplyStream`` applies the stop rules),
records log-probabilities, forks the followers of a request (choices 1..n-1) from its prompt once it is in (blocks
shared, copy-on-write), steps beam searches (cabinllm.runtime.generation.beam) and finishes requests: it is the only
place a request ends once admitted. A continued sequence stays its caller's, holding the reply but its last token
(a beam search's best beam is fed back into it as a prompt chunk).
"""
from __future__ import annotations

import threading
import time
from collections import ChainMap, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from prometheus_client import Histogram

from cabinllm.runtime.errors import ConfigError, Fix, GrammarError, Hint, OutOfBlocks, QueueFull
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.generation.beam import BeamSearch
from cabinllm.runtime.generation.sampling import make_generator, sample, token_logprob
from cabinllm.runtime.generation.stops import ReplyStream
from cabinllm.runtime.kv.blocks import MediaSpan, Sequence, cdiv, fork_blocks
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.model.interface import MediaTable, Span

TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TOKEN_GAP_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the scheduler."""

    max_sessions: int = 4  # sequences decoding together
    max_queue: int = 16  # requests waiting for a session slot or KV blocks
    prefill_chunk: int = 256  # prompt tokens computed per step, over all prefilling sequences
    queue_timeout_s: float = 60.0  # a request waiting longer is dropped with finish_reason "expired"

    def __post_init__(self) -> None:
        if min(self.max_sessions, self.max_queue, self.prefill_chunk) < 1 or not self.queue_timeout_s > 0:
            raise ConfigError(f"max_sessions, max_queue and prefill_chunk must be >= 1 and queue_timeout_s > 0, got "
                              f"{self.max_sessions}, {self.max_queue}, {self.prefill_chunk} and {self.queue_timeout_s}")


@dataclass
class SchedulerStats:
    """Counters since start and gauges now."""

    waiting: int
    running: int
    requests_done: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    steps: int
    busy_s: float
    kv_bytes_used_peak: int


@dataclass(eq=False)
class _Running:
    """A sequence the scheduler steps: a request's (or a follower's), and where its tokens stand."""

    request: Request
    seq: Sequence
    reply: ReplyStream
    generator: torch.Generator
    feed: list[int]  # tokens to compute into ``seq`` from position ``base``: the prompt (or a best beam's reply)
    base: int  # the sequence's length when it was admitted
    media: list[MediaSpan]  # the feed's pictures, at their positions in the sequence
    leader: "_Running | None" = None  # a follower's leader, until it forks from it
    search: BeamSearch | None = None  # a beam request's search, once its prompt is in
    replaying: bool = False  # feeding a finished beam search's best reply into a continued sequence

    @property
    def prefilling(self) -> bool:
        return self.leader is None and self.search is None and len(self.seq) < self.base + len(self.feed)

    @property
    def decoding(self) -> bool:
        return self.leader is None and self.search is None and not self.prefilling and not self.replaying

    @property
    def sessions(self) -> int:
        """Session slots it holds: one per beam."""
        return self.request.beam.beam_width if self.request.beam else 1

    @property
    def kept(self) -> bool:
        """Whether its sequence stays the caller's at the end."""
        return self.seq is self.request.seq


@dataclass
class ScheduledBatch:
    """One step's work: a span per sequence, whose running it is, whether its logits are sampled, pictures' rows."""

    spans: list[Span] = field(default_factory=list)
    runs: list[_Running] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    media: MediaTable | None = None

    def add(self, span: Span, running: _Running, sampled: bool) -> None:
        """Run ``span`` for ``running``; ``sampled``: its logits go to postprocess."""
        self.spans.append(span)
        self.runs.append(running)
        self.sampled.append(sampled)


class Scheduler:
    """The requests of one engine core and the one paged cache they share; see the module docstring."""

    def __init__(self, cache: PagedKVCache, decode: Callable[[list[int]], str], context: int,
                 config: SchedulerConfig | None = None) -> None:
        """``decode`` turns reply tokens into text; ``context``: the model's positions."""
        self.cache, self.decode, self.context = cache, decode, context
        self.config = config or SchedulerConfig()
        self.lock = threading.Lock()  # guards ``waiting`` and ``stats`` (requests arrive from other threads)
        self.waiting: deque[Request] = deque()
        self.running: list[_Running] = []
        self.stats = SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0.0, 0)
        self.cache_stats = cache.stats()  # as the last step (or finish) left the cache, for other threads
        # timing histograms (in no registry; the server's metrics collect them)
        self.ttft = Histogram("cabin_time_to_first_token_seconds", "seconds from a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS_S, registry=None)
        self.token_gap = Histogram("cabin_inter_token_latency_seconds", "seconds between a request's tokens after "
                                   "the first", buckets=TOKEN_GAP_BUCKETS_S, registry=None)

    # -- admission -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; QueueFull when ``max_queue`` are waiting already, GrammarError (its hint: the tokens
        needed) when the shortest reply its grammar allows is longer than its ``max_new_tokens``."""
        if request.grammar and not request.beam:
            request.grammar.check_room(request.params.max_new_tokens)
        with self.lock:
            if len(self.waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already",
                                (Hint(Fix.RAISE_MAX_QUEUE, str(self.config.max_queue)),))
            self.waiting.append(request)

    def never_fits(self, request: Request) -> str | None:
        """Why a request (its followers or beams included) could not be admitted even with nothing else running
        (None: it can)."""
        sessions, what = request.sessions, "beams" if request.beam else "choices"
        if sessions > self.config.max_sessions:
            return f"{sessions} {what} need {sessions} sessions and the server decodes {self.config.max_sessions}"
        held = len(request.seq) if request.seq else 0
        if held + len(request.prompt_ids) > self.context:
            return f"{held + len(request.prompt_ids)} tokens exceed the model's context of {self.context}"
        tpb = self.cache.tokens_per_block
        needed = cdiv(held + len(request.prompt_ids) + _own_reply(request), tpb) + _extra_blocks(request, tpb)
        total = self.cache.blocks.num_blocks
        if needed > total:
            return (f"the prompt and {sessions} {what} of up to {request.params.max_new_tokens} tokens need "
                    f"{needed} KV blocks of {tpb} tokens and the whole pool holds {total}")
        return None

    def drop_cancelled(self) -> None:
        """Finish cancelled requests and those that waited past ``queue_timeout_s``."""
        deadline = time.perf_counter() - self.config.queue_timeout_s
        with self.lock:
            dropped = [r for r in self.waiting if r.cancelled or r.queued_at < deadline]
            for request in dropped:
                self.waiting.remove(request)
        for request in dropped:
            self.finish_unstarted(request, request.cancelled or "expired")
        for running in [r for r in self.running if r.request.cancelled]:
            if running in self.running:  # a leader's cancel ends its followers that have not forked yet
                self.finish(running, running.request.cancelled)

    def admit(self) -> None:
        """Start waiting requests, oldest first, while their sessions and blocks fit."""
        while True:
            with self.lock:
                if not self.waiting:
                    return
                request = self.waiting[0]
            if sum(r.sessions for r in self.running) + request.sessions > self.config.max_sessions:
                return
            needed, cached = self._blocks_to_admit(request)
            free = self.cache.available_blocks() - sum(self._reserved(r) for r in self.running)
            problem = self.never_fits(request) if self.running else self._cannot_fit(request, needed, free)
            if needed > free or problem:
                if self.running:
                    return  # waits for running sequences to finish; those behind it wait too (FIFO)
                with self.lock:
                    self.waiting.popleft()
                request.error = problem
                self.finish_unstarted(request, "capacity")
                continue
            with self.lock:
                self.waiting.popleft()
                self.stats.prompt_tokens += len(request.prompt_ids)
                self.stats.cached_tokens += cached
            leader = self._start(request, cached)
            for follower in request.followers:
                self._start(follower, cached, leader)

    def _cannot_fit(self, request: Request, needed: int, free: int) -> str | None:
        """Why a request cannot be admitted into the cache as it is now (None: it can)."""
        if needed <= free or request.sessions > self.config.max_sessions:
            return self.never_fits(request)
        w, m, p = request.sessions, request.params.max_new_tokens, len(request.prompt_ids)
        if request.beam:
            return (f"a beam search of {w} beams and {m} tokens over a {p}-token prompt may need {needed} KV blocks "
                    f"and {free} are free; lower beam_width or max_new_tokens, or raise the KV budget")
        if request.followers:
            return (f"{w} replies of {m} tokens over a {p}-token prompt need {needed} KV blocks and {free} are free; "
                    "ask for fewer replies or raise the KV budget")
        return f"{p} prompt tokens and a reply of up to {m} need {needed} KV blocks and {free} are free"

    def _blocks_to_admit(self, request: Request) -> tuple[int, int]:
        """Blocks a request may take in all (followers and beams included) and the prompt tokens it reuses."""
        own, prompt = _own_reply(request), request.prompt_ids
        if request.seq:
            needed, cached = self.cache.blocks_needed(request.seq, len(prompt) + own), 0
        else:
            needed, cached = self.cache.blocks_to_admit(prompt, own, request.media_spans)
        return needed + _extra_blocks(request, self.cache.tokens_per_block), cached

    def _reserved(self, running: _Running) -> int:
        """Blocks a running sequence may still take."""
        request, tpb = running.request, self.cache.tokens_per_block
        if running.leader is not None:
            return fork_blocks(1, request.params.max_new_tokens - 1, tpb)
        if running.search is not None:
            generated = running.search.cur_len - running.search.prompt_len
            return fork_blocks(request.beam.beam_width, request.params.max_new_tokens - generated, tpb)
        own = running.base + len(running.feed) + (0 if running.replaying else _own_reply(request)) - len(running.seq)
        beams = _extra_blocks(request, tpb) if request.beam and not running.replaying else 0
        return self.cache.blocks_needed(running.seq, max(own, 0)) + beams

    def _start(self, request: Request, cached: int, leader: _Running | None = None) -> _Running:
        request.cached_tokens = cached
        seq = request.seq if request.seq is not None and leader is None else Sequence()
        base = len(seq)
        reply = ReplyStream(request.params, self.decode, grammar=request.grammar)
        running = _Running(request, seq, reply, make_generator(request.params.seed), request.prompt_ids, base,
                           [span.shifted(base) for span in request.media_spans], leader)
        self.running.append(running)
        return running

    # -- the step's work -------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """One decode token per decoding sequence and each beam, then prompt chunks within the prefill budget."""
        batch = ScheduledBatch()
        for running in list(self.running):
            if running.search is not None:
                for span in running.search.spans():
                    batch.add(span, running, True)
            elif running.decoding:
                self._plan_decode(running, batch)
        budget = self.config.prefill_chunk
        for running in list(self.running):
            if budget == 0:
                break
            if running.prefilling and running in self.running:
                budget -= self._plan_prefill(running, budget, batch)
        rows = [r.request.media.rows for r in self.running if r.request.media]  # encoded where a span reads them
        batch.media = ChainMap(*rows) if rows else None
        return batch

    def _plan_decode(self, running: _Running, batch: ScheduledBatch) -> None:
        """The sequence's last token as a span, or its end where the context or the pool has no room for it."""
        token, position = running.reply.ids[-1], len(running.seq)
        try:
            if position >= self.context:
                raise OutOfBlocks(f"position {position} is past the model's context of {self.context}")
            self.cache.append(running.seq, [token])
        except OutOfBlocks as err:  # a pool shared with sequences this core does not reserve for
            running.request.error = str(err)
            self.finish(running, "capacity")
            return
        batch.add(Span([token], position, running.seq), running, True)

    def _plan_prefill(self, running: _Running, budget: int, batch: ScheduledBatch) -> int:
        """The next chunk of a sequence's feed within ``budget`` tokens; returns the tokens it takes."""
        seq, feed, base = running.seq, running.feed, running.base
        first = len(seq) - base
        try:
            if not seq:
                end = min(len(feed), running.request.cached_tokens + budget)
                first = self.cache.allocate(seq, feed[:end], [m for m in running.media if m.start < end])
            else:
                end = min(len(feed), first + budget)
                self.cache.append(seq, feed[first:end], [m for m in running.media
                                                         if base + first <= m.start < base + end])
        except OutOfBlocks as err:  # a pool shared with sequences this core does not reserve for
            running.request.error = str(err)
            self.finish(running, "capacity")
            return 0
        batch.add(Span(feed[first:end], base + first, seq), running, end == len(feed))
        return end - first

    def postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Sample, fork, step beams and finish from a step's logits (one row per span)."""
        beams: dict[_Running, list[torch.Tensor]] = {}
        for running, sampled, row in zip(batch.runs, batch.sampled, logits):
            if not sampled or running not in self.running:
                continue
            if running.replaying:
                self.finish(running, "length")
            elif running.request.beam:
                beams.setdefault(running, []).append(row)
            else:
                for follower in self._unforked(running):
                    self.cache.fork(running.seq, follower.seq)  # the prompt is in: the follower shares it
                    follower.leader = None
                    self._sample(follower, row)
                self._sample(running, row)
        for running, rows in beams.items():
            self._advance_beams(running, torch.stack(rows))

    def unwind(self, batch: ScheduledBatch, error: BaseException) -> None:
        """After a failed model step: every sequence of the batch loses the K/V the step should have written (no
        prefix reuses it) and its request ends with finish_reason "error"."""
        for span, running in zip(batch.spans, batch.runs):
            if span.seq:
                self.cache.discard(span.seq, span.start_pos)
            if running in self.running:
                running.request.error = f"{type(error).__name__}: {error}"
                self.finish(running, "error")

    def _unforked(self, leader: _Running) -> list[_Running]:
        """A leader's followers that wait for its prompt."""
        return [r for r in self.running if r.leader is leader] if leader.request.followers else []

    def _advance_beams(self, running: _Running, logits: torch.Tensor) -> None:
        """Start a beam search on its prompt's logits, or advance it; a search that ended gives its best beam as
        the reply (fed back into a continued sequence before the request ends)."""
        request = running.request
        if running.search is None:
            running.search = BeamSearch(self.cache, len(running.seq), request.beam)
            start = running.seq
            if running.kept:  # the caller's sequence keeps the prompt; the beams fork from it
                start = Sequence()
                self.cache.fork(running.seq, start)
            running.search.start(start, logits[0])
        else:
            running.search.advance(logits)
        with self.lock:
            self.stats.generated_tokens += len(logits)
        if not running.search.done:
            return
        result = running.search.close()
        running.search = None
        request.beams = result.token_ids
        request.first_token_at = request.first_token_at or time.perf_counter()
        for token in result.token_ids[0] if result.token_ids else []:
            request.token_ids.append(token)
            running.reply.push(token)
            if running.reply.finish_reason:
                break
        if running.kept and len(running.reply.ids) > 1:  # the reply's K/V, its last token pending as after sampling
            running.feed, running.base, running.media = running.reply.ids[:-1], len(running.seq), []
            running.replaying = True
        else:
            self.finish(running, "length")

    def _sample(self, running: _Running, logits: torch.Tensor) -> None:
        request = running.request
        try:
            token, logits = running.reply.sample(logits, lambda row: sample(row, request.params, running.generator))
        except GrammarError as err:  # the grammar's own failure ends its request only
            request.error = str(err)
            self.finish(running, "error")
            return
        if request.logprobs is not None:
            request.token_logprobs.append(token_logprob(logits, request.params, token, request.logprobs))
        now = time.perf_counter()
        if request.first_token_at is None:
            request.first_token_at = now
            self.ttft.observe(now - request.queued_at)
        else:
            self.token_gap.observe(now - request.last_token_at)
        request.last_token_at = now
        request.token_ids.append(token)
        with self.lock:
            self.stats.generated_tokens += 1
        piece = running.reply.push(token)
        if running.reply.finish_reason:
            self.finish(running)
        elif piece:
            request.text += piece
            request.on_output(request, piece, False)

    # -- endings ---------------------------------------------------------------------------
    def finish(self, running: _Running, reason: str | None = None) -> None:
        """Free the sequence (not a continued one: it stays its caller's), hand over the rest of the text (cut at a
        stop string) and the finish reason: the reply's stop rule, else ``reason``."""
        self.running.remove(running)
        for follower in self._unforked(running):  # never forked: nothing to share
            follower.request.error = running.request.error
            self.finish(follower, reason or "cancelled")
        if running.search is not None:
            running.search.close()  # every beam's sequence, the prompt's among them unless it is kept
        if running.seq and not running.kept:
            self.cache.free(running.seq)
        request, reply = running.request, running.reply
        rest = reply.close(reason)
        request.text, request.finish_reason = reply.text, reply.finish_reason
        request.finished_at = time.perf_counter()
        stats = self.cache.stats()
        with self.lock:
            self.stats.requests_done += 1
            self.cache_stats = stats  # a client told it is done finds its blocks freed in the metrics
        request.on_output(request, rest if reason != "cancelled" else "", True)

    def finish_unstarted(self, request: Request, reason: str) -> None:
        """End a request that never ran (and its followers)."""
        for one in (request, *request.followers):
            one.finish_reason, one.finished_at = reason, time.perf_counter()
            one.error = one.error or request.error
            one.on_output(one, "", True)


def _own_reply(request: Request) -> int:
    """Reply tokens a request's own sequence may hold (its last token is never fed; a beam search's replies are its
    beams')."""
    return 0 if request.beam else request.params.max_new_tokens - 1


def _extra_blocks(request: Request, tokens_per_block: int) -> int:
    """Blocks a request's followers or beams may add beside its own sequence."""
    if request.beam:
        return fork_blocks(request.beam.beam_width, request.params.max_new_tokens, tokens_per_block)
    return fork_blocks(len(request.followers), request.params.max_new_tokens - 1, tokens_per_block)
