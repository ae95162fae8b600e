"""Build a reference engine folder: import the model, attach INT8 KV scales, write the manifest.

Everything is written into a temporary folder beside the output and renamed at
the end, so a failed build leaves nothing half-made.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from builders.default_model import default_gguf_path
from builders.importer import import_model
from builders.quick_scales import quick_kv_scales
from runtime.atomic import staging_folder
from runtime.checkpoint import CheckpointError, layer_prefix, load_checkpoint, save_checkpoint
from runtime.engine import CHECKPOINT_DIR, MANIFEST_FILE, SCALES_FILE
from runtime.kv_cache import KV_MODES, KVScales
from runtime.kv_scales import model_fingerprint, save_scales
from runtime.model import Transformer
from runtime.tokenizer import ChatTokenizer

ENGINE_FORMAT = "cabin-engine/1"


@dataclass
class BuildRequest:
    """What cabin-build was asked for."""

    model: str
    output: Path
    kv_cache: str = "int8"
    dtype: str = "float16"
    force: bool = False


def resolve_model(model: str) -> Path:
    """The model source path; ``default`` is the embedded SmolLM2-135M-Instruct GGUF."""
    path = default_gguf_path() if model == "default" else Path(model)
    if not path.exists():
        raise CheckpointError(f"{path}: no such model file or folder; give a .gguf file, an HF folder or 'default'")
    return path


def build_engine(request: BuildRequest, log=print) -> Path:
    """Write the engine folder for a request and return its path."""
    if request.kv_cache not in KV_MODES:
        raise ValueError(f"unknown --kv-cache {request.kv_cache!r}; choose one of {', '.join(KV_MODES)}")
    if request.output.exists() and not request.force:
        raise FileExistsError(f"{request.output} already exists; choose another --output or pass --force to replace it")
    source = resolve_model(request.model)
    started = time.perf_counter()
    with staging_folder(request.output) as tmp:
        log(f"[1/3] importing {source.name} -> TensorRT-LLM checkpoint ({request.dtype})")
        checkpoint = tmp / CHECKPOINT_DIR
        checkpoint.mkdir()
        import_model(source, checkpoint, dtype=request.dtype)
        config, weights = load_checkpoint(checkpoint)
        fingerprint = model_fingerprint(config, weights)
        log("[2/3] measuring quick INT8 KV scales on built-in sample dialogues")
        scales = quick_kv_scales(Transformer(config, weights), ChatTokenizer(checkpoint))
        save_scales(tmp / SCALES_FILE, scales, fingerprint, "quick-max", {"source": "builtin samples"})
        if request.kv_cache.startswith("int8"):
            attach_int8_kv(config, weights, scales)
            save_checkpoint(checkpoint, config, weights)
        log("[3/3] writing manifest")
        manifest = {
            "format": ENGINE_FORMAT,
            "backend": "reference",
            "model": {"source": str(source), "architecture": config.architecture, "fingerprint": fingerprint},
            "kv_cache": request.kv_cache,
            "kv_scales": {"file": SCALES_FILE, "method": "quick-max"},
            "build_command": " ".join(sys.argv),
            "build_seconds": round(time.perf_counter() - started, 2),
            "versions": tool_versions(),
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    log(f"engine written to {request.output}")
    return request.output


def attach_int8_kv(config, weights: dict[str, torch.Tensor], scales: KVScales) -> None:
    """Mark the checkpoint INT8-KV and store each layer's shared scale as TensorRT-LLM reads it."""
    config.quantization = {**config.quantization, "kv_cache_quant_algo": "INT8"}
    for layer, scale in enumerate(scales.shared()):
        weights[f"{layer_prefix(layer)}.attention.kv_cache_scaling_factor"] = torch.tensor([scale], dtype=torch.float32)


def tool_versions() -> dict[str, str]:
    """Versions of Python and of every package the build used."""
    versions = {"python": platform.python_version()}
    for package in ("cabinllm", "torch", "transformers", "gguf", "safetensors", "tokenizers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions
