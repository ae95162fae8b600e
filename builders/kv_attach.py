"""Store KV cache quantization in a TensorRT-LLM checkpoint: the algorithm and each layer's scaling factor.

TensorRT-LLM keeps ONE float32 ``[1]`` scale per layer for K and V together:
amax / 127 for INT8, amax / 448 for FP8 (e4m3). ``kv_scales.json`` holds amax / 127,
so the FP8 factor is ``cabinllm.runtime.kv.quant.fp8_scale`` of the shared INT8 scale (times 127 / 448).
"""
from __future__ import annotations

import torch

from cabinllm.runtime.formats.checkpoint import ModelConfig, layer_prefix
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kv.modes import kv_mode
from cabinllm.runtime.kv.quant import fp8_scale


def quant_algo(kv_dtype: str) -> str | None:
    """``kv_cache_quant_algo`` for a KV dtype: INT8 for the static int8 modes, FP8, or None."""
    return kv_mode(kv_dtype).trtllm_quant_algo


def attach_kv_quant(config: ModelConfig, weights: dict[str, torch.Tensor], scales: KVScales, kv_dtype: str) -> None:
    """Set ``kv_cache_quant_algo`` and every layer's ``kv_cache_scaling_factor`` (in place); no-op for fp16/fp32."""
    algo = quant_algo(kv_dtype)
    if algo is None:
        return
    config.quantization = {**config.quantization, "kv_cache_quant_algo": algo}
    for layer, scale in enumerate(scales.shared()):
        name = f"{layer_prefix(layer)}.attention.kv_cache_scaling_factor"
        weights[name] = torch.tensor([scale if algo == "INT8" else fp8_scale(scale)], dtype=torch.float32)
