"""Random-weight vision-language models (LLaVA, Idefics3, Qwen2-VL) saved as complete offline HF folders: tiny ones
for the tests, one of a real model's shape for the benchmarks. Random weights prove mechanics and measure speed and
memory, never answers.

``write_random_vlm(folder, family)`` writes what a Hub folder holds: ``config.json`` and ``model.safetensors`` (a
randomly initialised transformers model, ``save_pretrained``), the tokenizer (``tokenizer.json``,
``tokenizer_config.json`` with ``chat_template`` and ``stop_token_ids``) and the processor's files
(``preprocessor_config.json``, ``processor_config.json``), so that ``AutoProcessor.from_pretrained(folder)`` and
``AutoModelForImageTextToText.from_pretrained(folder)`` work from the folder alone.

The tiny shapes follow transformers' own model tests (tests/models/<family>/test_modeling_<family>.py), adjusted
where a test needs it: a context of 4096 positions (several pictures in one dialogue), SwiGLU (silu) text MLPs
whose intermediate size is a multiple of 32 (grouped quantization), and an image size giving a few image tokens.
``SHAPES["smolvlm-256m"]`` is SmolVLM-256M-Instruct's: a SigLIP-B/16 tower at 512 px (64 tokens a tile after the
pixel shuffle by 4, tiles of 512 px up to a 2048 px longest edge) on SmolLM2-135M's text shape. The tokenizer is a
byte-level BPE without merges (every byte is a token, so any text encodes) or a given ``tokenizer.json`` (the
default model's, for the real shape), plus each processor's special tokens; the chat template is ChatML-like and
takes ``content`` as a string or as a list of OpenAI-style parts (``{"type": "text", "text": ...}``,
``{"type": "image"}``).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cabinllm.calibration.sources import open_source

FAMILIES = ("llava", "idefics3", "qwen2_vl")

MAX_POSITIONS = 4096
# tokens every family's tokenizer has, first (ids 0, 1, 2)
COMMON_SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
# Idefics3's processor names tiles <row_{i}_col_{j}> for grids up to 6 x 6
IDEFICS3_TILES = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]

FAMILY = {
    "llava": {
        "special": ["<image>"],
        "eos": "<|im_end|>",
        "placeholder": "<image>",
        "config": {
            "model_type": "llava",
            "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "image_seq_length": 16,
            "projector_hidden_act": "gelu", "tie_word_embeddings": False,
            "text_config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                            "hidden_act": "silu", "tie_word_embeddings": False},
            # CLIP: (32 / 8)^2 = 16 patches + CLS; "default" drops CLS -> 16 image tokens
            "vision_config": {"model_type": "clip_vision_model", "image_size": 32, "patch_size": 8,
                              "num_channels": 3, "hidden_size": 32, "projection_dim": 32, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 37},
        },
        "image_processor": {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
        "classes": ("LlavaProcessor", "LlavaImageProcessorPil"),
        "processor": {"patch_size": 8, "vision_feature_select_strategy": "default",
                      "num_additional_image_tokens": 1},
    },
    "idefics3": {
        "special": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *IDEFICS3_TILES],
        "eos": "<end_of_utterance>",
        "placeholder": "<image>",
        "config": {
            "model_type": "idefics3",
            "scale_factor": 2, "tie_word_embeddings": False,
            "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 64,
                            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
                            "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
            # tiles of 16 px, patches of 4: (16 / 4)^2 = 16 patches, pixel-shuffled by 2 -> 4 tokens a tile
            "vision_config": {"image_size": 16, "patch_size": 4, "hidden_size": 32, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 32},
        },
        # the longest edge is resized to 32 and split in 16 px tiles: up to 2 x 2 tiles + the global image
        "image_processor": {"size": {"longest_edge": 32}, "max_image_size": {"longest_edge": 16},
                            "do_image_splitting": True},
        "classes": ("Idefics3Processor", "Idefics3ImageProcessorPil"),
        "processor": {"image_seq_len": 4},
    },
    "qwen2_vl": {
        "special": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
        "eos": "<|im_end|>",
        "placeholder": "<|vision_start|><|image_pad|><|vision_end|>",
        "config": {
            "model_type": "qwen2_vl",
            "tie_word_embeddings": False,
            # head size 8: M-RoPE sections (t, h, w) of 2 + 1 + 1 frequency pairs
            "text_config": {"model_type": "qwen2_vl_text", "hidden_size": 32, "intermediate_size": 64,
                            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "hidden_act": "silu", "max_window_layers": 3, "tie_word_embeddings": False,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [2, 1, 1]}},
            # its hidden_size is the merger's output: the text model's hidden size
            "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 32, "hidden_act": "quick_gelu",
                              "mlp_ratio": 4, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2},
        },
        # 56 x 56 to 112 x 112 pixels: 4 to 16 image tokens (one per 28 x 28 block)
        "image_processor": {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14,
                            "temporal_patch_size": 2, "merge_size": 2},
        "classes": ("Qwen2VLProcessor", "Qwen2VLImageProcessorPil"),
        "processor": {},
    },
}


def chat_template(placeholder: str, end_of_turn: str) -> str:
    """A ChatML-like template: ``<|im_start|>role\\n...`` closed by ``end_of_turn``; ``content`` a string or a list
    of parts, each image part rendered as ``placeholder``."""
    return (
        "{%- for m in messages -%}"
        "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
        "{%- if m['content'] is string -%}{{- m['content'] -}}"
        "{%- elif m['content'] is iterable -%}{%- for part in m['content'] -%}"
        "{%- if part['type'] in ('image', 'image_url') -%}{{- '" + placeholder + "' -}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '" + end_of_turn + "\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


# a real model's shape, or a picture size a study needs: (family, its config's changes, its image processor's, its
# processor's)
SHAPES = {
    "smolvlm-256m": ("idefics3", {
        "scale_factor": 4,
        "text_config": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
                        "rope_theta": 100000.0, "max_position_embeddings": 8192},
        "vision_config": {"image_size": 512, "patch_size": 16, "hidden_size": 768, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "intermediate_size": 3072}},
        # tiles of 512 px up to a 1024 px longest edge (SmolVLM's processor takes N x 512; the Hub's default N is 4)
        {"size": {"longest_edge": 1024}, "max_image_size": {"longest_edge": 512}}, {"image_seq_len": 64}),
    # tiny LLaVA whose pictures (64 px, 64 tokens) are several times a short text marker: media compaction's tests
    "llava-64": ("llava", {"image_seq_length": 64, "vision_config": {"image_size": 64}},
                 {"size": {"shortest_edge": 64}, "crop_size": {"height": 64, "width": 64}}, {}),
    # LLaVA-1.5's pictures (336 px, patch 14: 576 tokens) on a small text model (4 layers of 256, 2 KV heads of 64)
    # and a tiny tower: the media compaction study
    "llava-576": ("llava", {
        "image_seq_length": 576,
        "text_config": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2},
        "vision_config": {"image_size": 336, "patch_size": 14}},
        {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}, {"patch_size": 14}),
}


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A random RGB picture of ``width`` x ``height`` pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def picture_dialogues(folder: Path, count: int, size: tuple[int, int] = (96, 72), source: str = "builtin",
                      name: str = "dialogues.jsonl") -> Path:
    """Calibration data with pictures: the first ``count`` dialogues of ``source`` (cabinllm.calibration.sources) as a
    JSONL file in ``folder``, the first user message of each showing a random picture of ``size`` (a PNG beside it,
    sizes varying a little). Returns the file."""
    dialogues, _ = open_source(source)
    lines = []
    for i, dialogue in zip(range(count), dialogues):
        width, height = size[0] + 8 * (i % 4), size[1] + 6 * (i % 3)
        image(width, height, seed=100 + i).save(folder / f"picture-{i}.png")
        first = next(j for j, m in enumerate(dialogue.messages) if m["role"] == "user")
        messages = [{**m, "images": [f"picture-{i}.png"]} if j == first else m
                    for j, m in enumerate(dialogue.messages)]
        lines.append(json.dumps({"id": dialogue.id, "messages": messages}, ensure_ascii=False) + "\n")
    (folder / name).write_text("".join(lines), encoding="utf-8")
    return folder / name


def _tokenizer(family: str, tokenizer_json: Path | None = None):
    """The family's special tokens on a byte-level tokenizer (no merges: one token a byte), or on the tokenizer of
    ``tokenizer_json``, as transformers' fast tokenizer."""
    spec = FAMILY[family]
    return byte_tokenizer(spec["special"], spec["eos"], chat_template(spec["placeholder"], spec["eos"]),
                          tokenizer_json)


