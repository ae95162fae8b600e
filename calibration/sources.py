"""Where dialogues come from: ``builtin`` (the cockpit set), ``sharegpt`` (the packaged file) or a path."""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Iterator

from cabinllm.calibration.dialogue_data import Dialogue, LoadReport
from cabinllm.calibration.jsonl import load_jsonl
from cabinllm.calibration.sharegpt import load_sharegpt, packaged_sharegpt_path
from cabinllm.runtime.errors import DataError, Fix, Hint

BUILTIN_FILE = "cockpit_dialogues.jsonl"


def builtin_path() -> Path:
    """The built-in cockpit dialogue set shipped as package data."""
    path = Path(str(resources.files("cabinllm.calibration") / "data" / BUILTIN_FILE))
    if not path.is_file():
        raise DataError(f"{path}: the built-in dialogue set is missing; reinstall cabinllm")
    return path


def open_source(spec: str) -> tuple[Iterator[Dialogue], LoadReport]:
    """Dialogues of ``builtin``, ``sharegpt`` or a file (``.jsonl``: OpenAI messages; ``.json``: ShareGPT).

    The iterator is lazy; the report fills in as it is consumed.
    """
    if spec == "builtin":
        report = LoadReport("builtin")
        return load_jsonl(builtin_path(), report), report
    if spec == "sharegpt":
        path = packaged_sharegpt_path()
        report = LoadReport(f"sharegpt:{path.name}")
        return load_sharegpt(path, report), report
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"{path}: no such file", (Hint(Fix.CALIBRATION_DATA),))
    report = LoadReport(str(path))
    if path.suffix == ".jsonl":
        return load_jsonl(path, report), report
    if path.suffix == ".json":
        return load_sharegpt(path, report), report
    raise DataError(f"{path}: unknown format; use .jsonl (OpenAI messages) or .json (ShareGPT)")
