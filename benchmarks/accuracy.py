"""Accuracy columns from a cabin-eval JSON (perplexity change, KL and top-1 agreement against fp32 KV)."""
from __future__ import annotations

import json
from pathlib import Path

from cabinllm.benchmarks.runners.base import Runner
from cabinllm.calibration.evaluate import REFERENCE_MODE, current_name, eval_name
from cabinllm.runtime.errors import EvalJsonError

COLUMNS = ("ppl", "ppl_delta_pct", "kl", "top1_agree")


def load_eval(path: Path) -> dict:
    """The file cabin-eval writes (``{"modes": {mode: {...}}, ...}``) or its printed ``--json`` object
    (``{mode: {...}}``), as ``{"modes": ..., "source": ...}``, modes under their current names."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise EvalJsonError(f"{path}: unreadable cabin-eval JSON ({err}); pass the eval.json cabin-eval wrote") from err
    modes = record.get("modes", record) if isinstance(record, dict) else None
    if not isinstance(modes, dict) or not modes or not all(isinstance(m, dict) and "ppl" in m for m in modes.values()):
        raise EvalJsonError(f"{path}: no per-mode results with 'ppl'; pass the eval.json cabin-eval wrote")
    source = {k: record[k] for k in ("model", "scales", "data", "command") if k in record}
    return {"file": str(path), "modes": {current_name(m): r for m, r in modes.items()}, **source}


def eval_mode(runner: Runner, equalized: bool) -> str | None:
    """The cabin-eval mode that measures this runner's KV storage, None where cabin-eval has none."""
    if runner.family == "cabin":
        return eval_name(runner.mode, equalized)
    if runner.name == "transformers dynamic":
        return REFERENCE_MODE  # fp32 KV: the reference itself
    return None


def accuracy_rows(runners: list[Runner], evaluation: dict | None, equalized: bool) -> dict[str, dict]:
    """runner name -> the cabin-eval columns of its mode (with the mode's name), for runners that have one."""
    if evaluation is None:
        return {}
    out = {}
    for runner in runners:
        mode = eval_mode(runner, equalized)
        if mode in evaluation["modes"]:
            out[runner.name] = {"eval_mode": mode, **{c: evaluation["modes"][mode].get(c) for c in COLUMNS}}
    return out
