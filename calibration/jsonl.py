"""OpenAI-style chat JSONL: one ``{"messages": [{"role", "content"}, ...]}`` object per line; a user message may
show pictures, ``"images": ["cam.png", ...]``, paths from the file's folder (read by a vision-language model)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from cabinllm.calibration.dialogue_data import Dialogue, LoadReport, check_messages


def load_jsonl(path: Path, report: LoadReport) -> Iterator[Dialogue]:
    """Dialogues of a JSONL file; lines that are not valid chats are counted in ``report`` and skipped.

    A record's id is its ``id`` field if present, else ``line-N``.
    """
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            report.records += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                report.truncated = not line.endswith("\n")  # a last line cut off mid-object
                report.skip("invalid JSON")
                continue
            messages = record.get("messages") if isinstance(record, dict) else None
            reason = check_messages(messages)
            if reason:
                report.skip(reason)
                continue
            if not all(_pictures_ok(m) for m in messages):
                report.skip("images not a list of picture paths on a user message")
                continue
            messages = [{"role": m["role"], "content": m["content"]}
                        | ({"images": [str(path.parent / i) for i in m["images"]]} if m.get("images") else {})
                        for m in messages]
            yield Dialogue(str(record.get("id") or f"line-{number}"), messages)


def _pictures_ok(message: dict) -> bool:
    """Whether a message's ``images`` (if any) is a list of picture paths on a user message."""
    images = message.get("images", [])
    return isinstance(images, list) and all(isinstance(i, str) and i for i in images) \
        and (not images or message["role"] == "user")
