"""Open an HF model folder (config.json + *.safetensors, sharded or not) for import."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.sources.hf_names import config_from_hf, source_names
from cabinllm.runtime.model.families.family import SourceNames
from cabinllm.runtime.sources.weight_plan import SourceModel, check_plan, weight_plan

INDEX_FILE = "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    """A JSON file's content; CheckpointError naming the file when it is absent or not JSON."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; point to a complete HF model folder")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); re-download it") from err


def _weight_files(folder: Path) -> tuple[list[Path], str]:
    """The safetensors files to read and how to name them in errors (the index, or the single file)."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map", {})
        return [folder / name for name in sorted(set(weight_map.values()))], str(index_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder}: no *.safetensors files; save the model with save_pretrained(safe_serialization=True)"
        )
    return files, str(files[0]) if len(files) == 1 else str(folder)


# where a vision-language folder keeps its text model's "model." tensors: transformers 4 and 5 (Idefics3: text_model)
TEXT_MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "model.text_model.")


def _text_model_names(names: SourceNames, shapes: dict) -> SourceNames:
    """``names`` as the folder has them: under a vision-language model's text-model prefix where it uses one (the
    vision tower is not imported)."""
    if names.embedding in shapes:
        return names
    for prefix in TEXT_MODEL_PREFIXES:
        if names.embedding.replace("model.", prefix, 1) in shapes:
            names = dataclasses.replace(names, **{
                f.name: getattr(names, f.name).replace("model.", prefix, 1) for f in dataclasses.fields(names)
                if isinstance(getattr(names, f.name), str)})
            head = f"language_model.{names.lm_head}"  # transformers 4 keeps the head inside the text model too
            return dataclasses.replace(names, lm_head=head) if head in shapes else names
    return names


def open_hf_folder(folder: Path) -> SourceModel:
    """Read config.json and the safetensors headers, check every needed tensor, and return a loader."""
    from safetensors import SafetensorError, safe_open

    config_path = folder / "config.json"
    config = config_from_hf(read_json(config_path), str(config_path))
    files, source = _weight_files(folder)
    handles, shapes = {}, {}
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"{path}: not found but listed in {INDEX_FILE}; the download is incomplete")
        try:
            handle = safe_open(str(path), framework="pt")
            for name in handle.keys():
                handles[name] = handle
                shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"{path}: unreadable safetensors file ({err}); it may be truncated, download it again"
            ) from err
    plan = weight_plan(config, _text_model_names(source_names(config.architecture), shapes))
    check_plan(plan, shapes, source)

    def load(name: str) -> torch.Tensor:
        return handles[name].get_tensor(name)

    return SourceModel(config, plan, load)
