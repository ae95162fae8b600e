"""What an engine folder was built from: the inputs record (for the no-op check), tool versions, the manifest file."""
from __future__ import annotations

import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path

from runtime.engine import MANIFEST_FILE

ENGINE_FORMAT = "cabin-engine/2"
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


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None when it has none or it is unreadable."""
    try:
        return json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def changed_inputs(old: dict, new: dict) -> list[str]:
    """Names of the inputs that differ between two inputs records."""
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
