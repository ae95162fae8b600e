"""The default model cut to its first decoder layers, for tests whose check is of the real model's widths (hidden
576, the 49152-row embedding and head, its tokenizer) and whose cost grows with the depth: a TensorRT-LLM checkpoint
folder, which cabin-build takes as a model like any other."""
from __future__ import annotations

import shutil
from pathlib import Path

from cabinllm.runtime.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE, layer_prefix, load_checkpoint, save_checkpoint
from cabinllm.runtime.sources.model_source import default_gguf_path, imported_gguf


def write_truncated_default(folder: Path, num_layers: int) -> Path:
    """Write the default model's first ``num_layers`` layers (its float32 import; every other tensor, the config
    but for num_hidden_layers, and the tokenizer files as imported) into ``folder`` and return it."""
    source = imported_gguf(default_gguf_path())  # the test run's user cache: imported once
    config, weights = load_checkpoint(source)
    assert 0 < num_layers < config.num_hidden_layers
    dropped = tuple(f"{layer_prefix(layer)}." for layer in range(num_layers, config.num_hidden_layers))
    config.num_hidden_layers = num_layers
    folder.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copy2(item, folder / item.name)
    save_checkpoint(folder, config, {name: t for name, t in weights.items() if not name.startswith(dropped)})
    return folder
