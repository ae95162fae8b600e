"""A multi-turn dialogue on one engine and one paged KV cache.

Each turn prefills only what is new since the last turn: the history's KV stays
in the cache. A shared prefix (the system prompt) is found again through the
cache's block hashes, so a second session starting the same way reuses it.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Callable

from runtime.engine import Engine
from runtime.generate import CapacityError, generate
from runtime.kv_cache import PagedKVCache
from runtime.sampling import SamplingParams

_seq_ids = itertools.count()


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
    error: str | None = None

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


class DialogueSession:
    """System, user and assistant messages plus the sequence that holds their KV."""

    def __init__(self, engine: Engine, cache: PagedKVCache, params: SamplingParams | None = None,
                 system_prompt: str | None = None) -> None:
        self.engine, self.cache = engine, cache
        self.params = params or SamplingParams(stop_token_ids=engine.stop_token_ids())
        self.system_prompt = system_prompt
        self.seq_id = next(_seq_ids)
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.fed: list[int] = []      # tokens whose K/V are in the cache
        self.pending: list[int] = []  # the last sampled token, fed with the next turn
        self.turns = 0

    def chat(self, user_text: str, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> TurnStats:
        """Answer one user message; a turn that does not fit ends with finish_reason 'capacity'."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        prompt = self.engine.tokenizer.render(messages, add_generation_prompt=True)
        new_ids = self._new_tokens(prompt)
        self.turns += 1
        try:
            result = generate(self.engine.model, self.cache, self.seq_id, new_ids, self.params,
                              self.engine.tokenizer.decode_reply, on_text, should_stop)
        except CapacityError as err:
            return self._stats("", [], 0, 0, 0.0, 0.0, "capacity",
                               f"{err}. Start a new conversation (/reset), raise --kv-budget-mb, "
                               "or use a smaller KV mode such as int8")
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        self.fed += new_ids + result.token_ids[:-1]
        self.pending = result.token_ids[-1:]
        return self._stats(result.text, result.token_ids, result.prefill_tokens, result.reused_tokens,
                           result.ttft_s, result.decode_tok_s, result.finish_reason)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and release its KV blocks."""
        if self.cache.blocks.has_sequence(self.seq_id):
            self.cache.free(self.seq_id)
        self.messages = self.messages[:1] if self.system_prompt else []
        self.fed, self.pending, self.turns = [], [], 0

    def _new_tokens(self, prompt: str) -> list[int]:
        """Tokens to feed for this prompt; drops cached tokens that no longer match it."""
        tok = self.engine.tokenizer
        history = self.fed + self.pending
        if history and prompt.startswith(tok.decode(history)):
            return self.pending + tok.encode(prompt[len(tok.decode(history)):])
        full = tok.encode(prompt)
        if tok.add_bos_token and tok.bos_token:
            full = [tok.token_id(tok.bos_token)] + full
        keep = _common_prefix(self.fed, full[:-1])
        if keep < len(self.fed):
            if keep == 0:
                self.cache.free(self.seq_id)
            else:
                self.cache.blocks.truncate(self.seq_id, keep)
            self.fed = self.fed[:keep]
        self.pending = []
        return full[keep:]

    def _stats(self, reply: str, ids: list[int], prefill: int, reused: int, ttft: float, tok_s: float,
               finish: str, error: str | None = None) -> TurnStats:
        s = self.cache.stats()
        return TurnStats(self.turns, reply, ids, prefill, reused, ttft, tok_s, s.bytes_used, s.bytes_reserved,
                         s.bytes_per_token, s.mode, finish, error)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
