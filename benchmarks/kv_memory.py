"""KV bytes per token and the longest context that fits a byte budget, for every runner."""
from __future__ import annotations

import sys
from dataclasses import asdict

from tqdm import tqdm

from cabinllm.benchmarks.runners.base import Runner


def measure_kv_memory(runners: list[Runner], budget_bytes: int, model_context: int, prompt: list[int],
                      bar: tqdm | None = None) -> list[dict]:
    """One row per runner: bytes/token, fixed bytes, longest context in the budget (and capped by the model's
    context), ratio of bytes/token to our fp16; or the error where the measurement failed."""
    rows = []
    for runner in runners:
        if bar is not None:
            bar.set_postfix_str(f"KV footprint: {runner.name}")
        try:
            fp = runner.footprint(budget_bytes, prompt)
            rows.append({"runner": runner.name, **asdict(fp), "max_tokens_usable": min(fp.max_tokens, model_context)})
        except Exception as err:  # a peer that breaks is a result, reported with its reason
            print(f"cabin-bench: KV footprint of {runner.name} failed: {err}", file=sys.stderr)
            rows.append({"runner": runner.name, "error": f"{type(err).__name__}: {err}"})
        if bar is not None:
            bar.update()
    fp16 = next((r["bytes_per_token"] for r in rows if r["runner"] == "cabin fp16" and "error" not in r), None)
    for row in rows:
        row["vs_cabin_fp16"] = row["bytes_per_token"] / fp16 if fp16 and "error" not in row else None
    return rows
