"""Token workloads shared by the benchmarks: ShareGPT text of a given length and the user turns of a long dialogue."""
from __future__ import annotations

from cabinllm.calibration.sources import open_source
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import DataError


def sharegpt_stream(engine: Engine, length: int) -> list[int]:
    """``length`` tokens of ShareGPT dialogues, each rendered with the chat template, concatenated."""
    dialogues, _ = open_source("sharegpt")
    ids: list[int] = []
    for dialogue in dialogues:
        ids += engine.tokenizer.encode(engine.tokenizer.render(dialogue.messages, add_generation_prompt=False))
        if len(ids) >= length:
            return ids[:length]
    raise DataError(f"ShareGPT ran out of tokens before {length}")


def long_sharegpt_dialogue(engine: Engine, turns: int, max_user_tokens: int) -> list[str]:
    """User messages of the first ShareGPT dialogue with ``turns`` user turns of at most ``max_user_tokens``."""
    dialogues, _ = open_source("sharegpt")
    for dialogue in dialogues:
        users = [m["content"] for m in dialogue.messages if m["role"] == "user"]
        short = [u for u in users if 0 < len(engine.tokenizer.encode(u)) <= max_user_tokens]
        if len(short) >= turns:
            return short[:turns]
    raise DataError(f"no ShareGPT dialogue with {turns} user turns of at most {max_user_tokens} tokens")
