"""llama.cpp through llama-cpp-python as a peer, on the same GGUF file, with f16 and q8_0 KV caches."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from unittest import mock

from cabinllm.benchmarks.machine import CPUINFO, cpu_flags
from cabinllm.benchmarks.runners.base import (KVFootprint, Runner, RunTiming, Unavailable, footprint_lengths,
                                              missing_module)

KV_TYPES = ("f16", "q8_0")
WEIGHTS = "as stored in the GGUF (Q4_1 layers and a Q8_0 embedding for the default model)"


def llamacpp_runners(gguf: Path, threads: int, n_ctx: int, kv_types: tuple[str, ...] = KV_TYPES,
                     ) -> list[Runner | Unavailable]:
    """One runner per KV type, each with its own context of ``n_ctx`` cells and flash attention on
    (llama.cpp needs it for a quantized V cache; f16 uses it too, so both run the same kernels)."""
    reason = missing_module("llama_cpp", "llama-cpp-python")
    if reason:
        return [Unavailable(f"llama.cpp {kv}", "llama.cpp", reason) for kv in kv_types]
    return [_runner(gguf, threads, n_ctx, kv) for kv in kv_types]


def no_extra_buffers(cpuinfo: Path = CPUINFO):
    """llama.cpp's model parameters with ``use_extra_bufts`` off (its extra CPU buffer types) on a CPU with AMX:
    there they put the weights on AMX tiles, and where the machine does not hand tiles out (a 2-core Sapphire Rapids
    VM) the first tile instruction (``ldtilecfg`` in libggml-cpu) faults and kills the process. It also turns off
    llama.cpp's other repacked weight layouts there. llama-cpp-python's ``Llama`` takes no such argument, so its
    default parameters are patched while one is made; elsewhere nothing changes."""
    if "amx_tile" not in cpu_flags(cpuinfo):  # AMX tiles: Sapphire Rapids and later
        return contextlib.nullcontext()
    from llama_cpp import llama_cpp as api

    defaults = api.llama_model_default_params

    def params():
        chosen = defaults()
        chosen.use_extra_bufts = False
        return chosen

    return mock.patch.object(api, "llama_model_default_params", params)


def _runner(gguf: Path, threads: int, n_ctx: int, kv: str) -> Runner:
    import llama_cpp

    ggml_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[kv]
    with no_extra_buffers():
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              type_k=ggml_type, type_v=ggml_type, flash_attn=True, verbose=False, seed=0)

    def timed(prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
        start, times = time.perf_counter(), []
        tokens = llm.generate(prompt, temp=0.0, reset=True)
        for _ in tokens:
            times.append(time.perf_counter())
            if len(times) == new_tokens:
                break
        tokens.close()
        return start, times

    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        llm.reset()  # no prefix reuse from an earlier call: a fresh prefill
        start, times = timed(prompt, new_tokens)
        return RunTiming(len(prompt), times[0] - start, len(times) - 1, times[-1] - times[0])

    def state_bytes(tokens: list[int]) -> int:
        llm.reset()
        llm.eval(tokens)
        return llama_cpp.llama_state_seq_get_size(llm.ctx, 0)

    def footprint(budget: int, prompt: list[int]) -> KVFootprint:
        n1, n2 = footprint_lengths(prompt)
        per_token = (state_bytes(prompt[:n2]) - state_bytes(prompt[:n1])) / (n2 - n1)
        return KVFootprint(per_token, 0, int(budget // per_token),
                           f"measured: llama_state_seq_get_size after {n1} and {n2} tokens; llama.cpp preallocates "
                           "n_ctx cells, so n_ctx = budget / bytes per token")

    def turn(history: list[int], fresh: bool) -> float:
        if fresh:
            llm.reset()
        start, times = timed(history, 1)
        return times[0] - start

    return Runner(f"llama.cpp {kv}", "llama.cpp", f"{kv} K and V (flash attention)", WEIGHTS, run, footprint, turn,
                  turn_note="llama-cpp-python's generate reuses the longest prefix it still holds in its context")
