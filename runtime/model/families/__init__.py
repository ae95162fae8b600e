"""The model families, one file each: what a family differs in (``Family``: names, config map, norms, RoPE,
windows, scales, biases, TensorRT-LLM lines, transformers reference), the vision hookup of the vision-language
ones (``VisionLanguage``) and the audio hookup of the audio-language ones (``AudioLanguage``). Every reader of
family facts looks them up here; importing this package registers each family's checkpoint architecture with
cabinllm.runtime.formats.checkpoint.

Adding a family: its file here (a ``FAMILIES`` tuple of ``Family``) and its name in ``_TEXT`` below.
"""
from __future__ import annotations

from cabinllm.runtime.formats.checkpoint import register_architecture
from cabinllm.runtime.model.families import (gemma3, idefics3, llama, llava, phi3, qwen2, qwen2_audio, qwen2_vl, qwen3,
                                             smollm3)
from cabinllm.runtime.model.families.family import AudioFamily, AudioLanguage, Family, VisionFamily, VisionLanguage

_TEXT = (llama, qwen2, qwen3, gemma3, phi3, smollm3)
FAMILIES: dict[str, Family] = {family.architecture: family for module in _TEXT for family in module.FAMILIES}
VISION_LANGUAGE: dict[str, VisionLanguage] = {
    module.VISION_LANGUAGE.architecture: module.VISION_LANGUAGE for module in (llava, idefics3, qwen2_vl)}
VISION_FAMILIES: dict[str, VisionFamily] = {vl.vision.model_type: vl.vision for vl in VISION_LANGUAGE.values()}
AUDIO_LANGUAGE: dict[str, AudioLanguage] = {
    module.AUDIO_LANGUAGE.architecture: module.AUDIO_LANGUAGE for module in (qwen2_audio,)}
AUDIO_FAMILIES: dict[str, AudioFamily] = {al.audio.model_type: al.audio for al in AUDIO_LANGUAGE.values()}
# every family whose HF folder holds a text model beside an encoder (the importer reads its text model)
MEDIA_LANGUAGE: dict[str, VisionLanguage | AudioLanguage] = {**VISION_LANGUAGE, **AUDIO_LANGUAGE}

for _family in FAMILIES.values():
    register_architecture(_family.checkpoint)


def family(architecture: str) -> Family | None:
    """The family of a checkpoint architecture, or None."""
    return FAMILIES.get(architecture)


def hf_family(architecture: str | None) -> Family | None:
    """The text family an HF config.json ``architectures`` entry imports as (its own name, or another it takes,
    e.g. Gemma 3's vision-language folder), or None."""
    return next((f for f in FAMILIES.values() if architecture == f.architecture or architecture in
                 f.hf_architectures), None)


def vision_text_types() -> dict[str, str]:
    """The text model_types a vision- or audio-language folder's text model may have -> the architecture it imports
    as."""
    types = {model_type: f.architecture for f in FAMILIES.values() if f.vision_text for model_type in f.model_types}
    by_type = {model_type: f.architecture for f in FAMILIES.values() for model_type in f.model_types}
    for vl in MEDIA_LANGUAGE.values():
        types |= {alias: by_type[target] for alias, target in vl.text_aliases.items()}
    return types
