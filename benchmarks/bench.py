"""One cabin-bench run: set up ours and the peers, measure KV memory, speed and multi-turn TTFT, check the claims."""
from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from cabinllm.benchmarks.accuracy import accuracy_rows
from cabinllm.benchmarks.claims import check_claims
from cabinllm.benchmarks.kv_memory import measure_kv_memory
from cabinllm.benchmarks.machine import machine_info, oversubscribed, read_bandwidth
from cabinllm.benchmarks.multiturn import measure_multiturn
from cabinllm.benchmarks.runners.base import Runner, Unavailable
from cabinllm.benchmarks.runners.cabin import available_modes, cabin_runner
from cabinllm.benchmarks.runners.llamacpp import llamacpp_runners
from cabinllm.benchmarks.runners.onnx import genai_runner, onnx_runner
from cabinllm.benchmarks.runners.transformers import transformers_runners
from cabinllm.benchmarks.settings import BenchSettings
from cabinllm.benchmarks.speed import measure_speed, speed_ratios, speed_rows
from cabinllm.benchmarks.workload import long_sharegpt_dialogue, sharegpt_stream
from cabinllm.calibration.hf_model import transformers_model
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.checkpoint import load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.sources.model_source import DEFAULT_GGUF_NAME, default_gguf_path, source_label

MIB = 1 << 20
TURN_MODE = "int8"  # our mode in the dialogue test
TURN_PEERS = ("transformers dynamic", "llama.cpp q8_0")
PEER_FAMILIES = ("transformers", "llama.cpp")


def engine_gguf(engine: Engine) -> Path | None:
    """The GGUF file the engine was imported from (llama.cpp runs the same file), None if it came from elsewhere."""
    source = engine.manifest.get("model", {}).get("source", "")
    if Path(source).name == DEFAULT_GGUF_NAME:
        return default_gguf_path()  # the packaged file, wherever it is installed on this machine
    return Path(source) if source.endswith(".gguf") and Path(source).is_file() else None


def make_peers(engine: Engine, families: list[str], threads: int, genai: Path | None = None,
               ) -> list[Runner | Unavailable]:
    """transformers (default and quantized caches), llama.cpp (f16, q8_0) and, given its model folder,
    onnxruntime-genai, each as a runner or Unavailable."""
    peers: list[Runner | Unavailable] = [genai_runner(genai, threads)] if genai else []
    if "transformers" in families:
        peers += transformers_runners(transformers_model(*load_checkpoint(engine.folder / CHECKPOINT_DIR)))
    if "llama.cpp" in families:
        gguf = engine_gguf(engine)
        if gguf is None:
            peers += [Unavailable(f"llama.cpp {kv}", "llama.cpp", "the engine was not imported from a GGUF file, "
                                  "so llama.cpp has no file with the same weights") for kv in ("f16", "q8_0")]
        else:
            peers += llamacpp_runners(gguf, threads, engine.config.max_position_embeddings)
    return peers