def byte_tokenizer(extra_special: list[str], eos: str, template: str, tokenizer_json: Path | None = None):
    """``COMMON_SPECIAL`` and ``extra_special`` on a byte-level tokenizer (no merges: one token a byte), or on the
    tokenizer of ``tokenizer_json``, as transformers' fast tokenizer with ``template`` as its chat template."""
    import transformers

    special = COMMON_SPECIAL + extra_special
    if tokenizer_json is None:
        vocab = {token: i for i, token in enumerate(special + sorted(pre_tokenizers.ByteLevel.alphabet()))}
        tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
    else:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.add_special_tokens(special)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos, pad_token="<pad>", bos_token=None, unk_token=None,
        padding_side="left", model_max_length=MAX_POSITIONS, chat_template=template)


def _write_processor(folder: Path, family: str, tokenizer, images_changes: dict, processor_changes: dict) -> None:
    """Save the family's processor (tokenizer included; its settings with the shape's changes) into ``folder``,
    with ``preprocessor_config.json`` as Hub folders have it. PIL image processors: no torchvision needed."""
    import transformers

    spec = FAMILY[family]
    processor_class, image_processor_class = spec["classes"]
    images = getattr(transformers, image_processor_class)(**{**spec["image_processor"], **images_changes})
    if family == "qwen2_vl":
        # transformers 5 builds a Qwen2VLProcessor only where torchvision is (its video processor needs it): write
        # what the Hub's Qwen2-VL folders hold, from which AutoProcessor infers the video processor
        tokenizer.save_pretrained(folder)
        (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=2),
                                                      encoding="utf-8")
    else:
        processor = getattr(transformers, processor_class)(images, tokenizer, chat_template=tokenizer.chat_template,
                                                           **{**spec["processor"], **processor_changes})
        processor.save_pretrained(folder)
    images.save_pretrained(folder)


