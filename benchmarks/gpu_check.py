"""The CUDA runner on a GPU: random weights at real model shapes, logits against transformers on the same weights,
decode and prefill tok/s at several contexts (fp16, int8 and fp8 KV, from CUDA graphs and eager), the fraction of the
GPU's read bandwidth decode reaches, the TTFT of turn 10 of a dialogue with and without reuse, transformers'
``generate`` as the peer, and peak GPU memory against the planner's memory model.

Shapes come from the configs in ``builders/data/model_configs`` (the default model's checkpoint config, Llama-3.2-3B's
and Qwen3-4B's HF ``config.json``); the weights are drawn on the device. Random weights measure speed, memory and
agreement with transformers, never quality; the int8 and fp8 KV's static scale is a fixed guess for the same reason.
fp8 KV runs on sm_89 and newer (Ada, Hopper, Blackwell) and is left out below with a line saying so.

- Logits: a 64-token prompt through the runner (fp16 KV) and through the family's transformers model (fp16, same
  weights, ``calibration.hf_model.transformers_model``): the largest absolute difference and how often the top token
  agrees.
- Bandwidth: decode reads every weight and the context's K/V once per token; (weight bytes + KV bytes per token x
  context) x tok/s over the read bandwidth a large ``sum`` on the device reaches.
- Turn 10 (``--turn``): the planner's typical turn (``builders.dialogue_turns.TYPICAL_TURN``); with reuse, turn 10
  prefills only its own message over the cached history; without, the whole history.
- Peer: transformers' ``generate`` with a static cache, eager and compiled (``torch.compile``, its default with a
  static cache), decode tok/s at 4,096 tokens: (time for n + 1 new tokens - time for 1) / n.
- Memory: fp16 weights (``builders.memory_model.weights_bytes``) + the KV pool the cache reserved + the CUDA runner's
  activations of the largest step (``activation_bytes``), beside ``torch.cuda.max_memory_allocated`` (CUDA graphs'
  private pools included where they ran).

Every function takes the device from the runner it is given, so the tests run them on the CPU at a tiny shape with
the kernels interpreted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Callable

import torch

from cabinllm.builders.dialogue_turns import TYPICAL_TURN
from cabinllm.builders.memory_model import activation_bytes, weights_bytes
from cabinllm.builders.targets import Backend
from cabinllm.calibration.hf_model import transformers_model
from cabinllm.runtime.formats.checkpoint import ModelConfig, expected_shapes
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kernels.triton import FP8_CAPABILITY
from cabinllm.runtime.kv.blocks import Sequence, cdiv
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.model.cuda import CudaRunner
from cabinllm.runtime.model.cuda_graphs import DecodeGraphs
from cabinllm.runtime.model.interface import Span
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import config_from_json

CONFIGS = resources.files("cabinllm.builders") / "data" / "model_configs"
# the 3B shape first: the figures are taken there, and a run cut by its time limit keeps what ran first
SHAPES = {"llama-3.2-3b": "llama-3.2-3b-instruct.json", "default": "default-checkpoint.json",
          "qwen3-4b": "qwen3-4b.json"}
TOKENS_PER_BLOCK = 16
PREFILL_CHUNK = 2048  # prompt tokens per step
INT8_SCALE = 0.02  # random weights: a fixed static scale (amax about 2.5)
WEIGHT_STD = 0.02
LOGITS_PROMPT = 64
PEER_CONTEXT = 4096
BANDWIDTH_BYTES = 1 << 30


def shape_config(name: str) -> ModelConfig:
    """The ModelConfig of one of SHAPES."""
    return config_from_json(Path(str(CONFIGS / SHAPES[name])))


def random_weights(config: ModelConfig, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp16 weights of ``config`` (drawn on ``device``, kept on the host; norms at 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(("norm.weight", "ln_f.weight")):
            weights[name] = torch.ones(shape, dtype=torch.float16)
        elif not name.endswith("scaling_factor"):
            weights[name] = (torch.randn(shape, generator=gen, device=device) * WEIGHT_STD).half().cpu()
    return weights


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes, the device synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def new_cache(runner: CudaRunner, kv_mode: str, tokens: int) -> PagedKVCache:
    """A cache on the runner's device holding ``tokens`` tokens (one sequence, or several sharing them)."""
    layout = runner.kv_layout
    config = KvCacheConfig(kv_mode, 1, TOKENS_PER_BLOCK)
    budget = config.bytes_per_token(layout) * TOKENS_PER_BLOCK * (cdiv(tokens, TOKENS_PER_BLOCK) + 1)
    scales = KVScales([INT8_SCALE] * layout.num_layers, [INT8_SCALE] * layout.num_layers)
    config = KvCacheConfig(kv_mode, budget + config.reserved_bytes(layout), TOKENS_PER_BLOCK)
    return PagedKVCache(layout, config, scales, device=runner.device)


