"""Continuous batching of many conversations on one reference engine and one paged KV cache.

Data structures: a bounded FIFO ``waiting`` queue of requests and a ``running`` list of at most
``max_sessions`` sequences. Each ``step`` (one model call):

1. drops cancelled requests, freeing their blocks (their computed full blocks stay cached);
2. admits waiting requests in arrival order while a session slot is free and the pool can hold the
   prompt plus its whole reply next to what every running sequence may still grow to, so a running
   sequence never runs out of blocks; a request that cannot be admitted blocks those behind it (fair);
3. runs one decode token of every running sequence past its prompt plus, within ``prefill_chunk``
   tokens, the next prompt chunks of sequences still prefilling, oldest first: one pass over the weights.

A new request's prompt starts from the longest prefix of full blocks the cache already holds (block
hashes, cabinllm.runtime.kv.blocks): a conversation re-sent with one more turn prefills only the new tokens.
A request with ``followers`` (choices 1..n-1 of one completion) prefills once: when its prompt is in the cache
each follower's sequence forks from it (sharing every block; copy-on-write) and samples its first token from the
same logits, then decodes as a sequence of its own. The group is admitted whole, one session slot per choice.
A request with ``beam`` runs a beam search (cabinllm.runtime.generation.beam) once its prompt is in: each step
runs one token of each of its beams beside the other requests; it holds one session slot per beam and its
reply (the best beam) comes whole when the search ends.
A block is allocated and hashed in the step that computes its K/V, so a prefix hit always finds K/V.
Admission asks the cache's capacity queries (``PagedKVCache.blocks_to_admit``, ...); each reply's stop rules
and the text it may show so far are every token loop's ``ReplyStream`` (cabinllm.runtime.generation.stops).
Nothing here knows HTTP; results go to each request's ``on_output`` callback, called from the thread
that runs ``step``. The engine's model must offer the batched step (``ModelRunner.batched``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import ChainMap, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from prometheus_client import Histogram

from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import ConfigError, GrammarError, QueueFull
from cabinllm.runtime.generation.beam import BeamParams, BeamSearch
from cabinllm.runtime.generation.generate import MediaFeed
from cabinllm.runtime.generation.grammar import GrammarState
from cabinllm.runtime.generation.sampling import SamplingParams, TokenLogprob, make_generator, sample, token_logprob
from cabinllm.runtime.generation.stops import ReplyStream
from cabinllm.runtime.kv.blocks import MediaSpan, Sequence, cdiv
from cabinllm.runtime.kv.cache import CacheStats, PagedKVCache
from cabinllm.runtime.model.interface import Span

log = logging.getLogger(__name__)
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


@dataclass(eq=False)
class Request:
    """One completion: its prompt tokens, sampling, and what it produced so far.

    ``on_output(request, text, finished)`` receives each new piece of reply text; the last call has
    ``finished`` True and ``finish_reason`` set: "stop", "length", "cancelled", "expired" (never admitted
    within ``queue_timeout_s``) or "error" (the model step failed).
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[["Request", str, bool], None]
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    queued_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    error: str | None = None  # what failed, for finish_reason "error"
    grammar: GrammarState | None = None  # the grammar the reply follows (None: free text)
    followers: list["Request"] = field(default_factory=list)  # more choices of the same prompt, one prefill
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest at its place
    beam: BeamParams | None = None  # a beam search instead of sampling (its max_new_tokens: params')
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    media: MediaFeed | None = None  # the prompt's pictures

    @property
    def media_spans(self) -> list[MediaSpan]:
        """Where the prompt's pictures are."""
        return self.media.spans if self.media else []

    def cancel(self) -> None:
        """Ask the scheduler to stop this request and free its blocks (safe from any thread)."""
        self.cancelled = True


@dataclass(eq=False)
class _Running:
    request: Request
    seq: Sequence
    reply: ReplyStream
    generator: torch.Generator
    leader: "_Running | None" = None  # a follower's leader, until it forks from it
    search: BeamSearch | None = None  # a beam request's search, once its prompt is in

    @property
    def prefilling(self) -> bool:
        return self.leader is None and self.search is None and len(self.seq) < len(self.request.prompt_ids)

    @property
    def decoding(self) -> bool:
        return self.leader is None and self.search is None and len(self.seq) >= len(self.request.prompt_ids)

    @property
    def sessions(self) -> int:
        """Session slots it holds: one per beam."""
        return self.request.beam.beam_width if self.request.beam else 1


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


