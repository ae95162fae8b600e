"""What the fused one-call decode step (runtime/kernels/decode_step.c) is worth: decode speed of an engine with it
and on the per-layer path a model it does not take runs on (Gemma 3), same weights, same cache; and the time of a
step of several sequences (the server's batched step) as one fused call, on the per-layer path, and as one fused
step per sequence. Greedy, no stop token, one thread, seeded random prompt tokens; medians of interleaved repeats.

    python -m cabinllm.benchmarks.studies.fused_step --engine engines/smollm2-int8
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.engine.core import EngineCore
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.model.interface import Span

PATHS = ("fused", "per-layer")
BATCHED_PATHS = ("fused, one call", "per-layer", "fused, one call per sequence")
ALONE = "one sequence alone, fused"  # the batched step's baseline, timed the same way


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.fused_step",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--context", type=positive_int, default=512, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=positive_int, default=64, help="tokens decoded")
    parser.add_argument("--sequences", type=positive_int, default=4, help="sequences of the batched step")
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of each path")
    parser.add_argument("--output", type=Path, default=RESULTS / "fused_step", help="results path, no suffix")
    return parser.parse_args(argv)


@contextlib.contextmanager
def fused_step(engine: Engine, fused: bool):
    """The engine's model with the fused step on, or off (its weights emptied: what a model the step does not
    take)."""
    model = engine.model
    model.__dict__.pop("_step_weights", None)
    if not fused:
        model.__dict__["_step_weights"] = None
    try:
        yield model
    finally:
        model.__dict__.pop("_step_weights", None)


def decode_speed(engine: Engine, prompt: list[int], new_tokens: int, fused: bool) -> float:
    """Decode tokens/s after the prompt, on the fused step or with it switched off."""
    with fused_step(engine, fused) as model:
        core = EngineCore(model, engine.new_cache(), engine.tokenizer.decode_reply,
                          SchedulerConfig(prefill_chunk=len(prompt)))
        result = core.generate(Request(prompt, SamplingParams(new_tokens, stop_token_ids=[])))
    return result.decode_tok_s


def batched_step_ms(engine: Engine, prompts: list[list[int]], steps: int, path: str) -> float:
    """Milliseconds per greedy decode step of the prompts' sequences together, on one of ``BATCHED_PATHS``."""
    with fused_step(engine, path != "per-layer") as model:
        cache = engine.new_cache(max_sequences=len(prompts))
        seqs = [Sequence() for _ in prompts]
        tokens = []
        for seq, prompt in zip(seqs, prompts):
            cache.allocate(seq, prompt)
            tokens.append(int(model.forward(prompt, 0, cache, seq).argmax()))
        start = time.perf_counter()
        for _ in range(steps):
            spans = []
            for seq, token in zip(seqs, tokens):
                cache.append(seq, [token])
                spans.append(Span([token], len(seq) - 1, seq))
            if path == "fused, one call per sequence":
                logits = torch.cat([model.step([span], cache) for span in spans])
            else:
                logits = model.step(spans, cache)
            tokens = logits.argmax(-1).tolist()
        return (time.perf_counter() - start) / steps * 1e3


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
    prompts = [torch.randint(100, engine.config.vocab_size - 100, (args.context,),
                             generator=torch.Generator().manual_seed(seed)).tolist() for seed in range(args.sequences)]
    batched: dict[str, list[float]] = {path: [] for path in (ALONE, *BATCHED_PATHS)}
    for _ in range(args.repeats):
        batched[ALONE].append(batched_step_ms(engine, prompts[:1], args.new_tokens, "fused, one call"))
        for path in BATCHED_PATHS:
            batched[path].append(batched_step_ms(engine, prompts, args.new_tokens, path))
    step_ms = {path: statistics.median(values) for path, values in batched.items()}
    alone_ms = step_ms.pop(ALONE)
    result = {"machine": machine_info(), "command": " ".join(["python -m cabinllm.benchmarks.studies.fused_step",
                                                               *(argv or sys.argv[1:])]),
              "kv_mode": engine.default_kv_mode, "medians_tok_s": medians, "per_layer_over_fused": ratio,
              "runs": runs, "sequences": args.sequences, "batched_step_ms": step_ms, "batched_runs": batched,
              "one_sequence_step_ms": alone_ms}
    table = "\n".join([
        f"# Decode on the fused step and on the per-layer path ({args.engine.name}, {engine.default_kv_mode} KV, "
        f"{args.context} tokens of context, {args.new_tokens} greedy tokens, 1 thread, median of {args.repeats})", "",
        f"Load average {result['machine']['load_average_1m']:.2f}.", "",
        "| path | decode tok/s |", "|---|---|",
        *(f"| {path} | {medians[path]:.1f} |" for path in PATHS),
        "", f"Per-layer / fused: {ratio:.2f}x.", "",
        f"A step of {args.sequences} sequences of {args.context} tokens each (median of {args.repeats} runs of "
        f"{args.new_tokens} steps); tokens/s is the sequences' aggregate, against one sequence's fused step "
        f"({alone_ms:.1f} ms):", "",
        "| batched step | ms per step | tokens/s | / one sequence |", "|---|---|---|---|",
        *(f"| {path} | {ms:.1f} | {1e3 * args.sequences / ms:.1f} | {alone_ms * args.sequences / ms:.2f}x |"
          for path, ms in step_ms.items()), ""])
    write_results(args.output, result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
