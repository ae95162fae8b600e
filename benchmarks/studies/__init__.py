"""One-off measurements behind figures in the docs, each a ``python -m`` command."""
from __future__ import annotations

import json
from pathlib import Path

from cabinllm.runtime.formats.atomic import atomic_write_text

RESULTS = Path(__file__).resolve().parents[1] / "results"


def write_results(output: Path, result: dict, table: str) -> None:
    """Write a study's figures as ``output``.json and its tables as ``output``.md (atomically), and print them."""
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output.with_suffix(".json"), json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(output.with_suffix(".md"), table)
    print(table)
