"""A multi-turn dialogue on one engine and one paged KV cache.

Each turn prefills only what is new since the last turn: the history's KV stays in
the cache. A shared prefix (the system prompt) is found again through the cache's
block hashes, so a second session starting the same way reuses its blocks. When a
turn does not fit the budget, the session's overflow policy decides what to keep.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from runtime.engine import Engine
from runtime.generate import CapacityError, generate
from runtime.kv_cache import PagedKVCache
from runtime.overflow import OverflowPolicy, drop_oldest_turns, sink_window
from runtime.sampling import SamplingParams

_seq_ids = itertools.count()
CAPACITY_HINT = "start a new conversation (/reset), raise --kv-budget-mb, or choose --overflow sink-window|drop-turns"


@dataclass
class TurnStats:
    """One turn's reply and what it cost."""

    turn: int
    reply: str
    token_ids: list[int]
    prefill_tokens: int
    reused_tokens: int
    ttft_s: float
    decode_tok_s: float
    kv_bytes_used: int
    kv_bytes_budget: int
    kv_bytes_per_token: int
    kv_mode: str
    finish_reason: str
    evicted_tokens: int = 0
    policy: str = "error"
    error: str | None = None

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


@dataclass
class _Plan:
    """Tokens to feed this turn, and whether the sequence is rebuilt first."""

    feed: list[int]
    rebuild: bool
    messages: list[dict]
    prompt: str
    evicted: int = 0


