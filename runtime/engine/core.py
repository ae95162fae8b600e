"""The engine core: requests in, one ``step`` (schedule -> run the model on the batch -> postprocess), outputs out.

Every front end drives this one loop: the dialogue session submits one request per turn and drains it
(``generate``), ``cabin-serve`` submits many from its HTTP threads while one thread steps (``run``). The scheduler
(cabinllm.runtime.engine.scheduler) decides what runs and what the logits become; the model runner
(cabinllm.runtime.model.interface) computes them over the paged cache.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from cabinllm.runtime.errors import CapacityError
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from cabinllm.runtime.kv.cache import CacheStats, PagedKVCache
from cabinllm.runtime.model.interface import ModelRunner

log = logging.getLogger(__name__)


class EngineCore:
    """One model runner, one paged cache and the requests that share them."""

    def __init__(self, model: ModelRunner, cache: PagedKVCache, decode: Callable[[list[int]], str],
                 config: SchedulerConfig | None = None) -> None:
        """``decode`` turns reply tokens into text (the tokenizer's ``decode_reply``)."""
        self.model = model
        self.scheduler = Scheduler(cache, decode, model.config.max_position_embeddings, config)
        self._wake = threading.Condition(self.scheduler.lock)

    @property
    def cache(self) -> PagedKVCache:
        """The paged cache every request's K/V lives in."""
        return self.scheduler.cache

    @property
    def config(self) -> SchedulerConfig:
        """The scheduler's limits."""
        return self.scheduler.config

    # -- any thread ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; QueueFull when the queue is full."""
        self.scheduler.add(request)
        with self._wake:
            self._wake.notify()

    def abort(self, request: Request, reason: str = "cancelled") -> None:
        """Stop a request at the next step and free its blocks (safe from any thread)."""
        request.cancel(reason)

    def never_fits(self, request: Request) -> str | None:
        """Why a request could not run even with nothing else running (None: it can)."""
        return self.scheduler.never_fits(request)

    def capacity_tokens(self) -> int:
        """Tokens one conversation can hold at most: the whole pool, within the model's context."""
        return min(self.cache.pool_tokens, self.scheduler.context)

    def stats(self) -> tuple[SchedulerStats, CacheStats]:
        """A snapshot of the counters and of the cache as the last step left it."""
        s = self.scheduler
        with s.lock:
            return SchedulerStats(**{**vars(s.stats), "waiting": len(s.waiting), "running": len(s.running)}), \
                s.cache_stats

    # -- the stepping thread ---------------------------------------------------------------
    def step(self) -> bool:
        """Admit, then run one model step over every admitted request and postprocess its logits; returns whether
        there was anything to run. A failed model step ends the batch's requests with "error" and raises."""
        s = self.scheduler
        s.drop_cancelled()
        s.admit()
        batch = s.schedule()
        if not batch.spans:
            self._snapshot()
            return False
        t0 = time.perf_counter()
        try:
            logits = self.model.step(batch.spans, self.cache, False, batch.media)
        except BaseException as err:
            s.unwind(batch, err)
            self._snapshot()
            raise
        peak = self.cache.stats()  # the most this step holds: before any sequence finishes
        s.postprocess(batch, logits)
        with s.lock:
            s.stats.steps += 1
            s.stats.busy_s += time.perf_counter() - t0
            s.stats.kv_bytes_used_peak = max(s.stats.kv_bytes_used_peak, peak.bytes_used)
        self._snapshot()
        return True

    def generate(self, request: Request, should_stop: Callable[[], bool] | None = None) -> Request:
        """Run one request to its end (a dialogue's turn; the core holds nothing else). ``should_stop`` ends it with
        finish_reason "interrupted" after any token. CapacityError, nothing run, where it cannot fit."""
        self.add_request(request)
        while request.finish_reason is None:
            if should_stop and request.token_ids and should_stop():
                self.abort(request, "interrupted")
            if not self.step() and request.finish_reason is None:
                raise RuntimeError("the engine core holds a request it can neither run nor end")
        if request.finish_reason == "capacity" and not request.token_ids:
            raise CapacityError(request.error or "the request does not fit the KV cache")
        return request

    def run(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step until ``stop`` is set, sleeping while there is nothing to do; cancels what is left at the end."""
        s = self.scheduler
        while not stop.is_set():
            try:
                worked = self.step()
            except Exception as err:  # one failed step must not stop the server
                self.fail_running(err)
                worked = True
            if not worked:
                with self._wake:
                    if not s.waiting:
                        self._wake.wait(idle_wait_s)
        with s.lock:
            left = list(s.waiting)
            s.waiting.clear()
        for request in left:
            s.finish_unstarted(request, "cancelled")
        for running in list(s.running):
            running.request.cancel()
        s.drop_cancelled()

    def fail_running(self, error: Exception) -> None:
        """End every running request with finish_reason "error" after a failed step, on a fresh cache: the
        failed step may have hashed blocks whose K/V it never wrote, so no cached prefix is trusted."""
        s = self.scheduler
        log.error("model step failed; ending %d running requests: %r", len(s.running), error)
        for running in list(s.running):
            running.request.error = f"{type(error).__name__}: {error}"
            if running in s.running:  # a leader's finish ends its followers that have not forked yet
                s.finish(running, "error")
        s.cache = self.cache.renewed()
        self._snapshot()

    def _snapshot(self) -> None:
        """Keep the cache's stats as this step left them (read by other threads)."""
        stats = self.cache.stats()
        with self.scheduler.lock:
            self.scheduler.cache_stats = stats
