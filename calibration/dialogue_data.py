"""A dialogue (chat messages with an id) and the checks every loader applies to raw records."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")


@dataclass
class Dialogue:
    """One conversation: an id unique within its source and chat messages ``{"role", "content"}`` (a user message
    may add ``images``: paths of the pictures it shows, or ``audio``: paths of the WAV clips it holds).

    Dialogues with the same ``group`` (e.g. parts of one long ShareGPT chat) always land in the same split.
    """

    id: str
    messages: list[dict]
    group: str | None = None


@dataclass
class LoadReport:
    """What a loader read: complete records, skipped malformed ones (by reason), a cut-off tail."""

    source: str
    records: int = 0
    skipped: int = 0
    truncated: bool = False
    skip_reasons: Counter = field(default_factory=Counter)

    def skip(self, reason: str) -> None:
        """Count one malformed record."""
        self.skipped += 1
        self.skip_reasons[reason] += 1

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"source": self.source, "records": self.records, "skipped_malformed": self.skipped,
                "truncated_tail": self.truncated, "skip_reasons": dict(self.skip_reasons)}


def check_messages(messages: object) -> str | None:
    """Why ``messages`` is not a usable chat (None when it is).

    Usable: a list of ``{"role", "content"}`` with known roles, non-empty text,
    a system message only first, and at least one user and one assistant turn.
    """
    if not isinstance(messages, list) or not messages:
        return "no messages"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return "unknown role"
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            return "empty or non-text content"
        if message["role"] == "system" and index != 0:
            return "system message not first"
    roles = {m["role"] for m in messages}
    if not {"user", "assistant"} <= roles:
        return "no user/assistant exchange"
    return None
