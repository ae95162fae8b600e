"""A model's shapes without its weights: planning needs the config, not the tensors.

Accepts ``default`` (the embedded GGUF), a ``.gguf`` file, an HF model folder, a bare
HF ``config.json`` (a model not downloaded yet) or a TensorRT-LLM checkpoint.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

from builders.default_model import default_gguf_path
from builders.gguf_import import config_from_gguf, read_gguf
from builders.hf_import import read_json
from builders.hf_names import config_from_hf
from runtime.checkpoint import CheckpointError, ModelConfig


def resolve_model(model: str) -> Path:
    """The model source path; ``default`` is the embedded SmolLM2-135M-Instruct GGUF."""
    path = default_gguf_path() if model == "default" else Path(model)
    if not path.exists():
        raise CheckpointError(f"{path}: no such model file or folder; give 'default', a .gguf file, "
                              "an HF model folder or its config.json")
    return path


def config_from_json(path: Path) -> ModelConfig:
    """An HF ``config.json`` or a TensorRT-LLM checkpoint ``config.json``."""
    data = read_json(path)
    if "architecture" in data:  # TensorRT-LLM checkpoint config
        return ModelConfig.from_dict(data, str(path))
    return config_from_hf(data, str(path))


def load_model_config(model: str) -> ModelConfig:
    """The ModelConfig of a model given as on the command line."""
    if model == "default":
        return copy.deepcopy(_default_config())
    path = resolve_model(model)
    if path.is_dir():
        return config_from_json(path / "config.json")
    if path.suffix == ".json":
        return config_from_json(path)
    return config_from_gguf(read_gguf(path), path)


@lru_cache(maxsize=1)
def _default_config() -> ModelConfig:
    """The packaged default model's config, read once (parsing its GGUF metadata takes seconds)."""
    path = default_gguf_path()
    return config_from_gguf(read_gguf(path), path)
