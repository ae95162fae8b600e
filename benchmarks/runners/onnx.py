"""The ONNX path in cabin-bench: our ONNX Runtime backend on graphs from cabin-export, and onnxruntime-genai (its
model builder's folder of the same model) as its peer."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from cabinllm.benchmarks.runners.base import KVFootprint, Runner, RunTiming, Unavailable, missing_module
from cabinllm.benchmarks.runners.cabin import cabin_runner
from cabinllm.runtime.engine.loader import Engine

GENAI = "onnxruntime-genai"


def onnx_runner(engine: Engine) -> Runner:
    """Our backend on graphs loaded by cabinllm.runtime.backends.onnxruntime.load_onnx_engine, in their KV mode: the
    paged cache in our runtime, the graphs on ONNX Runtime. Its contexts end at the graphs' window; no accuracy columns (cabin-eval
    runs the reference)."""
    kv = engine.default_kv_mode
    weights = (f"the graphs' initializers ({engine.manifest.get('profile')} profile, window {engine.model.context}, "
               f"chunk {engine.model.chunk}), ONNX Runtime CPU provider")
    return replace(cabin_runner(engine, kv, name=f"cabin onnxruntime {kv}", weights=weights), mode=None)


def genai_kv_bytes_per_token(folder: Path) -> int:
    """Bytes per token of an onnxruntime-genai decoder's KV cache (all layers, K and V), its element type read
    from the graph's past K input."""
    import onnx

    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    graph = onnx.load(str(folder / config["filename"]), load_external_data=False).graph
    past = next(v for v in graph.input if v.name.startswith("past_key_values."))
    element = onnx.helper.tensor_dtype_to_np_dtype(past.type.tensor_type.elem_type).itemsize
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_size"] * element


def genai_runner(folder: Path, threads: int) -> Runner | Unavailable:
    """onnxruntime-genai's greedy generation on ``threads`` intra-op threads, or why it cannot run."""
    reason = missing_module("onnxruntime_genai", GENAI)
    if reason is None and not (folder / "genai_config.json").is_file():
        reason = f"{folder} has no genai_config.json: pass the folder onnxruntime-genai's model builder wrote"
    if reason:
        return Unavailable(GENAI, GENAI, reason)
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    per_token = genai_kv_bytes_per_token(folder)

    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        params = og.GeneratorParams(model)
        length = len(prompt) + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False)
        start = time.perf_counter()
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        generator.generate_next_token()
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            generator.generate_next_token()
        return RunTiming(len(prompt), first - start, new_tokens - 1, time.perf_counter() - first)

    def footprint(budget: int, _prompt: list[int]) -> KVFootprint:
        return KVFootprint(per_token, 0, int(budget // per_token),
                           "from the decoder graph's past K/V inputs (layers x KV heads x head size x element, K "
                           "and V); its cache is allocated for max_length tokens")

    return Runner(GENAI, GENAI, f"K and V as its model builder exported them ({per_token:,} bytes per token)",
                  "as its model builder exported them", run, footprint)
