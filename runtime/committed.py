"""Tensors whose memory is taken from the system when they are created, not on first write."""
from __future__ import annotations

import torch


def committed_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor whose pages are written now, so the process holds the whole budget from the start."""
    return torch.empty(*shape, dtype=dtype).fill_(0)
