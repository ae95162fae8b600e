"""OpenAI-style chat JSONL: one ``{"messages": [{"role", "content"}, ...]}`` object per line; a user message may
show pictures, ``"images": ["cam.png", ...]``, or hold speech, ``"audio": ["ask.wav", ...]``, paths from the file's
folder (read by a vision- or audio-language model)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from cabinllm.calibration.dialogue_data import Dialogue, LoadReport, check_messages


MEDIA_KEYS = ("images", "audio")  # a user message's pictures and clips, by path


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
            if not all(_paths_ok(m, key) for m in messages for key in MEDIA_KEYS):
                report.skip("images or audio not a list of file paths on a user message")
                continue
            messages = [{"role": m["role"], "content": m["content"]}
                        | {key: [str(path.parent / i) for i in m[key]] for key in MEDIA_KEYS if m.get(key)}
                        for m in messages]
            yield Dialogue(str(record.get("id") or f"line-{number}"), messages)


def _paths_ok(message: dict, key: str) -> bool:
    """Whether a message's ``images`` or ``audio`` (if any) is a list of file paths on a user message."""
    paths = message.get(key, [])
    return isinstance(paths, list) and all(isinstance(i, str) and i for i in paths) \
        and (not paths or message["role"] == "user")