def _config(family: str, tokenizer, changes: dict):
    """The family's transformers config with the shape's ``changes``, its token ids those of ``tokenizer``."""
    import transformers

    ids = tokenizer.convert_tokens_to_ids
    data = json.loads(json.dumps(FAMILY[family]["config"]))
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    text = data["text_config"]
    text.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id)
    text.setdefault("max_position_embeddings", MAX_POSITIONS)
    if family == "llava":
        data["image_token_index"] = ids("<image>")
    elif family == "idefics3":
        data.update(image_token_id=ids("<image>"), pad_token_id=tokenizer.pad_token_id)
    else:
        data.update(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                    vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    model_type = data.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **data)


def write_random_vlm(folder: Path, name: str, seed: int = 0, tokenizer_json: Path | None = None) -> Path:
    """Write a random model into ``folder`` as an HF folder (weights, tokenizer, processor): ``name`` a family of
    ``FAMILIES`` (its tiny shape) or a shape of ``SHAPES``; ``tokenizer_json`` the text tokenizer (default: bytes).
    Returns ``folder``."""
    import transformers

    if name not in FAMILY and name not in SHAPES:
        raise ValueError(f"unknown model {name!r}; one of {', '.join([*FAMILIES, *SHAPES])}")
    family, config_changes, images_changes, processor_changes = SHAPES.get(name, (name, {}, {}, {}))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(family, tokenizer_json)
    config = _config(family, tokenizer, config_changes)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model.save_pretrained(folder)
    _write_processor(folder, family, tokenizer, images_changes, processor_changes)
    path = folder / "tokenizer_config.json"
    tok_config = json.loads(path.read_text(encoding="utf-8"))
    tok_config.update(chat_template=tokenizer.chat_template, stop_token_ids=[tokenizer.eos_token_id],
                      processor_class=FAMILY[family]["classes"][0])
    path.write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    return folder
