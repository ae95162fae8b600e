"""What an engine folder was built from: the inputs record (for the no-op check) and tool versions.

The folder's layout and manifest file are cabinllm.runtime.formats.engine_folder's."""
from __future__ import annotations

import hashlib
import platform
from importlib import metadata
from pathlib import Path

_PACKAGES = ("cabinllm", "torch", "transformers", "gguf", "safetensors", "tokenizers")


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_identity(path: Path) -> list[list]:
    """Name, size and modification time of the model's files (a folder's top-level files, or the one file).

    Cheap enough for multi-GB models; any rewrite of a file changes it.
    """
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def tool_versions(trtllm_version: str | None) -> dict[str, str]:
    """Versions of Python, of every package the build used and of TensorRT-LLM (or 'not installed')."""
    versions = {"python": platform.python_version()}
    for package in _PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    versions["tensorrt_llm"] = trtllm_version or "not installed"
    return versions


def changed_inputs(old: dict, new: dict) -> list[str]:
    """Names of the inputs that differ between two inputs records."""
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
