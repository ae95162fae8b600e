"""What to do when the next turn does not fit the KV budget.

- ``sink-window``: keep the first tokens (system prompt plus a few attention sinks, as in
  StreamingLLM) and the most recent tokens; the kept window is prefilled again at
  compacted positions, so RoPE positions stay contiguous and never pass the model's context.
- ``drop-turns``: drop the oldest whole user/assistant turns, keep the system prompt, and
  prefill what remains (the system prompt's blocks are found again by their hash).
- ``error``: refuse the turn with ``finish_reason: "capacity"``; the session stays usable.

After an eviction the history fills at most ``keep_fraction`` of the budget, so the next
turns append again instead of evicting every turn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

OVERFLOW_POLICIES = ("sink-window", "drop-turns", "error")


@dataclass
class OverflowPolicy:
    """Which policy, how many sink tokens it keeps, and how full the budget is after evicting."""

    name: str = "sink-window"
    sink_tokens: int = 4
    keep_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in OVERFLOW_POLICIES:
            raise ValueError(f"unknown overflow policy {self.name!r}; choose one of {', '.join(OVERFLOW_POLICIES)}")
        if not 0 < self.keep_fraction <= 1 or self.sink_tokens < 0:
            raise ValueError("need 0 < keep_fraction <= 1 and sink_tokens >= 0")


def sink_window(tokens: list[int], sink: int, limit: int) -> list[int]:
    """The first ``sink`` tokens and the most recent ones, ``limit`` tokens in all."""
    if len(tokens) <= limit:
        return tokens
    recent = limit - sink
    return tokens[:sink] + (tokens[-recent:] if recent > 0 else [])


def drop_oldest_turns(messages: list[dict], fits: Callable[[list[dict]], bool]) -> list[dict] | None:
    """Drop the oldest messages after the system prompt until ``fits``; None if even the last message alone does not."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head):]
    while body:
        if fits(head + body):
            return head + body
        body = body[1:]
        while body and body[0]["role"] != "user":  # a turn starts with the user
            body = body[1:]
    return None
