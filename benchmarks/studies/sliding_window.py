"""KV memory of Gemma 3's sliding-window layers over a long dialogue: the blocks hold the global layers' tokens,
the window pool only the local layers' windows (cabinllm.runtime.kv.window).

A random-weight model with a Hub config's KV shape (default: Gemma-3-4B-it's text model: 34 layers, 29 of them
local over 1,024 tokens, 4 KV heads of 256) and small hidden and MLP sizes, so the KV cache is the real one and
the run takes seconds; random weights prove mechanics, not answers. The dialogue is ``--turns`` turns of
``--user-tokens`` random tokens and ``--reply-tokens`` greedy ones, in one sequence as a session keeps it. At the
end a new sequence with the same tokens shows what reuse finds again, and that its next logits equal the first's.

    python -m cabinllm.benchmarks.studies.sliding_window
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.runtime.formats.checkpoint import expected_shapes
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import DEFAULT_TOKENS_PER_BLOCK, KvCacheConfig, PagedKVCache
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.hf_names import config_from_hf

CONFIGS = Path(__file__).resolve().parents[2] / "builders" / "data" / "model_configs"
MIB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.sliding_window",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIGS / "gemma-3-4b-it.json",
                        help="HF config.json whose KV shape (layers, KV heads, head size, window) the model takes")
    parser.add_argument("--kv-cache", default="fp16", choices=("fp32", "fp16"), help="KV mode")
    parser.add_argument("--turns", type=positive_int, default=40, help="dialogue turns")
    parser.add_argument("--user-tokens", type=positive_int, default=60, help="tokens of each user message")
    parser.add_argument("--reply-tokens", type=positive_int, default=40, help="greedy tokens of each reply")
    parser.add_argument("--kv-budget-mb", type=float, default=256.0, help="KV budget")
    parser.add_argument("--output", type=Path, default=RESULTS / "sliding_window", help="results path, no suffix")
    return parser.parse_args(argv)


def random_model(config_path: Path) -> Transformer:
    """The config's model with hidden 64, MLP 128 and a 1,024-token vocabulary, random weights (norms at 1)."""
    data = json.loads(config_path.read_text(encoding="utf-8"))
    data = {**data, "text_config": {**data.get("text_config", {}), "hidden_size": 64, "intermediate_size": 128,
                                    "vocab_size": 1024}} if "text_config" in data else \
        {**data, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 1024}
    config = config_from_hf(data, str(config_path))
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.05
               for name, shape in expected_shapes(config).items()}
    return Transformer(config, weights)


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    CPU_THREADS.use(1)
    model = random_model(args.config)
    layout = model.kv_layout
    cache = PagedKVCache(layout, KvCacheConfig(args.kv_cache, int(args.kv_budget_mb * MIB), DEFAULT_TOKENS_PER_BLOCK))
    plan = cache.storage.plan
    per_layer = cache.bytes_per_token() // len(plan.global_layers)  # one layer's K and V of one token
    gen = torch.Generator().manual_seed(1)
    seq, rows = Sequence(), []
    for turn in range(args.turns):
        user = torch.randint(0, model.config.vocab_size, (args.user_tokens,), generator=gen).tolist()
        (cache.append if seq else cache.allocate)(seq, user)
        logits = model.forward(user, len(seq) - len(user), cache, seq)
        for _ in range(args.reply_tokens):
            token = int(logits.argmax())
            cache.append(seq, [token])
            logits = model.forward([token], len(seq) - 1, cache, seq)
        stats = cache.stats()
        blocks_bytes = stats.blocks_in_use * cache.bytes_per_block
        rows.append({"turn": turn + 1, "tokens": len(seq), "blocks_bytes": blocks_bytes,
                     "window_bytes": stats.bytes_used - blocks_bytes,
                     "all_layers_bytes": len(seq) * layout.num_layers * per_layer})
    tokens = list(seq.token_ids)
    again = Sequence()
    reused = cache.blocks.blocks_to_admit(tokens + [0], 0)[1]  # what the prefix cache holds of the global layers
    cache.free(seq)
    found = cache.allocate(again, tokens + [0])
    fresh = model.forward((tokens + [0])[found:], found, cache, again)
    cache.free(again)
    check = PagedKVCache(layout, KvCacheConfig(args.kv_cache, int(args.kv_budget_mb * MIB), DEFAULT_TOKENS_PER_BLOCK))
    alone = Sequence()
    check.allocate(alone, tokens + [0])
    recomputed = model.forward(tokens + [0], 0, check, alone)
    last = rows[-1]
    result = {"machine": machine_info(), "command": " ".join(["python -m cabinllm.benchmarks.studies.sliding_window",
                                                               *(argv or sys.argv[1:])]),
              "config": args.config.name, "kv_cache": args.kv_cache, "window": plan.window,
              "global_layers": len(plan.global_layers), "local_layers": len(plan.local_layers),
              "bytes_per_token_per_layer": per_layer, "turns": rows,
              "reuse": {"tokens": len(tokens), "global_prefix_cached": reused, "reused": found,
                        "max_abs_logit_diff_vs_recompute": float((fresh - recomputed).abs().max())}}
    marks = sorted({min(range(len(rows)), key=lambda i: abs(rows[i]["tokens"] - t)) for t in (500, 1000, 2000, 4000)})
    table = "\n".join([
        f"# Sliding-window layers over a {last['tokens']:,}-token dialogue ({args.config.name} KV shape, random "
        f"weights, {args.kv_cache} KV)", "",
        f"{len(plan.global_layers)} global layers keep every token, {len(plan.local_layers)} local ones a window of "
        f"{plan.window:,}; {per_layer:,} bytes per token per layer; load average "
        f"{result['machine']['load_average_1m']:.2f}.", "",
        "| tokens | blocks (global layers) MiB | window pool in use MiB | total MiB | every layer every token MiB | "
        "ratio |", "|---|---|---|---|---|---|",
        *(f"| {r['tokens']:,} | {r['blocks_bytes'] / MIB:.1f} | {r['window_bytes'] / MIB:.1f} | "
          f"{(r['blocks_bytes'] + r['window_bytes']) / MIB:.1f} | {r['all_layers_bytes'] / MIB:.1f} | "
          f"{(r['blocks_bytes'] + r['window_bytes']) / r['all_layers_bytes']:.2f}x |"
          for r in (rows[i] for i in marks)),
        "", f"A new sequence with the same {len(tokens):,} tokens: the blocks still hold {reused:,} of them, it reused "
            f"{found:,} (the window pool holds the last window); its next logits differ from recomputing all by "
            f"{result['reuse']['max_abs_logit_diff_vs_recompute']:.1e}.", ""])
    write_results(args.output, result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
