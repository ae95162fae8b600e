"""The stop rules of one reply and its text as it streams, written once for every token loop.

The engine core's scheduler (``cabinllm.runtime.engine.scheduler``) and the TensorRT-LLM
session push each sampled token into a ``ReplyStream``. A reply ends at a stop token (kept in its ids, not
in its text), at a stop string (its text cut before it), after ``max_new_tokens`` tokens, or for a reason of
the loop's own ("interrupted", "capacity", "cancelled", "error"). Text is handed out as it becomes safe to
show: never half of a UTF-8 character, never the first characters of what may still become a stop string.
A reply under a grammar (``GrammarState``) samples through ``sample``: from the logits the grammar allows,
steered to a whole sentence where the tokens left could not hold one otherwise; its stop tokens are allowed once
the grammar is complete. A reply whose grammar writes calls ends, its text cut before it, at a call identical to
one it made already.
"""
from __future__ import annotations

from typing import Callable

import torch

from cabinllm.runtime.generation.grammar import GrammarState
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.generation.streaming import TextStream


class ReplyStream:
    """One reply as it is sampled: its ids, its text, the pieces safe to show and why it ended."""

    def __init__(self, params: SamplingParams, decode: Callable[[list[int]], str],
                 on_text: Callable[[str], None] | None = None, grammar: GrammarState | None = None) -> None:
        """``on_text`` receives each non-empty piece as it is handed out (``push`` and ``close`` also return it);
        ``grammar`` constrains the tokens (None: free text)."""
        self.params, self.grammar = params, grammar
        self.ids: list[int] = []
        self.finish_reason: str | None = None  # "stop" or "length" once a stop rule ended the reply
        self._on_text = on_text
        self._stream = TextStream(decode)
        self._stop_ids = set(params.stop_token_ids)
        self._held = max((len(s) - 1 for s in params.stop_strings), default=0)  # a stop string may be starting
        self._shown = 0  # characters handed out
        self._cut: int | None = None  # where the text ends before a repeated call
        self._calls_seen = 0  # call endings seen in the text so far

    @property
    def text(self) -> str:
        """The reply's text so far, cut before a stop string."""
        return self.params.cut_at_stop(self._stream.text)[:self._cut]

    def sample(self, logits: torch.Tensor, draw: Callable[[torch.Tensor], int]) -> tuple[int, torch.Tensor]:
        """The next token, drawn by ``draw`` from ``logits`` as the grammar allows (if the reply has one), and the
        logits it was drawn from: where no whole sentence of the grammar would fit the tokens left after the drawn
        token, it is drawn again from the tokens after which one does."""
        if not self.grammar:
            return draw(logits), logits
        logits = self.grammar.constrain(logits)
        token = draw(logits)
        left = self.params.max_new_tokens - len(self.ids) - 1
        if self.grammar.fits(token, left):
            return token, logits
        logits = self.grammar.steer(logits, left)
        return draw(logits), logits

    def push(self, token: int) -> str:
        """Add a sampled token and apply the stop rules; return the text that became safe to show ("" for the
        token that ends the reply: ``close`` hands out what is left)."""
        self.ids.append(token)
        if self.grammar:
            self.grammar.push(token)
        if token in self._stop_ids:
            self.finish_reason = "stop"
            return ""
        self._stream.push(token)
        if self.params.stops(self._stream.text) or self._repeats_a_call():
            self.finish_reason = "stop"
        elif len(self.ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason:
            return ""
        return self._hand_out(max(0, len(self._stream.text) - self._held))

    def close(self, reason: str | None = None) -> str:
        """End the reply for ``reason`` (the loop's own) unless a stop rule ended it already; return the text not
        shown yet, up to the stop string."""
        self.finish_reason = self.finish_reason or reason
        return self._hand_out(len(self.text))

    def _repeats_a_call(self) -> bool:
        """Whether the call the text just completed is one the reply made already (the text is cut before it)."""
        calls = self.grammar.tool_format if self.grammar else None
        if calls is None:
            return False
        seen, self._calls_seen = self._calls_seen, self._stream.text.count(calls.after)
        if self._calls_seen == seen:
            return False
        self._cut = calls.repeats_a_call(self._stream.text)
        return self._cut is not None

    def _hand_out(self, end: int) -> str:
        """The text from what was shown up to ``end``, now shown."""
        piece = self._stream.text[self._shown:end]
        self._shown = max(self._shown, end)
        if piece and self._on_text:
            self._on_text(piece)
        return piece
