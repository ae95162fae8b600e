"""The CUDA runner on a GPU at real model shapes with random weights: decode tok/s with fp16 and int8 KV at several
contexts, eager and replayed from CUDA graphs, prefill tok/s, and peak GPU memory against the planner's memory model.

Run by ``scripts/gpu_check.sh`` (which runs the GPU tests first); nothing is downloaded: the shapes are config files
in ``builders/data/model_configs`` (the default model's checkpoint config, Qwen3-1.7B's and Llama-3.2-3B's HF
``config.json``), the weights are drawn on the device. Random weights measure speed and memory, never quality; the
int8 KV's static scale is a fixed guess for the same reason.

The memory plan of a run is the planner's model (``cabinllm.builders.memory_model``): fp16 weights, plus the KV pool
the cache reserved, plus the activations of the largest step (the CUDA runner's: fp16 activations, attention in
tiles); the check reports ``torch.cuda.max_memory_allocated`` beside
it (CUDA graphs' private pools included where they ran).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path

import torch

from cabinllm.builders.memory_model import activation_bytes, weights_bytes
from cabinllm.builders.targets import Backend
from cabinllm.runtime.formats.checkpoint import ModelConfig, expected_shapes
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kv.blocks import Sequence, cdiv
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.model.cuda import CudaRunner
from cabinllm.runtime.model.cuda_graphs import DecodeGraphs
from cabinllm.runtime.model.interface import Span
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import config_from_json

CONFIGS = resources.files("cabinllm.builders") / "data" / "model_configs"
SHAPES = {"default": "default-checkpoint.json", "qwen3-1.7b": "qwen3-1.7b.json",
          "llama-3.2-3b": "llama-3.2-3b-instruct.json"}
TOKENS_PER_BLOCK = 16
PREFILL_CHUNK = 2048  # prompt tokens per step
INT8_SCALE = 0.02  # random weights: a fixed static scale (amax about 2.5)
WEIGHT_STD = 0.02


def shape_config(name: str) -> ModelConfig:
    """The ModelConfig of one of SHAPES."""
    return config_from_json(Path(str(CONFIGS / SHAPES[name])))


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """The reference model of ``config`` with random fp16 weights (drawn on the GPU, norms at 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("layernorm.weight") or name.endswith("ln_f.weight"):
            weights[name] = torch.ones(shape, dtype=torch.float16)
        elif name.endswith("scaling_factor"):
            continue
        else:
            weights[name] = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float16)
                             * WEIGHT_STD).cpu()
    return Transformer(config, weights)


def new_cache(runner: CudaRunner, kv_mode: str, tokens: int) -> PagedKVCache:
    """A cache on the GPU holding one sequence of ``tokens`` tokens."""
    layout = runner.kv_layout
    config = KvCacheConfig(kv_mode, 1, TOKENS_PER_BLOCK)
    budget = config.bytes_per_token(layout) * TOKENS_PER_BLOCK * (cdiv(tokens, TOKENS_PER_BLOCK) + 1)
    scales = KVScales([INT8_SCALE] * layout.num_layers, [INT8_SCALE] * layout.num_layers)
    config = KvCacheConfig(kv_mode, budget + config.reserved_bytes(layout), TOKENS_PER_BLOCK)
    return PagedKVCache(layout, config, scales, device=runner.device)


def timed(fn) -> float:
    """Seconds ``fn`` takes, the GPU synchronized before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(runner: CudaRunner, kv_mode: str, context: int, steps: int, graphs: bool) -> dict:
    """Prefill ``context`` random tokens, then decode ``steps`` tokens (after 4 warm-up steps): tok/s and peak
    memory against the plan."""
    runner.graphs = DecodeGraphs(runner) if graphs else None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cache = new_cache(runner, kv_mode, context + steps + 4)
    seq = Sequence()
    ids = torch.randint(0, runner.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    cache.allocate(seq, ids[:PREFILL_CHUNK])

    def prefill() -> None:
        for start in range(0, context, PREFILL_CHUNK):
            piece = ids[start:start + PREFILL_CHUNK]
            if start:
                cache.append(seq, piece)
            runner.step([Span(piece, start, seq)], cache)

    prefill_s = timed(prefill)

    def decode(count: int) -> None:
        for _ in range(count):
            position = len(seq)
            cache.append(seq, [7])
            runner.step([Span([7], position, seq)], cache)

    decode(4)  # warm-up: kernels compiled, the graph captured
    decode_s = timed(lambda: decode(steps))
    c = runner.config
    plan = (weights_bytes(c, "fp16") + cache.stats().bytes_reserved
            + activation_bytes(c, min(PREFILL_CHUNK, context), context, 1, Backend.CUDA))
    return {"kv_mode": kv_mode, "context": context, "graphs": graphs, "prefill_tok_s": round(context / prefill_s, 1),
            "decode_tok_s": round(steps / decode_s, 1), "peak_bytes": torch.cuda.max_memory_allocated(),
            "plan_bytes": plan, "weights_bytes_on_gpu": runner.weight_bytes()}


def run(shapes: list[str], contexts: list[int], kv_modes: list[str], steps: int, out: Path) -> dict:
    """Every measurement of every shape, the results written to ``out`` after each (a run cut short keeps them)."""
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name in shapes:
        config = shape_config(name)
        started = time.perf_counter()
        runner = CudaRunner(random_model(config), "cuda", torch.float16)
        rows = results["shapes"][name] = []
        print(f"{name}: weights on the GPU in {time.perf_counter() - started:.1f} s", flush=True)
        for kv_mode in kv_modes:
            for context in contexts:
                if context + steps + 8 > config.max_position_embeddings:
                    continue
                for graphs in (False, True):
                    rows.append(measure(runner, kv_mode, context, steps, graphs))
                    print(json.dumps({"shape": name, **rows[-1]}), flush=True)
                    write(results, out)
        del runner
        torch.cuda.empty_cache()
    return results


def write(results: dict, out: Path) -> None:
    """``gpu_check.json`` and ``gpu_check.txt`` (the table) in ``out``."""
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    (out / "gpu_check.txt").write_text(table(results) + "\n")


def table(results: dict) -> str:
    """A short text table of the results."""
    lines = [f"{results['device']}, torch {results['torch']}; random weights (speed and memory only)",
             f"{'shape':13} {'kv':5} {'context':>7} {'graphs':6} {'prefill tok/s':>13} {'decode tok/s':>12} "
             f"{'peak MiB':>9} {'plan MiB':>9}"]
    for name, rows in results["shapes"].items():
        for r in rows:
            lines.append(f"{name:13} {r['kv_mode']:5} {r['context']:>7} {str(r['graphs']):6} "
                         f"{r['prefill_tok_s']:>13,.0f} {r['decode_tok_s']:>12,.1f} {r['peak_bytes'] / 2**20:>9,.0f} "
                         f"{r['plan_bytes'] / 2**20:>9,.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure, print the table, write ``gpu_check.json`` and ``gpu_check.txt`` into --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--contexts", default="512,4096,16384")
    parser.add_argument("--kv", default="fp16,int8")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: error: no CUDA GPU here", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args.shapes.split(","), [int(c) for c in args.contexts.split(",")], args.kv.split(","), args.steps,
                  args.out)
    write(results, args.out)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
