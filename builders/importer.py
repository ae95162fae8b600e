"""Import a model (GGUF file or HF folder) into a TensorRT-LLM checkpoint folder with its tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from builders.gguf_import import open_gguf
from builders.hf_import import open_hf_folder
from builders.tokenizer_export import export_tokenizer
from builders.weight_plan import iter_weights
from runtime.checkpoint import CheckpointError, ModelConfig, save_checkpoint

DTYPES = {"float16": torch.float16, "float32": torch.float32}


def import_model(source: str | Path, output_dir: Path, dtype: str = "float16") -> ModelConfig:
    """Write config.json, rank0.safetensors and tokenizer files for a .gguf file or HF folder into ``output_dir``."""
    source, output_dir = Path(source), Path(output_dir)
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if not source.exists():
        raise CheckpointError(f"{source}: not found; pass a .gguf file or an HF model folder")
    model = open_hf_folder(source) if source.is_dir() else open_gguf(source)
    model.config.dtype = dtype
    export_tokenizer(source, output_dir)  # before the long conversion, so a bad tokenizer fails fast
    tensors = iter_weights(model)
    progress = tqdm(tensors, total=len(model.plan), desc=f"importing {source.name}", unit="tensor", disable=None)
    weights = {name: tensor.to(DTYPES[dtype]) for name, tensor in progress}
    save_checkpoint(output_dir, model.config, weights)
    return model.config
