"""Why one sequence's decode speed swings between runs on a shared machine: each round times an engine's decode
steps at a fixed context (on --threads threads), then the cores' arithmetic rate (the probe: the engine's own MLP
down projection, whose weights stay in L2, so no memory read bounds it), then the read bandwidth on as many threads.
A step's bytes (weights as held plus the context's KV) over its time, against the run's best read, is its fraction
of the bandwidth. Rounds whose probe ran slow are those in which another process on the cores' execution units, not
memory, bound the step.

    python -m cabinllm.benchmarks.studies.decode_limit --engine engines/smollm2-int4-g32
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cabinllm.benchmarks.machine import machine_info, read_bandwidth
from cabinllm.benchmarks.runners.cabin import step_weight_bytes
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import greedy
from cabinllm.runtime.kernels.bindings import matvec
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.kv.modes import bytes_per_token
from cabinllm.runtime.model.linear import linear
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.model.transformer import Transformer

PROBE_CALLS = 200  # calls of the down projection per probe
BANDWIDTH_REPEATS = 2  # reads of the 1 GiB buffer per round (the best counts)
FAST_PROBE = 1.25  # rounds whose probe took at most this times the fastest one's: the core to itself


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.decode_limit",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--context", type=positive_int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=positive_int, default=64, help="decode steps per round")
    parser.add_argument("--rounds", type=positive_int, default=15, help="rounds of steps then probe")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads of the steps, probe and read")
    parser.add_argument("--output", type=Path, default=None,
                        help="results path, no suffix (default: benchmarks/results/decode_limit_<engine>, with "
                             "_<N>threads after it on N > 1 threads)")
    return parser.parse_args(argv)


def decode_ms(engine: Engine, cache: PagedKVCache, prompt_seq: Sequence, token: int, steps: int) -> float:
    """Milliseconds per greedy decode step of a fork of the prompt's sequence (freed after: each round starts
    from the same context)."""
    seq = Sequence()
    cache.fork(prompt_seq, seq)
    start = time.perf_counter()
    for _ in range(steps):
        cache.append(seq, [token])
        token = greedy(engine.model.forward([token], len(seq) - 1, cache, seq))
    elapsed = time.perf_counter() - start
    cache.free(seq)
    return elapsed / steps * 1e3


def probe_us(engine: Engine) -> float:
    """Microseconds per call of the first layer's MLP down projection on one token (its weights in L2)."""
    op, mv = engine.model.layers[0]["proj"], matvec()
    x = torch.randn(1, engine.config.intermediate_size)
    linear(x, op, mv)
    start = time.perf_counter()
    for _ in range(PROBE_CALLS):
        linear(x, op, mv)
    return (time.perf_counter() - start) / PROBE_CALLS * 1e6


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    if not (args.engine / "manifest.json").is_file():
        print(f"decode_limit: {args.engine} is no engine folder; build one with cabin-build", file=sys.stderr)
        return 2
    CPU_THREADS.use(args.threads)
    engine = Engine.load(args.engine)
    if not isinstance(engine.model, Transformer):
        print(f"decode_limit: {args.engine} does not run on the reference engine", file=sys.stderr)
        return 2
    mode = engine.default_kv_mode
    cache, seq = engine.new_cache(max_sequences=2), Sequence()
    low = min(100, engine.config.vocab_size // 4)  # clear of the special tokens at the ends of the vocabulary
    prompt = torch.randint(low, engine.config.vocab_size - low, (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    cache.allocate(seq, prompt)
    token = greedy(engine.model.forward(prompt, 0, cache, seq))
    read = step_weight_bytes(engine.model) + args.context * bytes_per_token(engine.model.kv_layout, mode,
                                                                             cache.tokens_per_block)
    decode_ms(engine, cache, seq, token, args.steps)  # warm-up
    rounds = []
    for _ in tqdm(range(args.rounds), desc="decode_limit", unit="round"):
        step = decode_ms(engine, cache, seq, token, args.steps)
        rounds.append({"step_ms": step, "probe_us": probe_us(engine),
                       "read_bandwidth_bytes_s": read_bandwidth(args.threads, BANDWIDTH_REPEATS)})
    bandwidth = max(r["read_bandwidth_bytes_s"] for r in rounds)  # the run's ceiling
    for r in rounds:
        r["fraction"] = read / (r["step_ms"] / 1e3) / bandwidth
    fastest = min(r["probe_us"] for r in rounds)
    groups = {f"probe within {FAST_PROBE:.2f}x the fastest": [r for r in rounds if r["probe_us"] <= FAST_PROBE * fastest],
              "slower probe": [r for r in rounds if r["probe_us"] > FAST_PROBE * fastest]}
    summary = {name: {"rounds": len(rs), "probe_us": statistics.median(r["probe_us"] for r in rs),
                      "fraction": statistics.median(r["fraction"] for r in rs)} for name, rs in groups.items() if rs}
    result = {"machine": machine_info(), "command": " ".join(["python -m cabinllm.benchmarks.studies.decode_limit",
                                                               *(argv if argv is not None else sys.argv[1:])]),
              "engine": args.engine.name, "kv_mode": mode, "context": args.context, "steps": args.steps,
              "threads": args.threads,
              "bytes_per_token": read, "read_bandwidth_bytes_s": bandwidth, "rounds": rounds,
              "median_fraction": statistics.median(r["fraction"] for r in rounds), "by_probe": summary}
    table = "\n".join([
        f"# Decode at the memory limit, round by round ({args.engine.name}, {mode} KV, {args.context} tokens of "
        f"context, {args.steps} steps per round, {args.threads} thread{'s' if args.threads > 1 else ''})", "",
        f"Load average {result['machine']['load_average_1m']:.2f}; {read / 1e6:.1f} MB read per step. Each round: "
        f"{args.steps} decode steps, then the probe ({PROBE_CALLS} calls of the down projection), then the read "
        f"bandwidth (a 1 GiB buffer summed, best of {BANDWIDTH_REPEATS}). Fractions are taken against the best "
        f"read of the run, {bandwidth / 1e9:.1f} GB/s.", "",
        "| round | ms per step | probe µs | read GB/s | fraction of the bandwidth |", "|---|---|---|---|---|",
        *(f"| {i + 1} | {r['step_ms']:.2f} | {r['probe_us']:.1f} | {r['read_bandwidth_bytes_s'] / 1e9:.1f} | "
          f"{r['fraction']:.2f} |" for i, r in enumerate(rounds)),
        f"| median | {statistics.median(r['step_ms'] for r in rounds):.2f} | "
        f"{statistics.median(r['probe_us'] for r in rounds):.1f} | "
        f"{statistics.median(r['read_bandwidth_bytes_s'] for r in rounds) / 1e9:.1f} | "
        f"{result['median_fraction']:.2f} |", "",
        "| rounds | count | probe µs (median) | fraction (median) |", "|---|---|---|---|",
        *(f"| {name} | {s['rounds']} | {s['probe_us']:.1f} | {s['fraction']:.2f} |" for name, s in summary.items()),
        ""])
    threads = f"_{args.threads}threads" if args.threads > 1 else ""
    write_results(args.output or RESULTS / f"decode_limit_{args.engine.name}{threads}", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
