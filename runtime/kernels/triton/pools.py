"""One layer's K and V pools as the Triton kernels read and write them (no Triton needed to hold them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cabinllm.runtime.kernels.bindings import StoredKV

QUANT_NONE, QUANT_STATIC, QUANT_TOKEN = 0, 1, 2  # how pools store values: as they are, int8 codes, int8 + token scales


@dataclass
class LayerPools:
    """One layer's K and V pools, as the kernels read and write them."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    k_token_scales: torch.Tensor | None = None
    v_token_scales: torch.Tensor | None = None

    @classmethod
    def of(cls, stored: StoredKV) -> "LayerPools":
        """The pools of a ``KVStorage.stored_kv`` answer (its block table is not used)."""
        return cls(stored.k, stored.v, stored.k_scale, stored.v_scale, stored.k_token_scales, stored.v_token_scales)

    @property
    def quant(self) -> int:
        """How the pools store values: QUANT_TOKEN, QUANT_STATIC (int8 codes) or QUANT_NONE."""
        if self.k_token_scales is not None:
            return QUANT_TOKEN
        return QUANT_STATIC if self.k.dtype == torch.int8 else QUANT_NONE

    def strides(self) -> tuple[int, int, int]:
        """(block, token, head) strides shared by the K and V pools."""
        if self.k.stride() != self.v.stride() or self.k.stride(-1) != 1:
            raise ValueError("K and V pools must have the same strides and contiguous head rows")
        return self.k.stride(0), self.k.stride(1), self.k.stride(2)

    def scale_strides(self) -> tuple[int, int, int]:
        """The token-scale pools' (block, token, head) strides (zeros without them)."""
        if self.k_token_scales is None:
            return 0, 0, 0
        return self.k_token_scales.stride(0), self.k_token_scales.stride(1), self.k_token_scales.stride(2)

    def scale_pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The token-scale pools, or K's and V's pools as placeholders the kernel never reads."""
        if self.k_token_scales is None:
            return self.k, self.v
        return self.k_token_scales, self.v_token_scales
