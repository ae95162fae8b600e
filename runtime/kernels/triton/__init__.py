"""Triton kernels over the paged KV cache, for the CUDA runner (``cabinllm.runtime.model.cuda``).

``quant_linear`` multiplies by quantized weights (W8A16, int4-g32, W4A16-AWQ) without dequantizing them into a copy.
``paged_attention`` holds the attention kernels (``pools`` how they read a layer's ``StoredKV``): the KV write that
stores a step's new K/V rows into their slots (int8 codes or e4m3 values with a layer's static scale, int8 with a
fp16 scale per token and KV head, or fp16/bf16/fp32 as they are), decode attention of one token per sequence over its
blocks (split-KV, flash-decoding style, with a second kernel reducing the splits) and prefill attention of new tokens
over a cached prefix (paged context: the prefix's blocks plus causal among the new tokens). Each reads the blocks in
place, as ``KVStorage.stored_kv`` hands them over (``StoredKV``): int8 codes and e4m3 values are multiplied by their
scale inside the dot products, never dequantized into a copy of the history.

Triton is an optional dependency (the ``gpu`` extra): ``load`` imports the kernels on first use. With
``TRITON_INTERPRET=1`` set before that, they run under Triton's interpreter on CPU tensors (how the tests check them
on a machine without a GPU).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from cabinllm.runtime.errors import MissingDependency

FP8_CAPABILITY = (8, 9)  # Triton converts e4m3 (float8e4nv) on Ada (sm_89) and newer: fp8 KV's floor
KERNELS_MODULE = f"{__name__}.paged_attention"
LINEAR_MODULE = f"{__name__}.quant_linear"


def load(module: str = KERNELS_MODULE) -> ModuleType:
    """A kernels module (``paged_attention`` by default, or ``quant_linear``); MissingDependency naming the extra where
    Triton is missing."""
    try:
        importlib.import_module("triton")
    except ImportError:
        raise MissingDependency("the CUDA runner's kernels need triton, which is not installed; "
                                "pip install 'cabinllm[gpu]'") from None
    return importlib.import_module(module)