def random_ids(config: ModelConfig, count: int, seed: int = 1) -> list[int]:
    """``count`` random token ids of the model's vocabulary."""
    return torch.randint(0, config.vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(runner: CudaRunner, cache: PagedKVCache, seq: Sequence, ids: list[int]) -> None:
    """Append ``ids`` to ``seq`` and run them in chunks of PREFILL_CHUNK."""
    for start in range(0, len(ids), PREFILL_CHUNK):
        piece, position = ids[start:start + PREFILL_CHUNK], len(seq)
        if position:
            cache.append(seq, piece)
        else:
            cache.allocate(seq, piece)
        runner.step([Span(piece, position, seq)], cache)


def decode(runner: CudaRunner, cache: PagedKVCache, seq: Sequence, count: int) -> None:
    """``count`` decode steps of one sequence."""
    for _ in range(count):
        position = len(seq)
        cache.append(seq, [7])
        runner.step([Span([7], position, seq)], cache)


def peak_bytes(device: torch.device) -> int | None:
    """The most memory allocated on the device since the last reset (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    """Start counting the peak again."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(runner: CudaRunner, kv_mode: str, context: int, steps: int, graphs: bool) -> dict:
    """Prefill ``context`` random tokens, then decode ``steps`` tokens (after 4 warm-up steps): tok/s, the bytes a
    decode step reads and peak memory against the plan."""
    device = runner.device
    runner.graphs = DecodeGraphs(runner) if graphs else None
    reset_peak(device)
    cache, seq = new_cache(runner, kv_mode, context + steps + 4), Sequence()
    ids = random_ids(runner.config, context)
    prefill_s = timed(lambda: prefill(runner, cache, seq, ids), device)
    decode(runner, cache, seq, 4)  # warm-up: kernels compiled, the graph captured
    decode_s = timed(lambda: decode(runner, cache, seq, steps), device)
    c = runner.config
    plan = (weights_bytes(c, "fp16") + cache.stats().bytes_reserved
            + activation_bytes(c, min(PREFILL_CHUNK, context), context, 1, Backend.CUDA))
    read = runner.weight_bytes() + cache.config.bytes_per_token(runner.kv_layout) * (context + steps // 2)
    return {"kv_mode": kv_mode, "context": context, "graphs": graphs, "prefill_tok_s": round(context / prefill_s, 1),
            "decode_tok_s": round(steps / decode_s, 1), "bytes_read_per_token": read,
            "peak_bytes": peak_bytes(device), "plan_bytes": plan, "weights_bytes_on_gpu": runner.weight_bytes()}


def read_bandwidth(device: torch.device, nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Bytes per second a ``sum`` over a large fp16 tensor reads on the device (the median of ``repeats``)."""
    x = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    x.sum()
    seconds = statistics.median(timed(x.sum, device) for _ in range(repeats))
    return nbytes / seconds


def against_transformers(runner: CudaRunner, hf: torch.nn.Module) -> dict:
    """A LOGITS_PROMPT-token prompt's logits at every position through the runner (fp16 KV) and transformers."""
    ids = random_ids(runner.config, LOGITS_PROMPT, seed=2)
    cache, seq = new_cache(runner, "fp16", LOGITS_PROMPT), Sequence()
    cache.allocate(seq, ids)
    with torch.inference_mode():
        ours = runner.forward(ids, 0, cache, seq, all_logits=True).float()
        theirs = hf(torch.tensor([ids], device=runner.device)).logits[0].float()
    return {"prompt_tokens": LOGITS_PROMPT, "max_abs_diff": (ours - theirs).abs().max().item(),
            "logit_abs_max": theirs.abs().max().item(),
            "top1_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()}


def peer_decode(hf: torch.nn.Module, context: int, steps: int, compiled: bool) -> dict:
    """transformers' ``generate`` with a static cache (compiled or not): decode tok/s after a ``context`` prompt."""
    device = next(hf.parameters()).device
    ids = torch.tensor([random_ids(hf.config, context, seed=3)], device=device)

    def generate(count: int) -> None:
        hf.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False, cache_implementation="static",
                    disable_compile=not compiled, pad_token_id=0)

    try:
        generate(steps + 1)  # warm-up (and the compile)
        first = timed(lambda: generate(1), device)
        total = timed(lambda: generate(steps + 1), device)
    except Exception as err:  # a family or a torch build whose compile fails: reported, the check goes on
        return {"compiled": compiled, "context": context, "error": f"{type(err).__name__}: {err}"[:300]}
    return {"compiled": compiled, "context": context, "decode_tok_s": round(steps / max(total - first, 1e-9), 1)}


def turn_ttft(runner: CudaRunner, kv_mode: str, turn: int = 10) -> dict:
    """Seconds to prefill turn ``turn`` of a dialogue of typical turns: only its message over the cached history
    (reuse), or the whole history (none)."""
    t, device = TYPICAL_TURN, runner.device
    history = random_ids(runner.config, t.system + (turn - 1) * (t.user + t.assistant), seed=4)
    message = random_ids(runner.config, t.user, seed=5)
    cache, seq = new_cache(runner, kv_mode, 2 * (len(history) + len(message))), Sequence()
    prefill(runner, cache, seq, history)
    reuse = timed(lambda: prefill(runner, cache, seq, message), device)
    fresh, whole = new_cache(runner, kv_mode, len(history) + len(message)), Sequence()
    none = timed(lambda: prefill(runner, fresh, whole, history + message), device)
    return {"kv_mode": kv_mode, "turn": turn, "history_tokens": len(history), "message_tokens": len(message),
            "with_reuse_s": reuse, "without_reuse_s": none}


def row_kinds(device: torch.device, context: int) -> tuple[bool, ...]:
    """Which decode rows a context gets (True: from CUDA graphs): on a GPU graphs at every context and eager as well
    at PEER_CONTEXT (the graphs' gain, in time for the part's limit); on the CPU eager only."""
    if device.type != "cuda":
        return (False,)
    return (True, False) if context == PEER_CONTEXT else (True,)


def check_shape(name: str, config: ModelConfig, device: torch.device, dtype: torch.dtype, contexts: list[int],
                kv_modes: list[str], steps: int, peers: list[str], turn: int, out: Callable[[dict], None]) -> dict:
    """Every measurement of one shape; ``out`` gets the results so far after each."""
    started = time.perf_counter()
    weights = random_weights(config, device)
    runner = CudaRunner(Transformer(config, weights), device, dtype, graphs=False)
    hf = transformers_model(config, weights, device, dtype)
    del weights
    result = {"config": name, "load_s": round(time.perf_counter() - started, 1), "rows": [], "peers": []}
    result["logits"] = against_transformers(runner, hf)
    out(result)
    for kv_mode in kv_modes:
        for context in contexts:
            if context + steps + 8 > config.max_position_embeddings:
                continue
            for graphs in row_kinds(device, context):
                result["rows"].append(measure(runner, kv_mode, context, steps, graphs))
                out(result)
    runner.graphs = None
    result["turn_ttft"] = [turn_ttft(runner, kv_mode, turn) for kv_mode in kv_modes]
    out(result)
    del runner
    peer_context = min(PEER_CONTEXT, max(contexts))
    for peer in peers:
        result["peers"].append(peer_decode(hf, peer_context, steps, compiled=peer == "compile"))
        out(result)
    return result


def summarize(results: dict) -> None:
    """Add to each shape the bandwidth fraction of its rows and its best decode against the peer's at 4,096."""
    bandwidth = results.get("read_bandwidth_bytes_s")
    for shape in results["shapes"].values():
        for row in shape["rows"]:
            row["bandwidth_fraction"] = (round(row["bytes_read_per_token"] * row["decode_tok_s"] / bandwidth, 3)
                                         if bandwidth else None)
        context = max((p["context"] for p in shape["peers"]), default=None)
        ours = max((r["decode_tok_s"] for r in shape["rows"] if r["context"] == context), default=None)
        peer = max((p.get("decode_tok_s", 0) for p in shape["peers"]), default=0)
        shape["decode_vs_peer"] = round(ours / peer, 2) if ours and peer else None


def run(shapes: dict[str, ModelConfig], device: torch.device, dtype: torch.dtype, contexts: list[int],
        kv_modes: list[str], steps: int, peers: list[str], out: Path | None = None, turn: int = 10) -> dict:
    """Every measurement of every shape, written to ``out`` after each (a run cut short keeps what it had)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (kernels interpreted)"
    results = {"device": name, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
               "read_bandwidth_bytes_s": read_bandwidth(device) if device.type == "cuda" else None, "shapes": {}}

    def save(shape: dict) -> None:
        results["shapes"][shape["config"]] = shape
        summarize(results)
        if out is not None:
            write(results, out)
        print(json.dumps({k: v for k, v in shape.items() if k not in ("rows", "peers")}), flush=True)

    for label, config in shapes.items():
        check_shape(label, config, device, dtype, contexts, kv_modes, steps, peers, turn, save)
        reset_peak(device)
    return results


def write(results: dict, out: Path) -> None:
    """``gpu_check.json`` and ``gpu_check.txt`` (the table) in ``out``."""
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    (out / "gpu_check.txt").write_text(table(results) + "\n")


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def table(results: dict) -> str:
    """A short text table of the results."""
    bandwidth = results.get("read_bandwidth_bytes_s")
    lines = [f"{results['device']}, torch {results['torch']}, {results['dtype']}; random weights (speed, memory and "
             f"agreement only); read bandwidth {bandwidth / 1e9:,.0f} GB/s" if bandwidth else
             f"{results['device']}, torch {results['torch']}; random weights (mechanics only)"]
    for name, shape in results["shapes"].items():
        logits = shape.get("logits", {})
        lines.append(f"{name}: logits vs transformers max |diff| {logits.get('max_abs_diff', float('nan')):.2e} "
                     f"(logits up to {logits.get('logit_abs_max', float('nan')):.2f}), top-1 agrees "
                     f"{logits.get('top1_agreement', float('nan')):.0%}; decode vs transformers' best at "
                     f"{PEER_CONTEXT}: {shape.get('decode_vs_peer')}x")
        lines.append(f"  {'kv':5} {'context':>7} {'graphs':6} {'prefill tok/s':>13} {'decode tok/s':>12} "
                     f"{'of bandwidth':>12} {'peak MiB':>9} {'plan MiB':>9}")
        for r in shape["rows"]:
            fraction = "-" if r.get("bandwidth_fraction") is None else f"{r['bandwidth_fraction']:.0%}"
            lines.append(f"  {r['kv_mode']:5} {r['context']:>7} {str(r['graphs']):6} {r['prefill_tok_s']:>13,.0f} "
                         f"{r['decode_tok_s']:>12,.1f} {fraction:>12} {_mib(r['peak_bytes']):>9} "
                         f"{_mib(r['plan_bytes']):>9}")
        for t in shape.get("turn_ttft", []):
            lines.append(f"  turn {t['turn']} TTFT ({t['kv_mode']} KV, {t['history_tokens']} tokens of history): "
                         f"{t['with_reuse_s'] * 1e3:,.1f} ms with reuse, {t['without_reuse_s'] * 1e3:,.1f} ms without")
        for p in shape["peers"]:
            what = f"{p['decode_tok_s']:,.1f} tok/s" if "decode_tok_s" in p else p["error"]
            lines.append(f"  transformers generate, static cache{', compiled' if p['compiled'] else ''}, "
                         f"{p['context']} tokens: {what}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure, print the table, write ``gpu_check.json`` and ``gpu_check.txt`` into --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.txt")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--contexts", default="512,4096,16384", help="decode contexts (default: 512,4096,16384)")
    parser.add_argument("--kv", default="fp16,int8,fp8",
                        help="KV modes (default: fp16,int8,fp8; fp8 is left out below sm_89)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per row (default: 32)")
    parser.add_argument("--turn", type=int, default=10, help="the dialogue turn whose TTFT is timed (default: 10)")
    parser.add_argument("--peers", default="static,compile",
                        help="transformers' generate runs: static (eager) and/or compile (default: both)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: error: no CUDA GPU here", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = {name: shape_config(name) for name in args.shapes.split(",")}
    kv_modes = args.kv.split(",")
    if "fp8" in kv_modes and torch.cuda.get_device_capability() < FP8_CAPABILITY:
        print(f"gpu_check: fp8 KV left out: this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability()))}, "
              "fp8 needs sm_89 or newer", file=sys.stderr)
        kv_modes.remove("fp8")
    results = run(shapes, torch.device("cuda"), torch.float16, [int(c) for c in args.contexts.split(",")],
                  kv_modes, args.steps, [p for p in args.peers.split(",") if p], args.out, args.turn)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
