"""Imported GGUF models kept in the user cache, keyed by the file's content, so that only the first
command on a machine pays for parsing and dequantizing the GGUF.

A cached import is a float32 TensorRT-LLM checkpoint with its tokenizer files, in
``$CABIN_CACHE_DIR/imports/STEM-FINGERPRINT/`` (default ``~/.cache/cabinllm``), written atomically:
a killed import leaves no folder that looks complete. Delete the folder to drop it.
"""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Callable

from cabinllm.runtime.formats.atomic import staging_folder
from cabinllm.runtime.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE

CACHE_ENV = "CABIN_CACHE_DIR"
_CHUNK = 1 << 20


def cache_root() -> Path:
    """The user cache folder of CabinLLM (``$CABIN_CACHE_DIR``, else ``~/.cache/cabinllm``)."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "cabinllm"))


def file_fingerprint(path: Path) -> str:
    """SHA-256 of a file's content (16 hex digits), computed once per process for a given size and mtime."""
    stat = path.stat()
    return _hash_file(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _hash_file(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()[:16]


def cached_import_folder(source: Path) -> Path:
    """Where the import of this GGUF file lives in the cache (it may not exist yet)."""
    return cache_root() / "imports" / f"{source.stem}-{file_fingerprint(source)}"


def is_complete(folder: Path) -> bool:
    """Whether a cached import folder holds a checkpoint (staging makes a folder appear only when whole)."""
    return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()


def cached_import(source: Path, write: Callable[[Path], None]) -> Path:
    """The cached float32 import of a GGUF file; ``write(folder)`` makes it on the first call."""
    folder = cached_import_folder(source)
    if not is_complete(folder):
        with staging_folder(folder) as staging:
            write(staging)
    return folder
