"""What the fused one-call decode step (runtime/kernels/decode_step.c) is worth: decode speed of an engine with it
and on the per-layer path a model it does not take runs on (Gemma 3), same weights, same cache. Greedy, no stop
token, one thread, seeded random prompt tokens; medians of interleaved repeats.

    python -m cabinllm.benchmarks.studies.fused_step --engine engines/smollm2-int8
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.runtime.engine import Engine
from cabinllm.runtime.generation.generate import generate
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.model.threads import CPU_THREADS

PATHS = ("fused", "per-layer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.fused_step",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--context", type=positive_int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="tokens decoded")
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of each path")
    parser.add_argument("--output", type=Path, default=RESULTS / "fused_step", help="results path, no suffix")
    return parser.parse_args(argv)


def decode_speed(engine: Engine, prompt: list[int], new_tokens: int, fused: bool) -> float:
    """Decode tokens/s after the prompt, on the fused step or with it switched off."""
    model = engine.model
    model.__dict__.pop("_step_weights", None)
    if not fused:
        model.__dict__["_step_weights"] = None  # the cached property emptied: what a model the step does not take
    try:
        result = generate(model, engine.new_cache(), Sequence(), prompt, SamplingParams(new_tokens, stop_token_ids=[]),
                          lambda ids: "")
    finally:
        model.__dict__.pop("_step_weights", None)
    return result.decode_tok_s


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    if not (args.engine / "manifest.json").is_file():
        print(f"fused_step: {args.engine} is no engine folder; build one with cabin-build", file=sys.stderr)
        return 2
    CPU_THREADS.use(1)
    engine = Engine.load(args.engine)
    if engine.model._step_weights is None:
        print(f"fused_step: {args.engine}'s model does not take the fused step; give a Llama-shaped one",
              file=sys.stderr)
        return 2
    prompt = torch.randint(100, engine.config.vocab_size - 100, (args.context,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    runs: dict[str, list[float]] = {path: [] for path in PATHS}
    decode_speed(engine, prompt, args.new_tokens, True)  # warm-up
    for _ in range(args.repeats):
        for path in PATHS:
            runs[path].append(decode_speed(engine, prompt, args.new_tokens, path == "fused"))
    medians = {path: statistics.median(values) for path, values in runs.items()}
    ratio = medians["per-layer"] / medians["fused"]
    result = {"machine": machine_info(), "command": " ".join(["python -m cabinllm.benchmarks.studies.fused_step",
                                                               *(argv or sys.argv[1:])]),
              "kv_mode": engine.default_kv_mode, "medians_tok_s": medians, "per_layer_over_fused": ratio,
              "runs": runs}
    table = "\n".join([
        f"# Decode on the fused step and on the per-layer path ({args.engine.name}, {engine.default_kv_mode} KV, "
        f"{args.context} tokens of context, {args.new_tokens} greedy tokens, 1 thread, median of {args.repeats})", "",
        f"Load average {result['machine']['load_average_1m']:.2f}.", "",
        "| path | decode tok/s |", "|---|---|",
        *(f"| {path} | {medians[path]:.1f} |" for path in PATHS),
        "", f"Per-layer / fused: {ratio:.2f}x.", ""])
    write_results(args.output, result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
