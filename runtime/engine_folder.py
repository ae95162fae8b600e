"""The engine folder cabin-build writes and the runtime reads: its layout and its manifest.

Layout::

    engines/NAME/
      manifest.json        what was built, from what, with which tools, and the plan
      checkpoint/          TensorRT-LLM checkpoint (config.json, rank0.safetensors) + tokenizer files
      kv_scales.json       the static INT8 KV scales the checkpoint carries
      trt_engine/          the TensorRT engine, where trtllm-build ran (+ trtllm-build.log)

A folder is replaced as a whole (runtime.atomic.staging_folder), never left half-written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.checkpoint import CONFIG_FILE, CheckpointError, ModelConfig

ENGINE_FORMAT = "cabin-engine/2"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = "checkpoint"
SCALES_FILE = "kv_scales.json"
TRT_ENGINE_DIR = "trt_engine"
TRTLLM_LOG_FILE = "trtllm-build.log"


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None when it has none or it is unreadable."""
    try:
        return json.loads((Path(folder) / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class EngineFolder:
    """An engine folder on disk, read without loading its weights."""

    path: Path

    @property
    def checkpoint(self) -> Path:
        """The TensorRT-LLM checkpoint with its tokenizer files."""
        return self.path / CHECKPOINT_DIR

    @property
    def scales(self) -> Path:
        """The KV scales file (it may be absent)."""
        return self.path / SCALES_FILE

    @property
    def trt_engine(self) -> Path:
        """The TensorRT engine folder (present where trtllm-build ran)."""
        return self.path / TRT_ENGINE_DIR

    def manifest(self) -> dict:
        """The manifest; CheckpointError when the folder has no readable one."""
        manifest = read_manifest(self.path)
        if manifest is None:
            raise CheckpointError(f"{self.path / MANIFEST_FILE}: not found or unreadable; build an engine first "
                                  "with cabin-build")
        return manifest

    def config(self) -> ModelConfig:
        """The checkpoint's config.json."""
        path = self.checkpoint / CONFIG_FILE
        try:
            return ModelConfig.from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))
        except (OSError, ValueError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(f"{path}: unreadable ({err}); rebuild the engine with cabin-build") from err
