"""Prefill and decode speed at several context lengths, every runner interleaved within each repeat."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from cabinllm.benchmarks.paired import PairRatio, median, paired_ratio
from cabinllm.benchmarks.runners.base import Runner, RunTiming

METRICS = ("decode_tok_s", "prefill_tok_s")


@dataclass
class SpeedSamples:
    """Every run of the speed test: samples[metric][runner][context] has one entry per repeat (None: failed)."""

    samples: dict[str, dict[str, dict[int, list[float | None]]]] = field(
        default_factory=lambda: {m: {} for m in METRICS})
    errors: dict[str, str] = field(default_factory=dict)
    warm_up_runs: int = 0  # untimed runs of each runner before the repeats

    def add(self, runner: str, context: int, values: dict[str, float] | None) -> None:
        """Record one run (None if it failed)."""
        for metric in METRICS:
            self.samples[metric].setdefault(runner, {}).setdefault(context, []).append(
                None if values is None else values[metric])


def rotated(items: list, by: int) -> list:
    """items started at position ``by`` (mod length), so no runner always goes first."""
    by %= max(len(items), 1)
    return items[by:] + items[:by]


def _try_run(runner: Runner, prompt: list[int], new_tokens: int, result: SpeedSamples) -> RunTiming | None:
    """One run; a failure is recorded in result.errors (with its reason) and gives None."""
    try:
        return runner.run(prompt, new_tokens)
    except Exception as err:  # a peer that breaks is a result, reported with its reason
        result.errors[runner.name] = f"{type(err).__name__}: {err}"
        print(f"cabin-bench: {runner.name} failed: {result.errors[runner.name]}", file=sys.stderr)
        return None


def measure_speed(runners: list[Runner], prompts: dict[int, list[int]], new_tokens: int, repeats: int,
                  bar: tqdm | None = None) -> SpeedSamples:
    """First one untimed warm-up run of every runner (the shortest prompt, the same decode steps), so that no
    runner's first timed run carries one-time costs (lazy imports, kernel set-up, first touch of its weights).
    Then each repeat runs, for each context, every runner back to back (in a rotating order), so a change of
    machine load hits the runners of a pair alike. A runner that fails is recorded and not run again."""
    result = SpeedSamples(warm_up_runs=1)
    for runner in runners:
        if bar is not None:
            bar.set_postfix_str(f"warm-up: {runner.name}")
        _try_run(runner, prompts[min(prompts)], new_tokens, result)
        if bar is not None:
            bar.update()
    for repeat in range(repeats):
        for context, prompt in prompts.items():
            for runner in rotated(runners, repeat):
                if bar is not None:
                    bar.set_postfix_str(f"{runner.name} @ {context}")
                timing = None if runner.name in result.errors else _try_run(runner, prompt, new_tokens, result)
                result.add(runner.name, context, None if timing is None else {
                    "decode_tok_s": timing.decode_tok_s, "prefill_tok_s": timing.prefill_tok_s})
                if bar is not None:
                    bar.update()
    return result


def speed_rows(speed: SpeedSamples) -> list[dict]:
    """Median prefill and decode tokens/s per runner and context."""
    rows = []
    for runner, by_context in speed.samples["decode_tok_s"].items():
        for context in by_context:
            row = {"runner": runner, "context": context}
            for metric in METRICS:
                values = [v for v in speed.samples[metric][runner][context] if v is not None]
                row[metric] = median(values)
                row[f"{metric}_samples"] = values
            rows.append(row)
    return rows


def speed_ratios(speed: SpeedSamples, ours: list[str], peers: list[str]) -> list[PairRatio]:
    """ours / peer for every pair, metric and context, pair by pair within repeats."""
    out = []
    for metric in METRICS:
        table = speed.samples[metric]
        for o in ours:
            for p in peers:
                for context in table.get(o, {}):
                    ratio, pairs = paired_ratio(table[o][context], table.get(p, {}).get(context, []))
                    out.append(PairRatio(o, p, metric, context, ratio, pairs))
    return out
