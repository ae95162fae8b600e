"""Time to first token and decode speed while other processes keep cores busy: 0, 1 and 2 spinning processes on
the machine, under each thread policy of the reference engine.

Each (busy, policy) cell is one worker process: a dialogue session with a system prompt, then turns of 64
user-message tokens (each new, so each turn prefills them) and 32 greedy tokens (no stop token); the first turn
warms up and is dropped, the cell reports the median TTFT and decode tok/s of the rest. A busy process is
``python -c "while True: pass"``. Cells run busy level by busy level, the policies interleaved, over ``--rounds``
rounds; a cell's figure is the median over rounds. Policies: ``2`` threads (torch's default on 2 cores: the
engine before ``--threads auto``), ``2`` with ``OMP_WAIT_POLICY=PASSIVE`` (its threads sleep instead of spin at a
barrier), ``1`` thread, and ``auto`` (cabinllm.runtime.model.threads).

    python -m cabinllm.benchmarks.studies.busy_cpu --engine engines/smollm2-135m-int8-eq
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int, thread_count
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.model.threads import CPU_THREADS

POLICIES = {"2 threads": ("2", {}), "2 threads, passive wait": ("2", {"OMP_WAIT_POLICY": "PASSIVE"}),
            "1 thread": ("1", {}), "auto": ("auto", {})}
BEFORE, AFTER = "2 threads", "auto"
SPIN = "while True: pass"
SYSTEM = "You are the assistant of a car. Keep answers short and safe to hear while driving."
PASSAGE = ("The driver asks about the range left on the battery, the charging stations along the motorway, the "
           "weather at the destination, the music for the children in the back, the temperature of the seats, the "
           "next service of the car, the traffic ahead, the tyre pressure warning that came on this morning, the "
           "best place to stop for lunch, and how long the whole trip will take with two charging stops.").split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.busy_cpu",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--turns", type=positive_int, default=6, help="turns per cell, the first dropped")
    parser.add_argument("--prompt-tokens", type=positive_int, default=64, help="tokens of each user message")
    parser.add_argument("--decode-tokens", type=positive_int, default=32, help="tokens of each reply")
    parser.add_argument("--rounds", type=positive_int, default=2, help="rounds over every cell")
    parser.add_argument("--max-busy", type=int, default=2, help="busy processes of the last level")
    parser.add_argument("--output", type=Path, default=RESULTS / "busy_cpu", help="results path, without suffix")
    parser.add_argument("--worker", type=thread_count, help=argparse.SUPPRESS)  # one cell, in its own process
    return parser.parse_args(argv)


def user_turns(engine: Engine, count: int, tokens: int) -> list[str]:
    """``count`` different user messages of ``tokens`` tokens each."""
    messages = []
    for turn in range(count):
        words = PASSAGE[turn % len(PASSAGE):] + PASSAGE[:turn % len(PASSAGE)]
        ids = engine.tokenizer.encode(" ".join(words * 4))[:tokens]
        messages.append(engine.tokenizer.decode(ids))
    return messages


def run_cell(args: argparse.Namespace) -> dict:
    """One cell in this process: median TTFT (s) and decode tok/s of the turns after the first."""
    CPU_THREADS.use(args.worker)
    engine = Engine.load(args.engine)
    cache = engine.new_cache()
    params = SamplingParams(max_new_tokens=args.decode_tokens, temperature=0.0, stop_token_ids=[])
    session = DialogueSession(engine, cache, params, SYSTEM)
    turns = [session.chat(text) for text in user_turns(engine, args.turns, args.prompt_tokens)][1:]
    return {"ttft_s": statistics.median(t.ttft_s for t in turns),
            "decode_tok_s": statistics.median(t.decode_tok_s for t in turns),
            "prefill_tokens": statistics.median(t.prefill_tokens for t in turns)}


def cell(args: argparse.Namespace, policy: str) -> dict:
    """One cell in a fresh worker process."""
    threads, env = POLICIES[policy]
    command = [sys.executable, "-m", "cabinllm.benchmarks.studies.busy_cpu", "--engine", str(args.engine),
               "--turns", str(args.turns), "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens",
               str(args.decode_tokens), "--worker", threads]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"busy_cpu: the {policy} worker failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict:
    """Every cell over every round: {busy: {policy: [cell per round]}}."""
    cells: dict[int, dict[str, list[dict]]] = {b: {p: [] for p in POLICIES} for b in range(args.max_busy + 1)}
    loads = []
    with tqdm(total=args.rounds * len(cells) * len(POLICIES), desc="cells", unit="cell") as bar:
        for _ in range(args.rounds):
            for busy in cells:
                spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
                try:
                    time.sleep(1.0)
                    for policy in POLICIES:
                        cells[busy][policy].append(cell(args, policy))
                        bar.update()
                    loads.append(os.getloadavg()[0])
                finally:
                    for spinner in spinners:
                        spinner.kill()
                        spinner.wait()
                time.sleep(1.0)
    return {"cells": cells, "load_1m_seen": loads}


def summary(cells: dict[int, dict[str, list[dict]]]) -> dict:
    """Median over rounds of each cell, and each policy's slowdown against the quiet machine's best TTFT."""
    medians = {busy: {policy: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
                      for policy, rounds in by_policy.items()} for busy, by_policy in cells.items()}
    quiet = medians[0]
    for by_policy in medians.values():
        for policy, figures in by_policy.items():
            figures["ttft_vs_quiet"] = figures["ttft_s"] / quiet[policy]["ttft_s"]
            figures["decode_vs_quiet"] = figures["decode_tok_s"] / quiet[policy]["decode_tok_s"]
    return medians


def table(medians: dict, args: argparse.Namespace, loads: list[float]) -> str:
    """Markdown: TTFT and decode per busy level and policy, with ratios to the same policy on a quiet machine."""
    lines = [f"# TTFT and decode with busy cores ({args.engine.name}, {args.prompt_tokens}-token turns, "
             f"{args.decode_tokens} greedy tokens)", "",
             f"Median of {args.turns - 1} turns per cell, median of {args.rounds} rounds; load average seen "
             f"{min(loads):.2f}-{max(loads):.2f} (the spinners included). `before` = {BEFORE} (torch's default), "
             f"`after` = {AFTER}.", "",
             "| busy processes | policy | TTFT ms | TTFT vs quiet | decode tok/s | decode vs quiet |",
             "|---|---|---|---|---|---|"]
    for busy, by_policy in medians.items():
        for policy, f in by_policy.items():
            tag = " (before)" if policy == BEFORE else " (after)" if policy == AFTER else ""
            lines.append(f"| {busy} | {policy}{tag} | {f['ttft_s'] * 1000:.0f} | {f['ttft_vs_quiet']:.2f}x | "
                         f"{f['decode_tok_s']:.1f} | {f['decode_vs_quiet']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the study (or, with --worker, one cell) and write its results."""
    args = parse_args(argv)
    if not (args.engine / "manifest.json").is_file():
        print(f"busy_cpu: {args.engine} is no engine folder; build one with cabin-build", file=sys.stderr)
        return 2
    if args.worker is not None:
        print(json.dumps(run_cell(args)))
        return 0
    machine = machine_info()
    measured = measure(args)
    medians = summary(measured["cells"])
    command = " ".join(["python -m cabinllm.benchmarks.studies.busy_cpu", *(argv or sys.argv[1:])])
    result = {"machine": machine, "command": command, "turns": args.turns, "rounds": args.rounds,
              "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
              "load_1m_seen": measured["load_1m_seen"], "medians": medians, "cells": measured["cells"]}
    write_results(args.output, result, table(medians, args, measured["load_1m_seen"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
