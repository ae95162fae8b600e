"""The machine a benchmark ran on: CPU model, cores, load, library versions and threads."""
from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "llama-cpp-python", "hqq", "optimum-quanto")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
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
        "versions": package_versions(),
    }
