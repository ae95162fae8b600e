"""What every dialogue backend offers (the ``Session`` protocol) and what one turn reports (``TurnStats``).

Backends: ``cabinllm.runtime.dialogue.session.DialogueSession`` (the reference engine on our paged KV cache) and
``cabinllm.runtime.backends.trtllm.TrtllmSession`` (a TensorRT-LLM engine). Callers such as cabin-chat use
only this surface, never the concrete class.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol


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


class Session(Protocol):
    """A multi-turn dialogue on one backend."""

    messages: list[dict]
    turns: int

    def chat(self, user_text: str, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> TurnStats:
        """Answer one user message, streaming the reply's text; a turn that cannot fit ends with
        finish_reason 'capacity' and the session stays usable."""

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays."""

    def save(self, path: str | Path) -> int:
        """Write the conversation to ``path`` atomically; returns the tokens of KV saved.
        SessionFileError where the backend cannot save."""

    def describe_kv(self) -> str:
        """The KV memory of the session in one line."""
