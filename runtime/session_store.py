"""The session file: the K/V of a dialogue's tokens and a JSON header, in one safetensors file.

K/V are kept in their stored form (int8 codes stay int8); the header holds the conversation
and the fingerprints of the model and of the static KV scales. The write is atomic: a crash
mid-save leaves the previous save in place, and a file cut short fails to parse and is
reported as such. ``runtime.session`` decides what goes in and checks what comes out.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from runtime.atomic import atomic_write_bytes
from runtime.dialogue import SessionFileError

SESSION_FORMAT = "cabin-session/2"  # 2: the KV cache config as one object


def write_session_file(path: str | Path, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write a header and tensors to path atomically."""
    header = {"format": SESSION_FORMAT, **header}
    atomic_write_bytes(Path(path), save(tensors, metadata={"session": json.dumps(header, ensure_ascii=False)}))


def read_session_file(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of a session file; SessionFileError when it is not a complete one."""
    path = Path(path)
    try:
        blob = path.read_bytes()
        tensors = load(blob)
        header = json.loads(_metadata(blob)["session"])
    except (OSError, SafetensorError, ValueError, KeyError) as err:
        raise SessionFileError(f"{path}: not a complete session file ({err}); it may have been cut short, "
                               "use an earlier save") from err
    if header.get("format") != SESSION_FORMAT:
        raise SessionFileError(f"{path}: format {header.get('format')!r}, expected {SESSION_FORMAT}")
    return header, tensors


def _metadata(blob: bytes) -> dict:
    """The string metadata of a safetensors blob."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + size])["__metadata__"]
