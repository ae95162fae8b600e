"""The engine folder cabin-build writes and the runtime reads: its layout and its manifest.

Layout::

    engines/NAME/
      manifest.json        what was built, from what, with which tools, and the plan
      checkpoint/          TensorRT-LLM checkpoint (config.json, rank0.safetensors) + tokenizer files
      kv_scales.json       the static INT8 KV scales the checkpoint carries
      trt_engine/          the TensorRT engine, where trtllm-build ran (+ trtllm-build.log)

A folder is replaced as a whole (cabinllm.runtime.formats.atomic.staging_folder), never left half-written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import CONFIG_FILE, REBUILD, ModelConfig, load_checkpoint
from cabinllm.runtime.formats.scales_file import model_fingerprint

ENGINE_FORMAT = "cabin-engine/2"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = "checkpoint"
SCALES_FILE = "kv_scales.json"
TRT_ENGINE_DIR = "trt_engine"
TRTLLM_LOG_FILE = "trtllm-build.log"
# the plan's record of the model in the manifest (cabinllm.builders.planner.Plan.to_json) -> ModelConfig keys
_PLANNED_MODEL_KEYS = {"layers": "num_hidden_layers", "kv_heads": "num_key_value_heads", "head_size": "head_size",
                       "context": "max_position_embeddings"}


def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest, or None when it has none or it is unreadable."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _section(manifest: dict, key: str) -> dict:
    """One object of the manifest ({} when it is absent or not an object)."""
    value = manifest.get(key)
    return value if isinstance(value, dict) else {}


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

    def system_prompt(self) -> str | None:
        """The default system prompt the engine was built with, or None."""
        prompt = self.manifest().get("system_prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise CheckpointError(f"{self.path / MANIFEST_FILE}: system_prompt is not text; {REBUILD}")
        return prompt or None

    def config(self) -> ModelConfig:
        """The checkpoint's config.json."""
        path = self.checkpoint / CONFIG_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: unreadable ({err}); rebuild the engine with cabin-build") from err
        return ModelConfig.from_dict(data, str(path))

    def load_checkpoint(self) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
        """The checkpoint's config, weights and model fingerprint; CheckpointError naming what differs when they
        are not the model the manifest says was built."""
        manifest, config_path = self.manifest(), self.checkpoint / CONFIG_FILE
        model, planned = _section(manifest, "model"), _section(_section(manifest, "plan"), "model")
        config = self.config()
        built = {"architecture": model.get("architecture"),
                 **{key: planned.get(plan_key) for plan_key, key in _PLANNED_MODEL_KEYS.items()}}
        for key, value in built.items():
            if value is not None and value != getattr(config, key):
                raise CheckpointError(f"{config_path}: {key} is {json.dumps(getattr(config, key))} but this engine "
                                      f"was built with {json.dumps(value)} ({MANIFEST_FILE}); the folder was edited "
                                      f"or mixed with another engine's files, {REBUILD}")
        config, weights = load_checkpoint(self.checkpoint)
        fingerprint = model_fingerprint(config, weights)
        if fingerprint != model.get("fingerprint"):
            raise CheckpointError(f"{self.checkpoint}: holds model {fingerprint} but {MANIFEST_FILE} says this engine "
                                  f"was built from model {model.get('fingerprint')}; its config or weights were "
                                  f"changed or come from another engine, {REBUILD}")
        return config, weights, fingerprint
