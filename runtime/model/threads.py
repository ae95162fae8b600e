"""CPU threads of the reference engine's torch ops: left as torch has them, a fixed count, or ``auto``.

``auto`` re-reads, at most every ``READ_EVERY_S`` before a model step, how much of this process's cores other
processes used since the last reading (Linux ``/proc/stat`` per core, minus this process's own CPU time) and runs
torch on the cores they leave idle, at least one. Why: torch splits a prefill's matrix products evenly over its
threads and waits for the slowest, so one thread on a core that speech or vision also runs holds the whole
product back (measured with one busy core: a 64-token prefill 2.7x slower on two threads, 1.4x on one;
``benchmarks/results/busy_cpu.md``). Decode of one sequence runs the single-threaded native kernels and hardly
changes. Where ``/proc/stat`` is missing, ``auto`` keeps every core.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

AUTO = "auto"
READ_EVERY_S = 0.25  # shorter windows read too few clock ticks (10 ms each) to tell a busy core
HEADROOM = 0.3  # a core counts as idle while other processes use less than 0.7 of it


def threads_for(cores: int, others_busy: float) -> int:
    """Threads for ``cores`` cores of which other processes kept ``others_busy`` busy (in cores)."""
    return max(1, min(cores, math.floor(cores - others_busy + HEADROOM)))


def parse_threads(text: str) -> int | str:
    """``auto`` or a positive thread count, as a command line gives it (ValueError otherwise)."""
    if text == AUTO:
        return AUTO
    count = int(text)
    if count < 1:
        raise ValueError(f"threads must be {AUTO} or >= 1, got {count}")
    return count


@dataclass
class _Reading:
    at: float  # wall clock, seconds
    busy_s: float  # CPU time of every process on our cores
    own_s: float  # CPU time of this process


def cpu_seconds(cores: set[int]) -> tuple[float, float] | None:
    """CPU seconds so far of every process on ``cores`` and of this process (None without ``/proc/stat``)."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            ticks += user + nice + system + irq + softirq + steal  # steal: the hypervisor gave the core away
    own = os.times()
    return ticks / os.sysconf("SC_CLK_TCK"), own.user + own.system


class CpuThreads:
    """The process's thread policy for torch (one per process, as torch's thread count is); ``read`` and ``clock``
    are where ``auto`` reads the cores' CPU seconds and the wall clock."""

    def __init__(self, read: Callable[[set[int]], tuple[float, float] | None] = cpu_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy: int | str | None = None  # None: torch's own setting, untouched
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
            range(os.cpu_count() or 1))
        self._last: _Reading | None = None
        self._read, self._clock = read, clock  # what auto reads: CPU seconds, wall clock

    def use(self, policy: int | str | None) -> None:
        """Run on ``policy`` threads: a count, ``auto``, or None to leave torch's setting alone."""
        self.policy, self._last = policy, None
        if policy is not None:
            torch.set_num_threads(len(self.cores) if policy == AUTO else policy)

    def before_step(self) -> None:
        """Under ``auto``, follow what the other processes left idle since the last reading."""
        if self.policy != AUTO:
            return
        at, last = self._clock(), self._last
        if last and at - last.at < READ_EVERY_S:
            return
        seconds = self._read(set(self.cores))
        now = self._last = None if seconds is None else _Reading(at, *seconds)
        if now is None or last is None or now.at <= last.at:
            return
        others = max(0.0, (now.busy_s - last.busy_s) - (now.own_s - last.own_s)) / (now.at - last.at)
        threads = threads_for(len(self.cores), others)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


CPU_THREADS = CpuThreads()
