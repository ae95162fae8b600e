"""The model a calibration or evaluation runs on: ``default``, an engine folder, a checkpoint folder or a model to import."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.checkpoint import CONFIG_FILE, WEIGHTS_FILE, ModelConfig, load_checkpoint
from runtime.engine import CHECKPOINT_DIR, MANIFEST_FILE, SCALES_FILE
from runtime.kv_scales import model_fingerprint
from runtime.model import Transformer
from runtime.tokenizer import ChatTokenizer


@dataclass
class LoadedModel:
    """Config, weights and tokenizer of a model, and the engine's scales file if it has one."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    fingerprint: str
    scales_path: Path | None = None

    def transformer(self) -> Transformer:
        """The reference forward pass over these weights."""
        return Transformer(self.config, self.weights)


def _from_checkpoint(name: str, folder: Path, scales_path: Path | None) -> LoadedModel:
    config, weights = load_checkpoint(folder)
    return LoadedModel(name, config, weights, ChatTokenizer(folder), model_fingerprint(config, weights),
                       scales_path if scales_path and scales_path.is_file() else None)


def load_model(spec: str) -> LoadedModel:
    """Load ``default`` (the embedded SmolLM2, imported in float32), an engine folder made by cabin-build,
    a TensorRT-LLM checkpoint folder, or a .gguf file / HF folder (imported in float32)."""
    path = Path(spec)
    if spec != "default" and (path / MANIFEST_FILE).is_file():
        return _from_checkpoint(spec, path / CHECKPOINT_DIR, path / SCALES_FILE)
    if spec != "default" and (path / CONFIG_FILE).is_file() and (path / "tokenizer_config.json").is_file() \
            and (path / WEIGHTS_FILE).is_file():
        return _from_checkpoint(spec, path, None)
    # Importing is the builders' job; imported here lazily so that calibration does not load them otherwise.
    from builders.engine_build import resolve_model
    from builders.importer import import_model

    source = resolve_model(spec)
    with tempfile.TemporaryDirectory(prefix="cabin-import-") as tmp:
        import_model(source, Path(tmp), dtype="float32")
        return _from_checkpoint(spec, Path(tmp), None)
