"""Our reference engine as a benchmark runner, one per KV cache mode."""
from __future__ import annotations

import dataclasses

import torch

from cabinllm.benchmarks.runners.base import KVFootprint, Runner, RunTiming
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.weight_formats import head_format
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kernels.bindings import matvec, native_kernels_enabled
from cabinllm.runtime.kv.cache import KvCacheConfig, sized_config
from cabinllm.runtime.kv.modes import REFERENCE_KV_MODES, bytes_per_token, kv_mode
from cabinllm.runtime.model.transformer import Transformer


def available_modes(wanted: list[str]) -> list[str]:
    """The wanted modes the reference engine stores."""
    return [m for m in wanted if m in REFERENCE_KV_MODES]


def cabin_runner(engine: Engine, mode: str, name: str | None = None, weights: str | None = None) -> Runner:
    """Prefill and greedy decode on a fresh paged cache of ``mode``, sized to the prompt; named 'cabin MODE', with
    ' + W8A16' or ' + W4A16_AWQ' for an engine of quantized weights, unless ``name`` (and ``weights``, the note on
    how the weights run) say otherwise."""
    layout = engine.model.kv_layout

    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        cache = engine.new_cache(sized_config(layout, mode, len(prompt) + new_tokens))
        params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=[])
        result = engine.new_core(cache, SchedulerConfig(prefill_chunk=len(prompt))).generate(Request(prompt, params))
        return RunTiming(len(prompt), result.ttft_s, len(result.token_ids) - 1, result.decode_s)

    def footprint(budget: int, _prompt: list[int]) -> KVFootprint:
        config = engine.kv_cache_config(KvCacheConfig(mode, budget))
        stats = engine.new_cache(config).stats()
        return KVFootprint(stats.bytes_per_token, stats.window_bytes, stats.tokens_capacity,
                           f"runtime block accounting (PagedKVCache.stats), blocks of {config.tokens_per_block} "
                           "tokens")

    fmt = engine.config.weight_format
    name = name or f"cabin {mode}" + (f" + {fmt.quant_algo}" if fmt.quant_algo else "")
    held = step_weight_bytes(engine.model) if isinstance(engine.model, Transformer) else None
    per_token = bytes_per_token(layout, mode, engine.kv_cache_config(KvCacheConfig(mode)).tokens_per_block)

    def read_bytes(context: int) -> int:
        return held + context * per_token

    return Runner(name, "cabin", kv_mode(mode).label, weights or weights_note(engine, mode), run, footprint,
                  mode=mode, read_bytes=read_bytes if held is not None else None)


def step_weight_bytes(model: Transformer) -> int:
    """Bytes of the weights one decode step reads, as the model holds them: every layer's tensors and linear ops,
    the final norm and the lm_head (one embedding row besides is left out)."""
    return sum(_bytes(v) for layer in model.layers for v in layer.values()) + _bytes(model.final_norm) \
        + _bytes(model.lm_head)


def _bytes(value: object) -> int:
    """Bytes of a tensor, or of the tensors of a linear op (a dataclass of tensors, or of parts)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_bytes(v) for v in value)
    if dataclasses.is_dataclass(value):
        return sum(_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def weights_note(engine: Engine, mode: str) -> str:
    """The weights and which code runs a decode step in this mode: native kernels or the torch fallback."""
    fmt = engine.config.weight_format
    int8_head = head_format(engine.config.quantization).name == "int8"
    head = "int8" if int8_head else "fp16" if engine.model.lm_head.dtype == torch.float16 else "fp32"
    embedding = "int8" if int8_head else "fp32"
    if fmt.quant_algo is None:
        weights, kernel = f"fp32 (the engine's checkpoint, upcast; lm_head {head}, embedding {embedding})", "matvec"
    else:
        weights, kernel = (f"{fmt.label} (the engine's checkpoint; lm_head {head}, embedding {embedding})",
                           "quant_matvec")
    if not native_kernels_enabled() or matvec() is None:
        return f"{weights}; decode steps on the torch path (native kernels off)"
    attention = "attention in the blocks" if kv_mode(mode).per_token else "attention over natively dequantized blocks"
    return f"{weights}; decode steps on native kernels ({kernel}, {attention})"
