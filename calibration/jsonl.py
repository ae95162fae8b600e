"""OpenAI-style chat JSONL: one ``{"messages": [{"role", "content"}, ...]}`` object per line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from cabinllm.calibration.dialogue_data import Dialogue, LoadReport, check_messages
from cabinllm.runtime.errors import DataError


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
            if any(isinstance(m, dict) and "images" in m for m in messages):  # dropped, they would change the K/V
                raise DataError(f"{path}:{number}: a message shows pictures (images); calibration and cabin-eval "
                                "read text dialogues only: remove the images, or use a file without them")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            yield Dialogue(str(record.get("id") or f"line-{number}"), messages)
