"""Long sessions stitched from shorter dialogues of one split.

A real in-car session is many short exchanges piling up under one system prompt, and a long
general chat is what ShareGPT keeps in parts (``abc_0``, ``abc_1``, ...). A stitched session keeps
the first dialogue's system prompt and then every user/assistant message of each dialogue in turn,
so its K/V reach positions no single dialogue reaches. Parts of one conversation (same group) are
stitched together and in their order.
"""
from __future__ import annotations

from cabinllm.calibration.dialogue_data import Dialogue
from cabinllm.runtime.errors import ConfigError

SESSION_JOIN = "+"  # a stitched session's id: its dialogues' ids joined by this


def stitch(dialogues: list[Dialogue]) -> Dialogue:
    """One conversation: the first dialogue's system prompt (if any), then the other messages of all of them."""
    if not dialogues:
        raise ConfigError("stitch needs at least one dialogue")
    system = [m for m in dialogues[0].messages[:1] if m["role"] == "system"]
    turns = [m for d in dialogues for m in d.messages if m["role"] != "system"]
    return Dialogue(SESSION_JOIN.join(d.id for d in dialogues), system + turns, dialogues[0].group)


def conversation_order(dialogues: list[Dialogue]) -> list[Dialogue]:
    """The dialogues with the parts of each conversation (group) next to each other, in part order
    (``abc_2`` before ``abc_10``); conversations keep the order of their first part."""
    first_seen: dict[str, int] = {}
    for index, d in enumerate(dialogues):
        first_seen.setdefault(d.group or d.id, index)
    return sorted(dialogues, key=lambda d: (first_seen[d.group or d.id], len(d.id), d.id))
