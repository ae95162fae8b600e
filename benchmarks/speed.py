"""Prefill and decode speed at several context lengths, every runner interleaved within each repeat."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from benchmarks.runner import Runner
from benchmarks.stats import PairRatio, median, paired_ratio

METRICS = ("decode_tok_s", "prefill_tok_s")


@dataclass
class SpeedSamples:
    """Every run of the speed test: samples[metric][runner][context] has one entry per repeat (None: failed)."""

    samples: dict[str, dict[str, dict[int, list[float | None]]]] = field(
        default_factory=lambda: {m: {} for m in METRICS})
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, runner: str, context: int, values: dict[str, float] | None) -> None:
        """Record one run (None if it failed)."""
        for metric in METRICS:
            self.samples[metric].setdefault(runner, {}).setdefault(context, []).append(
                None if values is None else values[metric])


def rotated(items: list, by: int) -> list:
    """items started at position ``by`` (mod length), so no runner always goes first."""
    by %= max(len(items), 1)
    return items[by:] + items[:by]


def measure_speed(runners: list[Runner], prompts: dict[int, list[int]], new_tokens: int, repeats: int,
                  bar: tqdm | None = None) -> SpeedSamples:
    """Each repeat runs, for each context, every runner back to back (in a rotating order), so a change of
    machine load hits the runners of a pair alike. A runner that fails is recorded and not run again."""
    result = SpeedSamples()
    for repeat in range(repeats):
        for context, prompt in prompts.items():
            for runner in rotated(runners, repeat):
                if bar is not None:
                    bar.set_postfix_str(f"{runner.name} @ {context}")
                if runner.name in result.errors:
                    result.add(runner.name, context, None)
                else:
                    try:
                        timing = runner.run(prompt, new_tokens)
                        result.add(runner.name, context, {"decode_tok_s": timing.decode_tok_s,
                                                          "prefill_tok_s": timing.prefill_tok_s})
                    except Exception as err:  # a peer that breaks is a result, reported with its reason
                        result.errors[runner.name] = f"{type(err).__name__}: {err}"
                        print(f"cabin-bench: {runner.name} failed: {result.errors[runner.name]}", file=sys.stderr)
                        result.add(runner.name, context, None)
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