class DialogueSession:
    """System, user and assistant messages plus the sequence that holds their KV."""

    def __init__(self, engine: Engine, cache: PagedKVCache, params: SamplingParams | None = None,
                 system_prompt: str | None = None, overflow: OverflowPolicy | None = None) -> None:
        self.engine, self.cache = engine, cache
        self.params = params or SamplingParams(stop_token_ids=engine.stop_token_ids())
        self.overflow = overflow or OverflowPolicy("error")
        self.system_prompt = system_prompt
        self.seq_id = next(_seq_ids)
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.fed: list[int] = []      # tokens whose K/V are in the cache
        self.pending: list[int] = []  # the last sampled token, fed with the next turn
        self.transcript = ""          # the conversation text the KV and pending token stand for
        self.turns = 0

    def chat(self, user_text: str, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> TurnStats:
        """Answer one user message; a turn that cannot fit ends with finish_reason 'capacity'."""
        self.turns += 1
        messages = self.messages + [{"role": "user", "content": user_text}]
        try:
            plan = self._plan(messages)
            if plan.rebuild:
                self._release()
            result = generate(self.engine.model, self.cache, self.seq_id, plan.feed, self.params,
                              self.engine.tokenizer.decode_reply, on_text, should_stop)
        except CapacityError as err:
            return self._stats("", [], 0, 0, 0.0, 0.0, "capacity", 0, f"{err}; {CAPACITY_HINT}")
        self.messages = plan.messages + [{"role": "assistant", "content": result.text}]
        self.fed += plan.feed + result.token_ids[:-1]
        self.pending = result.token_ids[-1:]
        self.transcript = plan.prompt + self.engine.tokenizer.decode(result.token_ids)
        return self._stats(result.text, result.token_ids, result.prefill_tokens, result.reused_tokens,
                           result.ttft_s, result.decode_tok_s, result.finish_reason, plan.evicted)

    def save(self, path: str | Path) -> None:
        """Write messages, KV and fingerprints to path atomically."""
        from runtime.session_store import save_session

        save_session(self, path)

    @classmethod
    def restore(cls, path: str | Path, engine: Engine, cache: PagedKVCache | None = None) -> "DialogueSession":
        """Continue a saved session on an engine of the same model and scales, without re-prefill."""
        from runtime.session_store import restore_session

        return restore_session(path, engine, cache)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and release its KV blocks."""
        self._release()
        self.messages = self.messages[:1] if self.system_prompt else []
        self.turns = 0

    # -- planning ------------------------------------------------------------------
    def _plan(self, messages: list[dict]) -> _Plan:
        """Decide what to feed: append the new tokens, or rebuild the sequence under the policy."""
        tok = self.engine.tokenizer
        prompt = tok.render(messages)
        history = self.fed + self.pending
        if history and prompt.startswith(self.transcript):
            new = tok.encode(prompt[len(self.transcript):])
            if self._fits(len(self.fed), len(self.pending) + len(new)):
                return _Plan(self.pending + new, False, messages, prompt)
            stream = history + new
        else:
            stream = tok.encode_prompt(prompt)
        if self._fits(0, len(stream)):
            return _Plan(stream, True, messages, prompt)
        return self._evict(messages, prompt, stream)

    def _evict(self, messages: list[dict], prompt: str, stream: list[int]) -> _Plan:
        """Apply the overflow policy to a stream of tokens that does not fit."""
        policy = self.overflow
        tok = self.engine.tokenizer
        limit = int(self._capacity() * policy.keep_fraction) - self.params.max_new_tokens
        message = len(tok.encode_prompt(prompt[len(tok.render(messages[:-1], add_generation_prompt=False)):]))
        if message + self.params.max_new_tokens > self._capacity():
            raise CapacityError(f"the message is {message} tokens and its reply may take {self.params.max_new_tokens} "
                                f"more, but the KV budget holds {self._capacity()} tokens; shorten the message")
        if policy.name == "sink-window":
            sink = len(tok.encode_prompt(tok.render(messages[:1], add_generation_prompt=False))) if self.system_prompt else 0
            kept = sink_window(stream, sink + policy.sink_tokens, limit)
            if limit > sink + policy.sink_tokens and self._fits(0, len(kept)):
                return _Plan(kept, True, messages, prompt, len(stream) - len(kept))
        elif policy.name == "drop-turns":
            kept_messages = drop_oldest_turns(messages, lambda m: len(tok.encode_prompt(tok.render(m))) <= limit)
            if kept_messages:
                kept_prompt = tok.render(kept_messages)
                ids = tok.encode_prompt(kept_prompt)
                return _Plan(ids, True, kept_messages, kept_prompt, max(0, len(stream) - len(ids)))
        raise CapacityError(f"the turn needs {len(stream) + self.params.max_new_tokens} tokens of KV but the budget "
                            f"holds {self._capacity()} for this conversation (policy {policy.name})")

    def _capacity(self) -> int:
        """Tokens this conversation could hold: its own blocks plus every free or evictable one."""
        blocks = self.cache.blocks
        own = len(blocks.block_table(self.seq_id)) if blocks.has_sequence(self.seq_id) else 0
        tokens = (own + blocks.num_free_blocks()) * blocks.block_size
        return min(tokens, self.engine.config.max_position_embeddings)

    def _fits(self, held: int, new: int) -> bool:
        """Whether ``new`` tokens plus a full reply fit after ``held`` tokens (0 = rebuilt sequence)."""
        total = new + self.params.max_new_tokens
        if held + total > self.engine.config.max_position_embeddings:
            return False
        blocks = self.cache.blocks
        if held:
            return blocks.blocks_needed(self.seq_id, total) <= blocks.num_free_blocks()
        return blocks.blocks_needed(None, total) <= self._capacity() // blocks.block_size

    def _release(self) -> None:
        if self.cache.blocks.has_sequence(self.seq_id):
            self.cache.free(self.seq_id)
        self.fed, self.pending, self.transcript = [], [], ""

    def _stats(self, reply: str, ids: list[int], prefill: int, reused: int, ttft: float, tok_s: float,
               finish: str, evicted: int, error: str | None = None) -> TurnStats:
        s = self.cache.stats()
        return TurnStats(self.turns, reply, ids, prefill, reused, ttft, tok_s, s.bytes_used, s.bytes_reserved,
                         s.bytes_per_token, s.mode, finish, evicted, self.overflow.name, error)
