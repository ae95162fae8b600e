"""Decode and prefill speed of the reference engine per KV mode, beside transformers' generate.

Usage: python -m benchmarks.decode_speed --engine DIR [--contexts 256 2048] [--repeats 5] [--json FILE]

Every figure is a median over repeats, measured in one run on the same weights
(the engine's checkpoint upcast to fp32 for both) and the same prompt tokens.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from builders.hf_export import to_transformers
from runtime.engine import CHECKPOINT_DIR, Engine
from runtime.generate import generate
from runtime.sampling import SamplingParams

DECODE_STEPS = 16


def prompt_of_length(engine: Engine, length: int) -> list[int]:
    """Chat-formatted token ids of exactly ``length`` tokens."""
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "You are the in-car assistant."}]
    ids: list[int] = []
    while len(ids) < length:
        messages.append({"role": "user", "content": "Explain how lane keeping assist works and when it turns off."})
        messages.append({"role": "assistant", "content": "It steers gently to keep the car centred and hands "
                                                         "control back when the lane markings fade."})
        ids = tok.encode(tok.render(messages))
    return ids[:length]


def ours(engine: Engine, mode: str, prompt: list[int]) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one run of our engine."""
    cache = engine.new_cache(mode, engine.model.kv_layout.bytes_per_token(mode) * (len(prompt) + 64))
    params = SamplingParams(max_new_tokens=DECODE_STEPS + 1, stop_token_ids=[])
    result = generate(engine.model, cache, 0, prompt, params, engine.tokenizer.decode_reply)
    return len(prompt) / result.ttft_s, result.decode_tok_s


def transformers_generate(model, prompt: list[int]) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of transformers' generate with its default dynamic cache."""
    ids = torch.tensor([prompt])
    timings = []
    for new in (1, DECODE_STEPS + 1):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        timings.append(time.perf_counter() - start)
    return len(prompt) / timings[0], DECODE_STEPS / (timings[1] - timings[0])


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison, print a table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--modes", nargs="+", default=["fp16", "int8", "int8-dynamic"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)
    engine = Engine.load(args.engine)
    hf = to_transformers(engine.folder / CHECKPOINT_DIR)
    runners = {f"cabin {m}": (lambda p, m=m: ours(engine, m, p)) for m in args.modes}
    runners["transformers generate"] = lambda p: transformers_generate(hf, p)
    rows = []
    for context in args.contexts:
        prompt = prompt_of_length(engine, context)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():  # interleaved so load changes hit every runner alike
                samples[name].append(run(prompt))
        base = statistics.median(s[1] for s in samples["transformers generate"])
        for name, runs in samples.items():
            decode = statistics.median(r[1] for r in runs)
            rows.append({"runner": name, "context": context, "prefill_tok_s": statistics.median(r[0] for r in runs),
                         "decode_tok_s": decode, "decode_vs_transformers": decode / base})
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__}, "repeats": args.repeats, "decode_steps": DECODE_STEPS,
              "rows": rows}
    print(f"{'runner':24} {'context':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'vs HF':>6}")
    for r in rows:
        print(f"{r['runner']:24} {r['context']:>7} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.2f} "
              f"{r['decode_vs_transformers']:>6.2f}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
    return result


if __name__ == "__main__":
    main()
