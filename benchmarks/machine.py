"""The machine a benchmark ran on: CPU model, cores, load, library versions and threads."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

import torch

from cabinllm.runtime.kernels.bindings import compiler

PACKAGES = ("torch", "transformers", "llama-cpp-python", "hqq", "optimum-quanto")


CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the platform's processor string elsewhere)."""
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def package_versions() -> dict[str, str | None]:
    """Installed version of each benchmarked package, None where it is missing."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def c_compiler() -> str | None:
    """The first line of ``$CC --version`` (the compiler of the native decode kernels), None without one."""
    try:
        result = subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else None


READ_BUFFER_BYTES = 1 << 30  # larger than any CPU's last-level cache


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second one read of a 1 GiB buffer (a STREAM-like sum) streams on ``threads`` threads, the best of
    ``repeats``: the ceiling a bandwidth-bound decode step can reach."""
    before = torch.get_num_threads()
    buffer = torch.ones(READ_BUFFER_BYTES // 4)
    torch.set_num_threads(threads)
    try:
        buffer.sum()  # pages touched, threads started
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return READ_BUFFER_BYTES / best


def machine_info() -> dict:
    """What the results depend on besides the code: CPU, cores, load average, versions, torch threads."""
    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "c_compiler": c_compiler(),
        "versions": package_versions(),
    }


def oversubscribed(info: dict) -> str | None:
    """A warning when torch runs more threads than the cores the load average left idle, else None.

    Each parallel op then waits for a worker that has no core, which costs a runner with many short ops per
    decoded token far more than its own work: with 2,048 tokens of context on 2 cores, one of them busy,
    cabin int8 / transformers dynamic ranged from 0.06x to 1.12x between repeats with 2 threads, and
    was 1.15-1.18x with 1.
    """
    load = info.get("load_average_1m")
    if load is None or not info.get("cores"):
        return None
    idle = max(1, round(info["cores"] - load))
    if info["torch_threads"] <= idle:
        return None
    return (f"torch ran {info['torch_threads']} threads on {info['cores']} cores with a load average of {load:.2f} "
            f"at the start (about {idle} idle): the timings are dominated by threads waiting for a core; "
            f"rerun with --threads {idle}")