def run_bench(engine: Engine, settings: BenchSettings, peers: list[Runner | Unavailable],
              evaluation: dict | None, weight_engines: list[Engine] = (), onnx_graphs: Path | None = None) -> dict:
    """Measure everything on ours (the engine, the same model in other weight formats, our ONNX Runtime backend on
    graphs exported from it) and the available peers; the JSON-ready results (without command/notes)."""
    info = machine_info()
    bandwidth = {"1": read_bandwidth(1), "all": read_bandwidth(os.cpu_count() or 1)}  # before the runs, quiet
    crowded = oversubscribed(info)
    if crowded:
        print(f"cabin-bench: warning: {crowded}", file=sys.stderr)
    ours = [cabin_runner(e, m) for e in [engine, *weight_engines] for m in available_modes(settings.modes)]
    ours += [onnx_runner(load_onnx_engine(onnx_graphs, threads=torch.get_num_threads()))] if onnx_graphs else []
    runners = ours + [p for p in peers if isinstance(p, Runner)]
    turn_peers = [p for p in runners if p.name in TURN_PEERS]
    prompt = sharegpt_stream(engine, max(settings.contexts))
    prompts = {c: prompt[:c] for c in settings.contexts}
    users = long_sharegpt_dialogue(engine, settings.turns, settings.max_user_tokens) if settings.turns else []
    warm_ups = len(runners)  # measure_speed's untimed first run of each runner
    total = (len(runners) + warm_ups + settings.repeats * len(settings.contexts) * len(runners)
             + settings.turn_repeats * len(users))
    with tqdm(total=total, desc="cabin-bench", unit="run", file=sys.stderr) as bar:
        kv = measure_kv_memory(runners, settings.kv_budget_mib * MIB, engine.config.max_position_embeddings, prompt,
                               bar)
        speed = measure_speed(runners, prompts, settings.decode_steps, settings.repeats, bar)
        multiturn = measure_multiturn(engine, TURN_MODE, users, turn_peers, settings.turn_repeats,
                                      settings.reply_tokens, settings.kv_budget_mib, bar) if users else None
    ratios = speed_ratios(speed, [r.name for r in ours], [r.name for r in runners if r.family != "cabin"])
    rows = speed_rows(speed)
    limit = memory_limit(ours, rows, bandwidth)
    quantized = [r.name for r in runners if r.family == "transformers" and r.name != "transformers dynamic"]
    growth = multiturn["growth_last_vs_first_quarter"] if multiturn else {}
    equalized = bool(engine.manifest.get("equalization", {}).get("enabled"))
    failed = {**speed.errors, **(multiturn["errors"] if multiturn else {}),
              **{r["runner"]: r["error"] for r in kv if "error" in r}}
    return {
        "machine": info,
        "load_average_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "engine": str(engine.folder),
        "engine_build_command": engine.manifest.get("build_command"),
        "model": f"{source_label(engine.manifest.get('model', {}).get('source', engine.folder))} "
                 f"({engine.config.num_hidden_layers} layers, {engine.config.num_key_value_heads} KV heads of "
                 f"{engine.config.head_size}); KV scales: {engine.manifest.get('kv_scales', {}).get('method', '?')}",
        "settings": {**asdict(settings), "label": settings.label()},
        "runners": [{"name": r.name, "family": r.family, "kv": r.kv, "weights": r.weights,
                     "status": "failed" if r.name in failed else "ok", "reason": failed.get(r.name)}
                    for r in runners]
                   + [{"name": p.name, "family": p.family, "kv": "-", "weights": "-", "status": "unavailable",
                       "reason": p.reason} for p in peers if isinstance(p, Unavailable)],
        "kv_memory": kv,
        "memory_limit": limit,
        "speed": {"rows": rows, "ratios": [asdict(r) for r in ratios], "errors": speed.errors,
                  "warm_up_runs": speed.warm_up_runs},
        "multiturn": multiturn,
        "accuracy": {"source": {k: v for k, v in evaluation.items() if k != "modes"},
                     "rows": accuracy_rows(runners, evaluation, equalized)} if evaluation else {},
        "weight_engines": [str(e.folder) for e in weight_engines],
        "onnx_graphs": str(onnx_graphs) if onnx_graphs else None,
        "claims": [asdict(c) for c in check_claims(ratios, settings.contexts, quantized, growth,
                                                   f"cabin {TURN_MODE} (reuse)")],
    }


def memory_limit(ours: list[Runner], rows: list[dict], bandwidth: dict[str, float]) -> dict:
    """Each of our rows against the machine's read bandwidth (1 thread, or all threads when the run used more):
    the bytes a decode step reads (weights as held, the KV of the context) times decode tokens/s."""
    key = "1" if torch.get_num_threads() == 1 else "all"
    reads = {r.name: r.read_bytes for r in ours if r.read_bytes}
    out = []
    for row in rows:
        if row["runner"] in reads and row["decode_tok_s"] is not None:
            read = reads[row["runner"]](row["context"])
            out.append({"runner": row["runner"], "context": row["context"], "bytes_per_token": read,
                        "decode_tok_s": row["decode_tok_s"], "read_bytes_s": read * row["decode_tok_s"],
                        "fraction": read * row["decode_tok_s"] / bandwidth[key]})
    return {"read_bandwidth_bytes_s": bandwidth, "against": key, "rows": out}
