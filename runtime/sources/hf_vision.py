"""The encoder part of an HF vision-language folder (LLaVA, Idefics3 / SmolVLM, Qwen2-VL) or audio-language folder
(Qwen2-Audio), written into an engine's ``vision/`` or ``audio/`` folder: its config, the encoder's tensors (tower
and projector, under the names transformers' inner model gives them) and the processor's files, all the runtime
(cabinllm.runtime.model.vision, cabinllm.runtime.model.audio) reads."""
from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.atomic import atomic_write_text
from cabinllm.runtime.model.audio import AUDIO_WEIGHTS
from cabinllm.runtime.model.families import AUDIO_FAMILIES, AUDIO_LANGUAGE, VISION_FAMILIES, VISION_LANGUAGE
from cabinllm.runtime.model.families.family import AudioFamily, VisionFamily
from cabinllm.runtime.model.vision import VISION_WEIGHTS
from cabinllm.runtime.sources.hf import read_json

# what AutoProcessor reads besides config.json
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja",
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# where transformers 5 (first) and 4 keep the encoder tensors of these models
INNER_PREFIXES = ("model.", "")


def _architecture(source: Path) -> str | None:
    config = source / "config.json"
    return (read_json(config).get("architectures") or [None])[0] if source.is_dir() and config.is_file() else None


def is_vision_folder(source: Path) -> bool:
    """Whether ``source`` is an HF folder of a vision-language model whose vision part CabinLLM runs."""
    return _architecture(source) in VISION_LANGUAGE


def is_audio_folder(source: Path) -> bool:
    """Whether ``source`` is an HF folder of an audio-language model whose audio part CabinLLM runs."""
    return _architecture(source) in AUDIO_LANGUAGE


def export_encoder(source: Path, output: Path) -> dict:
    """Write ``source``'s vision or audio part into ``output``; returns the manifest's
    record of it (family, tensors, bytes)."""
    from safetensors.torch import save_file

    family = _family(source)
    tensors = {inner: handle.get_tensor(name) for handle, name, inner in _vision_tensors(source, family)}
    if not tensors:
        raise CheckpointError(f"{source}: no encoder tensors (names starting {' or '.join(family.prefixes)}); is "
                              "the folder complete?")
    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output / (AUDIO_WEIGHTS if isinstance(family, AudioFamily) else VISION_WEIGHTS)))
    atomic_write_text(output / "config.json", (source / "config.json").read_text(encoding="utf-8"))
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, output / name)
    if not any((output / name).is_file() for name in PROCESSOR_FILES[:2]):
        raise CheckpointError(f"{source}: no preprocessor_config.json or processor_config.json; save the model's "
                              "processor into the folder (AutoProcessor.from_pretrained(...).save_pretrained(folder))")
    return {"family": family.model_type, "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def encoder_parameters(source: Path) -> int:
    """Parameters of the folder's vision (or audio) tower and projector, from the safetensors headers."""
    return sum(math.prod(handle.get_slice(name).get_shape()) for handle, name, _ in _vision_tensors(source,
                                                                                                   _family(source)))


def _family(source: Path) -> VisionFamily | AudioFamily:
    """The vision or audio family of an HF folder's config; CheckpointError for one CabinLLM does not run."""
    config = read_json(source / "config.json")
    families = {**VISION_FAMILIES, **AUDIO_FAMILIES}
    family = families.get(config.get("model_type"))
    if family is None:
        raise CheckpointError(f"{source}: vision or audio family {config.get('model_type')!r} is not supported; "
                              f"supported: {', '.join(families)}")
    return family


def _vision_tensors(source: Path, family: VisionFamily | AudioFamily) -> Iterator[tuple[object, str, str]]:
    """(open safetensors file, name, inner name) of each vision (or audio) tensor of the folder."""
    from safetensors import safe_open

    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                inner = _inner_name(name, family.prefixes)
                if inner is not None:
                    yield handle, name, inner


def _inner_name(name: str, prefixes: tuple[str, ...]) -> str | None:
    """A tensor's name in transformers' inner model where it belongs to the encoder part, else None."""
    for outer in INNER_PREFIXES:
        inner = name[len(outer):] if name.startswith(outer) else None
        if inner is not None and inner.startswith(prefixes):
            return inner
    return None
