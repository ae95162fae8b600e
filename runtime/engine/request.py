"""A request to the engine core: a prompt, how to answer it (sampling, grammar, choices, beams, log-probabilities),
and what it produced so far. Front ends build one (the dialogue session per turn, the server per completion) and
read its fields as the core fills them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.grammar import GrammarState
from cabinllm.runtime.generation.sampling import SamplingParams, TokenLogprob
from cabinllm.runtime.kv.blocks import MediaSpan, Sequence
from cabinllm.runtime.model.interface import MediaFeed

OnOutput = Callable[["Request", str, bool], None]


def _ignore(request: "Request", text: str, finished: bool) -> None:
    """The default ``on_output``: the caller reads the request's fields at the end."""


@dataclass(eq=False)
class Request:
    """One completion: its prompt tokens, how to answer, and what it produced so far.

    ``on_output(request, text, finished)`` receives each new piece of reply text; the last call has ``finished``
    True and ``finish_reason`` set: "stop", "length", "capacity" (it cannot fit, or the pool ran out mid-reply),
    "cancelled" / "interrupted" (``cancel``), "expired" (never admitted within the queue timeout) or "error" (its
    grammar or the model step failed; ``error`` says what). A request given ``seq`` continues that sequence (a
    dialogue's history): ``prompt_ids`` are its new tokens, and the sequence stays the caller's at the end, holding
    the reply's K/V but its last token.
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_output: OnOutput = _ignore
    grammar: GrammarState | None = None  # the grammar the reply follows (None: free text)
    followers: list["Request"] = field(default_factory=list)  # more choices of the same prompt, one prefill
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest at its place
    beam: BeamParams | None = None  # a beam search instead of sampling
    media: MediaFeed | None = None  # the prompt's pictures
    seq: Sequence | None = None  # the sequence it continues (None: a new one, its prefix found in the cache)
    # what the core fills in
    cached_tokens: int = 0  # prompt tokens found in the cache (a continued sequence's history not counted)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    beams: list[list[int]] = field(default_factory=list)  # a beam search's finished beams, best first
    queued_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    cancelled: str | None = None  # the finish reason asked for by ``cancel``

    @property
    def media_spans(self) -> list[MediaSpan]:
        """Where the prompt's pictures are, from its first token."""
        return self.media.spans if self.media else []

    @property
    def sessions(self) -> int:
        """Sequences it decodes at once: one per choice, or one per beam."""
        return self.beam.beam_width if self.beam else 1 + len(self.followers)

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the core to stop this request and free its blocks at its next step (safe from any thread)."""
        self.cancelled = reason

    @property
    def ttft_s(self) -> float:
        """Seconds from its arrival to its first token (0 before it has one)."""
        return self.first_token_at - self.queued_at if self.first_token_at else 0.0

    @property
    def decode_s(self) -> float:
        """Seconds from its first token to its end."""
        return self.finished_at - self.first_token_at if self.finished_at and self.first_token_at else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode speed over the tokens after the first."""
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0
