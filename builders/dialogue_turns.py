"""Tokens per turn of a typical in-car dialogue, measured on the built-in cockpit dialogue set.

A turn is one user message plus one assistant reply, each with its chat-template
framing. The planner uses ``TYPICAL_TURN`` for every model, since a bare
config.json comes without a tokenizer: it was measured with the default model's
tokenizer on the 200 dialogues of ``calibration/data/cockpit_dialogues.jsonl``,
and ``tests/test_plan.py`` measures it again to keep the figure true.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import mean

from cabinllm.runtime.model.tokenizer import ChatTokenizer

TURNS_SOURCE = "the built-in cockpit dialogue set (calibration builtin, 200 dialogues)"


@dataclass(frozen=True)
class TurnTokens:
    """Mean tokens of a system prompt, a user message and an assistant reply, template included."""

    system: int
    user: int
    assistant: int
    measured_on: str
    tokenizer: str

    @property
    def per_turn(self) -> int:
        """Tokens one exchange (user + assistant) adds to the history."""
        return self.user + self.assistant

    def to_dict(self) -> dict:
        """JSON-ready form, with ``per_turn``."""
        return {**asdict(self), "per_turn": self.per_turn}


class MediaCost:
    """What one medium in a turn (a picture, a turn's speech) adds: its ``tokens``, their KV and the turns with one
    that a conversation holds. Its subclasses (``ImageCost``, ``AudioCost``) are frozen dataclasses."""

    tokens: int

    def kv_bytes(self, bytes_per_token: int) -> int:
        """KV bytes of the medium at ``bytes_per_token``."""
        return bytes_per_token * self.tokens

    def turns(self, max_seq_len: int, turn: TurnTokens) -> int:
        """Turns of the dialogue, each with the medium, that one conversation of ``max_seq_len`` holds."""
        return max((max_seq_len - turn.system) // (turn.per_turn + self.tokens), 0)


TYPICAL_TURN = TurnTokens(system=70, user=17, assistant=43, measured_on=TURNS_SOURCE,
                          tokenizer="SmolLM2-135M-Instruct")


def measure_turn_tokens(tokenizer: ChatTokenizer, dialogues: list[list[dict]], source: str,
                        tokenizer_name: str) -> TurnTokens:
    """Mean tokens each role's message adds to the rendered dialogue, rounded to whole tokens."""
    added: dict[str, list[int]] = {"system": [], "user": [], "assistant": []}
    for messages in dialogues:
        previous = 0
        for end, message in enumerate(messages, start=1):
            length = len(tokenizer.encode(tokenizer.render(messages[:end], add_generation_prompt=False)))
            added[message["role"]].append(length - previous)
            previous = length
    return TurnTokens(*(round(mean(added[role])) for role in ("system", "user", "assistant")),
                      measured_on=source, tokenizer=tokenizer_name)