class Scheduler:
    """Runs every admitted request one model step at a time; see the module docstring."""

    def __init__(self, engine: Engine, cache: PagedKVCache, config: SchedulerConfig | None = None) -> None:
        """ConfigError when the engine's model has no batched step."""
        if not engine.model.batched:
            raise ConfigError(f"{engine.folder}: its model ({type(engine.model).__name__}) runs one sequence at a time "
                              "and the scheduler batches every request in one step; serve an engine folder written "
                              "by cabin-build (the reference engine), or chat with this one through cabin-chat")
        self.engine, self.model, self.cache = engine, engine.model, cache
        self.config = config or SchedulerConfig()
        self._waiting: deque[Request] = deque()
        self._running: list[_Running] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stats = SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0.0, 0)
        self._cache_stats = cache.stats()
        # the scheduler's own histograms (in no registry; the server's metrics collect them)
        self.ttft = Histogram("cabin_time_to_first_token_seconds", "seconds from a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS_S, registry=None)
        self.token_gap = Histogram("cabin_inter_token_latency_seconds", "seconds between a request's tokens after "
                                   "the first", buckets=TOKEN_GAP_BUCKETS_S, registry=None)

    # -- any thread ------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request; QueueFull when ``max_queue`` are waiting already."""
        with self._lock:
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue "
                                f"{self.config.max_queue})")
            self._waiting.append(request)
            self._wake.notify()

    def stats(self) -> tuple[SchedulerStats, CacheStats]:
        """A snapshot of the counters and of the cache as the last step left it."""
        with self._lock:
            return SchedulerStats(**{**vars(self._stats), "waiting": len(self._waiting),
                                     "running": len(self._running)}), self._cache_stats

    def never_fits(self, request: Request) -> str | None:
        """Why a request (its followers or beams included) could not be admitted even on an idle server (None:
        it can)."""
        sessions, what = _sessions(request), "beams" if request.beam else "choices"
        if sessions > self.config.max_sessions:
            return f"{sessions} {what} need {sessions} sessions and the server decodes {self.config.max_sessions}"
        tpb = self.cache.tokens_per_block
        needed = cdiv(len(request.prompt_ids) + _own_reply(request), tpb) + self._extra_blocks(request)
        total = self.cache.blocks.num_blocks
        if needed > total:
            return (f"the prompt and {sessions} {what} of up to {request.params.max_new_tokens} tokens need "
                    f"{needed} KV blocks of {tpb} tokens and the whole pool holds {total}")
        return None

    def capacity_tokens(self) -> int:
        """Tokens one conversation can hold at most: the whole pool, within the model's context."""
        return min(self.cache.pool_tokens, self.engine.config.max_position_embeddings)

    def run(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step until ``stop`` is set, sleeping while there is nothing to do; cancels what is left at the end."""
        while not stop.is_set():
            try:
                worked = self.step()
            except Exception as err:  # one failed step must not stop the server
                self.fail_running(err)
                worked = True
            if not worked:
                with self._lock:
                    if not self._waiting:
                        self._wake.wait(idle_wait_s)
        with self._lock:
            for request in self._waiting:
                request.cancel()
            left = list(self._waiting)
            self._waiting.clear()
        for request in left:
            self._finish_unstarted(request, "cancelled")
        for running in list(self._running):
            running.request.cancel()
        self._drop_cancelled()

    # -- the stepping thread ---------------------------------------------------------------
    def fail_running(self, error: Exception) -> None:
        """End every running request with finish_reason "error" after a failed step, on a fresh cache: the
        failed step may have hashed blocks whose K/V it never wrote, so no cached prefix is trusted."""
        log.error("model step failed; ending %d running requests: %r", len(self._running), error)
        for running in list(self._running):
            running.request.error = f"{type(error).__name__}: {error}"
            if running in self._running:  # a leader's finish ends its followers that have not forked yet
                self._finish(running, "error")
        self.cache = self.engine.new_cache(self.cache.config, self.cache.max_sequences)
        with self._lock:
            self._cache_stats = self.cache.stats()

    def step(self) -> bool:
        """Admit, prefill and decode once; returns whether there was anything to run."""
        self._drop_cancelled()
        self._admit()
        spans, owners = self._plan_step()
        if not spans:
            with self._lock:
                self._cache_stats = self.cache.stats()
            return False
        t0 = time.perf_counter()
        rows = [r.request.media.rows for r in self._running if r.request.media]  # encoded where a span reads them
        logits = self.model.step(spans, self.cache, media=ChainMap(*rows) if rows else None)
        peak = self.cache.stats()  # the most this step holds: before any sequence finishes
        beams: dict[_Running, list[torch.Tensor]] = {}
        for running, row in zip(owners, logits):
            if running is not None and running.request.beam:
                beams.setdefault(running, []).append(row)
            elif running is not None:
                for follower in self._unforked(running):
                    self.cache.fork(running.seq, follower.seq)  # the prompt is in: the follower shares it
                    follower.leader = None
                    self._sample(follower, row)
                self._sample(running, row)
        for running, rows in beams.items():
            self._advance_beams(running, torch.stack(rows))
        with self._lock:
            self._stats.steps += 1
            self._stats.busy_s += time.perf_counter() - t0
            self._stats.kv_bytes_used_peak = max(self._stats.kv_bytes_used_peak, peak.bytes_used)
            self._cache_stats = self.cache.stats()
        return True

    def _drop_cancelled(self) -> None:
        """Finish cancelled requests and those that waited past ``queue_timeout_s``."""
        deadline = time.perf_counter() - self.config.queue_timeout_s
        with self._lock:
            dropped = [r for r in self._waiting if r.cancelled or r.queued_at < deadline]
            for request in dropped:
                self._waiting.remove(request)
        for request in dropped:
            self._finish_unstarted(request, "cancelled" if request.cancelled else "expired")
        for running in [r for r in self._running if r.request.cancelled]:
            if running in self._running:  # a leader's cancel ends its followers that have not forked yet
                self._finish(running, "cancelled")

    def _unforked(self, leader: _Running) -> list[_Running]:
        """A leader's followers that wait for its prompt."""
        return [r for r in self._running if r.leader is leader] if leader.request.followers else []

    def _fork_blocks(self, request: Request) -> int:
        """Blocks a forked choice may add at most: its copy of the shared last block and its reply's blocks."""
        return cdiv(request.params.max_new_tokens - 1, self.cache.tokens_per_block) + 1

    def _beam_blocks(self, request: Request, generated: int = 0) -> int:
        """Blocks a beam search's beams may still add: per beam its reply's rest and one copied block."""
        rest = request.params.max_new_tokens - generated
        return request.beam.beam_width * (cdiv(rest, self.cache.tokens_per_block) + 1)

    def _extra_blocks(self, request: Request) -> int:
        """Blocks a request's followers or beams may add beside its own sequence."""
        if request.beam:
            return self._beam_blocks(request)
        return sum(self._fork_blocks(follower) for follower in request.followers)

    def _reserved(self, running: _Running) -> int:
        """Blocks a running sequence may still take."""
        request = running.request
        if running.leader is not None:
            return self._fork_blocks(request)
        if running.search is not None:
            return self._beam_blocks(request, running.search.cur_len - running.search.prompt_len)
        own = len(request.prompt_ids) + _own_reply(request) - len(running.seq)
        return self.cache.blocks_needed(running.seq, own) + (self._beam_blocks(request) if request.beam else 0)

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    return
                request = self._waiting[0]
            held = sum(r.sessions for r in self._running)
            if held + _sessions(request) > self.config.max_sessions:
                return
            reserved = sum(self._reserved(r) for r in self._running)
            prompt = request.prompt_ids
            needed, cached = self.cache.blocks_to_admit(prompt, _own_reply(request), request.media_spans)
            needed += self._extra_blocks(request)  # followers are admitted with their leader
            if needed > self.cache.available_blocks() - reserved:
                return  # waits for running sequences to finish; those behind it wait too (FIFO)
            with self._lock:
                self._waiting.popleft()
            request.cached_tokens = cached
            leader = self._start(request)
            for follower in request.followers:
                follower.cached_tokens = cached
                self._start(follower, leader)
            with self._lock:
                self._stats.prompt_tokens += len(prompt)
                self._stats.cached_tokens += cached

    def _start(self, request: Request, leader: _Running | None = None) -> _Running:
        reply = ReplyStream(request.params, self.engine.tokenizer.decode_reply, grammar=request.grammar)
        running = _Running(request, Sequence(), reply, make_generator(request.params.seed), leader)
        self._running.append(running)
        return running

    def _plan_step(self) -> tuple[list[Span], list[_Running | None]]:
        """One decode token per decoding sequence, then prompt chunks within the prefill budget.

        ``owners[i]`` is the sequence that samples from span i's logits (None: a prompt chunk that is not
        the last one)."""
        spans: list[Span] = []
        owners: list[_Running | None] = []
        for running in self._running:
            if running.search is not None:
                beam_spans = running.search.spans()
                spans += beam_spans
                owners += [running] * len(beam_spans)
            elif running.decoding:
                token, position = running.request.token_ids[-1], len(running.seq)
                self.cache.append(running.seq, [token])
                spans.append(Span([token], position, running.seq))
                owners.append(running)
        budget = self.config.prefill_chunk
        for running in self._running:
            if budget == 0:
                break
            if not running.prefilling:
                continue
            prompt, start, media = running.request.prompt_ids, len(running.seq), running.request.media_spans
            if start == 0:
                end = min(len(prompt), running.request.cached_tokens + budget)
                start = self.cache.allocate(running.seq, prompt[:end], [m for m in media if m.start < end])
            else:
                end = min(len(prompt), start + budget)
                self.cache.append(running.seq, prompt[start:end], [m for m in media if start <= m.start < end])
            spans.append(Span(prompt[start:end], start, running.seq))
            owners.append(running if end == len(prompt) else None)
            budget -= end - start
        return spans, owners

    def _advance_beams(self, running: _Running, logits: torch.Tensor) -> None:
        """Start a beam search on its prompt's logits, or advance it; a search that ended gives its best beam as
        the reply."""
        request = running.request
        if running.search is None:
            running.search = BeamSearch(self.cache, len(request.prompt_ids), request.beam)
            running.search.start(running.seq, logits[0])
        else:
            running.search.advance(logits)
        with self._lock:
            self._stats.generated_tokens += len(logits)
        if not running.search.done:
            return
        result = running.search.close()
        best = result.token_ids[0] if result.token_ids else []
        request.first_token_at = request.first_token_at or time.perf_counter()
        for token in best:
            request.token_ids.append(token)
            running.reply.push(token)
            if running.reply.finish_reason:
                break
        self._finish(running, "length")

    def _sample(self, running: _Running, logits: torch.Tensor) -> None:
        request = running.request
        try:
            logits = running.reply.constrain(logits)
            token = sample(logits, request.params, running.generator)
        except GrammarError as err:  # the grammar's own failure ends its request only
            request.error = str(err)
            self._finish(running, "error")
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
        with self._lock:
            self._stats.generated_tokens += 1
        piece = running.reply.push(token)
        if running.reply.finish_reason:
            self._finish(running)
        elif piece:
            request.text += piece
            request.on_output(request, piece, False)

    def _finish(self, running: _Running, reason: str | None = None) -> None:
        """Free the sequence, hand over the rest of the text (cut at a stop string) and the finish reason: the
        reply's stop rule, else ``reason``."""
        self._running.remove(running)
        for follower in self._unforked(running):  # never forked: nothing to share
            follower.request.error = running.request.error
            self._finish(follower, reason or "cancelled")
        if running.search is not None:
            running.search.close()  # every beam's sequence, the prompt's among them
        if running.seq:
            self.cache.free(running.seq)
        request, reply = running.request, running.reply
        rest = reply.close(reason)
        request.text, request.finish_reason = reply.text, reply.finish_reason
        stats = self.cache.stats()
        with self._lock:
            self._stats.requests_done += 1
            self._cache_stats = stats  # a client told it is done finds its blocks freed in the metrics
        request.on_output(request, rest if reason != "cancelled" else "", True)

    def _finish_unstarted(self, request: Request, reason: str) -> None:
        for one in (request, *request.followers):
            one.finish_reason = reason
            one.on_output(one, "", True)


def _own_reply(request: Request) -> int:
    """Reply tokens a request's own sequence may hold (its last token is never fed; a beam search's replies are its
    beams')."""
    return 0 if request.beam else request.params.max_new_tokens - 1


def _sessions(request: Request) -> int:
    """Session slots a request takes: one per choice, or one per beam."""
    return request.beam.beam_width if request.beam else 1 + len(request.followers)
