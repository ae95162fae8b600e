"""The ONNX Runtime backend beside the reference engine (and onnxruntime-genai where its model folder is given):
teacher-forced perplexity in the same KV mode on held-out dialogues, decode speed with a full window, KV bytes
per token. One JSON object on stdout.

Perplexity twice for the backend: on its own (the prompt graph over the K/V it stored itself) and over the
reference's cache (each token through the token graph over the K/V the reference engine stored for the tokens
before it). With INT8 KV the first compares two runs that each round their own K/V: a float difference of a few
ulps puts an occasional element on the other side of a rounding edge, and that code spreads through the later
layers and tokens, so each dialogue's perplexity moves by tenths of a percent either way; the reference engine
prefilled in the graphs' chunks instead of at once shows that spread without the graphs. The second shares the
stored codes and compares the arithmetic of the graphs with the reference's.

    python -m cabinllm.benchmarks.studies.onnx_compare --engine ENGINE --onnx GRAPHS [--genai GENAI_MODEL_DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from cabinllm.benchmarks.runners.base import Unavailable
from cabinllm.benchmarks.runners.cabin import cabin_runner
from cabinllm.benchmarks.runners.onnx import GENAI, genai_kv_bytes_per_token, genai_runner, onnx_runner
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.cli.args import positive_int
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.run_tokens import run_tokens

# the perplexity runs: the reference engine at once (the base), the reference in the graphs' chunks, the ONNX
# backend on its own, the ONNX backend's token graph over the reference's stored cache
RUNS = ("reference", "reference_in_chunks", "onnxruntime", "onnxruntime_over_reference_cache")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder (cabin-build)")
    parser.add_argument("--onnx", required=True, type=Path, help="graph folder exported from it (cabin-export)")
    parser.add_argument("--genai", type=Path, help="onnxruntime-genai model folder of the same model (its builder)")
    parser.add_argument("--data", default="sharegpt", help="held-out dialogues: builtin, sharegpt or a file")
    parser.add_argument("--num-dialogues", type=positive_int, default=4, help="dialogues for perplexity")
    parser.add_argument("--max-tokens", type=positive_int, default=1024, help="tokens per dialogue at most")
    parser.add_argument("--decode-tokens", type=positive_int, default=32, help="tokens decoded per speed run")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="speed runs per backend, interleaved; the median is reported")
    parser.add_argument("--skip-perplexity", action="store_true", help="measure speed and bytes only")
    parser.add_argument("--skip-speed", action="store_true", help="measure perplexity and bytes only")
    return parser.parse_args(argv)


def perplexities(reference: Engine, ours: Engine, kv: str, ids_list: list[list[int]]) -> dict:
    """Teacher-forced perplexity over the dialogues, K/V stored in mode ``kv``: the reference engine's (at once, and
    in the graphs' chunks), the ONNX backend's on its own and over the reference's cache, each with its delta to the
    reference's, in total and per dialogue."""
    chunk = ours.model.chunk
    nll: dict[str, list[float]] = {name: [] for name in RUNS}
    for ids in tqdm(ids_list, desc="perplexity", file=sys.stderr):
        prefilled = run_tokens(reference.model, ids, kv, reference.scales, all_logits=True)
        in_chunks = run_tokens(reference.model, ids, kv, reference.scales, all_logits=True, chunk=chunk)
        nll["reference"].append(_nll(prefilled.logits, ids))
        nll["reference_in_chunks"].append(_nll(in_chunks.logits, ids))
        nll["onnxruntime"].append(_nll(run_tokens(ours.model, ids, kv, ours.scales, all_logits=True).logits, ids))
        nll["onnxruntime_over_reference_cache"].append(
            _nll(ours.model.logits_over(prefilled.cache, prefilled.seq), ids))
    tokens = [len(ids) - 1 for ids in ids_list]
    base = math.exp(sum(nll["reference"]) / sum(tokens))
    result: dict = {"reference": base}
    for name in RUNS[1:]:
        ppl = math.exp(sum(nll[name]) / sum(tokens))
        result[name] = {"perplexity": ppl, "delta_percent": 100 * (ppl / base - 1),
                        "delta_percent_by_dialogue": [100 * (math.exp((value - ref) / n) - 1) for value, ref, n
                                                      in zip(nll[name], nll["reference"], tokens)]}
    return {**result, "chunk": chunk, "dialogues": len(ids_list), "tokens": sum(len(ids) for ids in ids_list)}


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Summed negative log-likelihood of each next token of ``ids`` under the logits of the one before it."""
    targets = torch.tensor(ids[1:])
    return -float(logits[:-1].log_softmax(-1).gather(1, targets[:, None]).sum())


def decode_speeds(args: argparse.Namespace, reference: Engine, ours: Engine, kv: str, context: int) -> dict:
    """Greedy decode tokens per second of each backend with a full window: the median of the interleaved rounds,
    and every round."""
    prompt = [(7 * i) % 1000 + 100 for i in range(context - args.decode_tokens - 1)]
    runners = {"reference": cabin_runner(reference, kv), "onnxruntime": onnx_runner(ours)}
    if args.genai:
        genai = genai_runner(args.genai, torch.get_num_threads())
        if isinstance(genai, Unavailable):
            raise SystemExit(f"onnx_compare: error: {genai.reason}")
        runners[GENAI] = genai
    speeds: dict[str, list[float]] = {name: [] for name in runners}
    for _ in tqdm(range(args.rounds), desc="decode speed", file=sys.stderr):
        for name, runner in runners.items():
            speeds[name].append(runner.run(prompt, args.decode_tokens).decode_tok_s)
    return {"decode_tok_s": {name: statistics.median(values) for name, values in speeds.items()},
            "decode_tok_s_runs": speeds}


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread for every backend (onnxruntime sessions take torch's count)
    reference, ours = Engine.load(args.engine), load_onnx_engine(args.onnx)
    kv = ours.default_kv_mode
    context = ours.config.max_position_embeddings
    layout = ours.model.kv_layout
    result = {"kv_cache": kv, "context": context, "threads": torch.get_num_threads(),
              "load_average": os.getloadavg(),
              "kv_bytes_per_token": {"cabin": ours.kv_cache_config(KvCacheConfig(kv)).bytes_per_token(layout)}}
    if not args.skip_perplexity:
        dialogues, _ = prepare_dialogues(args.data, "heldout", args.num_dialogues, 0, reference.tokenizer,
                                         min(args.max_tokens, context))
        result["perplexity"] = perplexities(reference, ours, kv, [d.token_ids for d in dialogues])
    if args.genai:
        result["kv_bytes_per_token"][GENAI] = genai_kv_bytes_per_token(args.genai)
    if not args.skip_speed:
        result.update(decode_speeds(args, reference, ours, kv, context))
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
