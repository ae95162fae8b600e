"""How the Triton kernels read one layer's pools (``StoredKV``, as ``KVStorage.stored_kv`` hands them over): the kind
of values they hold and their strides (no Triton needed)."""
from __future__ import annotations

import torch

from cabinllm.runtime.kernels.bindings import StoredKV

# how pools store values: as they are, int8 codes, int8 + token scales, e4m3 values (both with a layer's static scale)
QUANT_NONE, QUANT_STATIC, QUANT_TOKEN, QUANT_FP8 = 0, 1, 2, 3


def quant(pools: StoredKV) -> int:
    """How the pools store values: QUANT_TOKEN, QUANT_STATIC (int8 codes), QUANT_FP8 or QUANT_NONE."""
    if pools.k_token_scales is not None:
        return QUANT_TOKEN
    return {torch.int8: QUANT_STATIC, torch.float8_e4m3fn: QUANT_FP8}.get(pools.k.dtype, QUANT_NONE)


def strides(pools: StoredKV) -> tuple[int, int, int]:
    """(block, token, head) strides shared by the K and V pools."""
    if pools.k.stride() != pools.v.stride() or pools.k.stride(-1) != 1:
        raise ValueError("K and V pools must have the same strides and contiguous head rows")
    return pools.k.stride(0), pools.k.stride(1), pools.k.stride(2)


def scale_strides(pools: StoredKV) -> tuple[int, int, int]:
    """The token-scale pools' (block, token, head) strides (zeros without them)."""
    if pools.k_token_scales is None:
        return 0, 0, 0
    return pools.k_token_scales.stride(0), pools.k_token_scales.stride(1), pools.k_token_scales.stride(2)


def scale_pools(pools: StoredKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-scale pools, or K's and V's pools as placeholders the kernel never reads."""
    if pools.k_token_scales is None:
        return pools.k, pools.v
    return pools.k_token_scales, pools.v_token_scales
