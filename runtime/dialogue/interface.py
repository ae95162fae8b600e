"""What every dialogue backend offers (the ``Session`` protocol) and what one turn reports (``TurnStats``).

Backends: ``cabinllm.runtime.dialogue.session.DialogueSession`` (the reference engine on our paged KV cache) and
``cabinllm.runtime.backends.trtllm.TrtllmSession`` (a TensorRT-LLM engine). Callers such as cabin-chat use
only this surface, never the concrete class.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Protocol

from cabinllm.runtime.dialogue.overflow import Compacted
from cabinllm.runtime.errors import CabinError, Fix, Hint
from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.model.tools import Tool
from cabinllm.runtime.speech.audio import Clip


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
    tool_calls: list[dict] = field(default_factory=list)  # the reply's calls in OpenAI's form (finish "tool_calls")
    alternatives: list[str] = field(default_factory=list)  # with n > 1 or a beam search: the other replies
    hints: tuple[Hint, ...] = ()  # what the user can change about ``error``; front ends word them
    call_confidence: list[float] = field(default_factory=list)  # per call: the probability of its function's name
    compacted: list[Compacted] = field(default_factory=list)  # media of answered turns replaced by text this turn
    heard: list[dict] = field(default_factory=list)  # the message's clips: name and Transcript.to_dict() (rtf)

    def error_words(self, phrases: Mapping[Fix, str | None] | None = None) -> str | None:
        """The error with its hints in a front end's ``phrases`` (the library's words by default)."""
        return CabinError(self.error, self.hints).words(phrases) if self.error else None

    def to_dict(self, phrases: Mapping[Fix, str | None] | None = None) -> dict:
        """JSON-ready form, the error worded in ``phrases``."""
        fields = {k: v for k, v in asdict(self).items() if k != "hints"}
        return {**fields, "error": self.error_words(phrases)}


def error_parts(error: str | CabinError | None) -> tuple[str | None, tuple[Hint, ...]]:
    """A turn's error as ``TurnStats`` holds it: the message, and the hints a ``CabinError`` carries."""
    return (error.message, error.hints) if isinstance(error, CabinError) else (error, ())


class Session(Protocol):
    """A multi-turn dialogue on one backend."""

    messages: list[dict]
    turns: int
    tools: list[Tool]  # the functions its replies may call
    params: SamplingParams  # how its replies are sampled, its stop tokens included

    def chat(self, message: str | dict, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None, tool_choice: str | None = None, n: int = 1,
             beam: BeamParams | None = None, images: list[tuple[str, bytes]] | None = None,
             audio: list[Clip] | None = None) -> TurnStats:
        """Answer one message (text: the user's; a dict: a message such as a tool's result), streaming the reply's
        text; ``tool_choice`` for this reply (None: the session's). ``n`` > 1 samples that many replies from one
        prefill, ``beam`` runs a beam search instead of sampling: the conversation goes on with the first reply
        (the best beam), the others come as ``alternatives``. ``images``: (name, bytes) of the pictures the message
        shows (ImageError, nothing changed, where one cannot be taken). ``audio``: clips the user spoke; on a text
        engine the message is their transcript, then its text (AudioError, nothing changed, where one cannot be
        taken or no speech front end is installed), and ``TurnStats.heard`` says what was heard. A turn that cannot
        fit ends with finish_reason 'capacity' and the session stays usable."""

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays."""

    def save(self, path: str | Path) -> int:
        """Write the conversation to ``path`` atomically; returns the tokens of KV saved.
        SessionFileError where the backend cannot save."""

    def describe_kv(self) -> str:
        """The KV memory of the session in one line."""
