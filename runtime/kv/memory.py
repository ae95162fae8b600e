"""Memory taken from the system when a tensor is created, not on first write, and how much there is to take."""
from __future__ import annotations

import os

import torch


def available_memory() -> int:
    """Bytes of memory the machine can still give (MemAvailable on Linux, else all of its physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def committed_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor whose pages are written now, so the process holds the whole budget from the start."""
    return torch.empty(*shape, dtype=dtype).fill_(0)
