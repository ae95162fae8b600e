"""What a model family differs in (``Family``), its HF tensor names (``SourceNames``), the vision hookup of a
vision-language family (``VisionFamily``, ``VisionLanguage``), the audio hookup of an audio-language family
(``AudioFamily``, ``AudioLanguage``), and the HF config readers the family files share.

A family file (``llama.py``, ``qwen2.py``, ...) fills these in; ``cabinllm.runtime.model.families`` is the registry
every importer, the checkpoint writer, the reference forward pass, the ONNX graph writer, the planner and
calibration's transformers reference read them from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from cabinllm.runtime.formats.checkpoint import CheckpointArchitecture, ModelConfig
from cabinllm.runtime.model.rope import scaling_kind


@dataclass(frozen=True)
class SourceNames:
    """Weight names of a source format; ``{l}`` stands for the layer index.

    Biases (Qwen2's q/k/v) are named like the weight with ``.weight`` -> ``.bias``.
    """

    embedding: str
    final_norm: str
    lm_head: str
    input_norm: str
    post_norm: str
    q: str
    k: str
    v: str
    dense: str
    mlp_gate: str  # the activated branch (HF gate_proj) -> mlp.fc
    mlp_up: str  # HF up_proj -> mlp.gate
    mlp_down: str  # -> mlp.proj
    q_norm: str = ""  # qk_layernorm models
    k_norm: str = ""
    pre_ff_norm: str = ""  # inter_layernorms models (Gemma 3)
    post_ff_norm: str = ""
    fused_qkv: bool = False  # ``q`` names one (q + k + v, hidden) tensor (Phi-3's qkv_proj)
    fused_gate_up: bool = False  # ``mlp_gate`` names one (2 x inter, hidden) tensor, gate rows first (gate_up_proj)
    norm_offset: float = 0.0  # Part.offset of every norm weight


# Llama's names, which every HF family starts from
HF_NAMES = SourceNames(
    embedding="model.embed_tokens.weight",
    final_norm="model.norm.weight",
    lm_head="lm_head.weight",
    input_norm="model.layers.{l}.input_layernorm.weight",
    post_norm="model.layers.{l}.post_attention_layernorm.weight",
    q="model.layers.{l}.self_attn.q_proj.weight",
    k="model.layers.{l}.self_attn.k_proj.weight",
    v="model.layers.{l}.self_attn.v_proj.weight",
    dense="model.layers.{l}.self_attn.o_proj.weight",
    mlp_gate="model.layers.{l}.mlp.gate_proj.weight",
    mlp_up="model.layers.{l}.mlp.up_proj.weight",
    mlp_down="model.layers.{l}.mlp.down_proj.weight",
)
QK_NORMS = dict(q_norm="model.layers.{l}.self_attn.q_norm.weight", k_norm="model.layers.{l}.self_attn.k_norm.weight")


@dataclass(frozen=True)
class Reference:
    """A family's transformers classes (calibration's reference model and ModelOpt's input), the config keys it
    adds to the common ones, and ModelOpt's ``decoder_type`` for its TensorRT-LLM export."""

    config_class: str
    model_class: str
    extra: Callable[[ModelConfig], dict] = lambda config: {}
    decoder: str = "llama"
    head_dim_key: bool = True  # the config class takes ``head_dim`` (Phi3Config does not)


def no_fields(data: dict, source: str) -> dict:
    """A family that adds no ModelConfig field to Llama's."""
    return {}


@dataclass(frozen=True)
class Family:
    """What one text family differs in from Llama.

    ``checkpoint`` is its TensorRT-LLM checkpoint architecture (the name the engines spell, the keys its model
    reads, its MLP's layout on disk); ``hf_architectures`` the config.json architectures that import as it;
    ``model_types`` its HF model_type; ``names`` its tensors' HF names; ``fields`` the ModelConfig fields it adds to
    Llama's, from the HF config dict (q/k norms, partial rotary, windows, scales, ...) which ``hf_config`` first
    completes where the family's files leave keys to transformers' defaults. ``trtllm`` maps each TensorRT-LLM
    flag set (``builders.trtllm``'s lines) that builds it to None and one that does not to why; a line it does not
    name does not build it.
    """

    checkpoint: CheckpointArchitecture
    model_types: tuple[str, ...]
    reference: Reference
    names: SourceNames = HF_NAMES
    hf_architectures: tuple[str, ...] = ()  # beside checkpoint.name (Gemma 3's vision-language folder)
    fields: Callable[[dict, str], dict] = no_fields
    hf_config: Callable[[dict], dict] | None = None
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)
    tied_by_default: bool = False  # tie_word_embeddings when config.json does not say
    sliding_window_by_default: bool = False  # use_sliding_window when config.json does not say
    windowed_layers: bool = False  # ``fields`` reads the sliding window into layers that run it (Gemma 3)
    vision_text: bool = False  # the text model of a vision-language folder (LLaVA, Idefics3, Qwen2-VL) may be it
    gguf_architecture: str | None = None  # llama.cpp's general.architecture
    gguf_permuted_qk: bool = False  # llama.cpp's converter permutes q/k rows (Llama's)
    trtllm: dict[str, str | None] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        """The checkpoint's architecture name (TensorRT-LLM's)."""
        return self.checkpoint.name


@dataclass(frozen=True)
class VisionFamily:
    """What one family's vision part differs in: the placeholder its processor expands (one per image in the
    rendered prompt), the processor outputs its ``get_image_features`` takes, its tensors' prefixes in an HF
    folder, and whether the decoder places image tokens on an M-RoPE grid; ``nested_images`` where its processor
    takes a list of pictures per prompt, ``feature_options`` the config keys its ``get_image_features`` takes, and
    ``low_detail`` the processor's images_kwargs for OpenAI's detail "low"."""

    model_type: str
    placeholder_key: str  # the processor's attribute holding the placeholder text
    feature_inputs: tuple[str, ...]
    prefixes: tuple[str, ...]
    mrope: bool = False
    nested_images: bool = False
    feature_options: tuple[str, ...] = ()
    low_detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class VisionLanguage:
    """A vision-language family: its HF architecture, the model_type its text model has where its config does not
    say, text model_types that are another family's (transformers' names for Qwen2-VL's text model), and its
    vision part."""

    architecture: str
    default_text_type: str
    vision: VisionFamily
    text_aliases: dict[str, str] = field(default_factory=dict)  # text model_type -> a text family's model_type


@dataclass(frozen=True)
class AudioFamily:
    """What one family's audio part differs in: the placeholder its processor expands (one per clip in the rendered
    prompt, as many tokens as the clip's encoder rows), the processor outputs its encoder takes, its tensors'
    prefixes in an HF folder, and the encoder rows a second of speech gives (the plan's unit)."""

    model_type: str
    placeholder_key: str  # the processor's attribute holding the placeholder text
    feature_inputs: tuple[str, ...]
    prefixes: tuple[str, ...]
    tokens_per_second: float


@dataclass(frozen=True)
class AudioLanguage:
    """An audio-language family: its HF architecture, the model_type its text model has where its config does not
    say, and its audio part."""

    architecture: str
    default_text_type: str
    audio: AudioFamily
    text_aliases: dict[str, str] = field(default_factory=dict)  # text model_type -> a text family's model_type


def hf_rope_parameters(data: dict, layer_type: str) -> dict:
    """transformers 5's rope_parameters of an HF config for one layer type (Gemma 3 keeps one object per type)."""
    params = data.get("rope_parameters") or {}
    return params.get(layer_type, params) if isinstance(params.get(layer_type), dict) else params


def reference_rope(config: ModelConfig) -> dict:
    """transformers' rope_parameters of a checkpoint's global layers: base and scaling (LongRoPE's factors
    included)."""
    scaling = {k: v for k, v in (config.rotary_scaling or {}).items() if k != "type"}
    return {**scaling, "rope_type": scaling_kind(config.rotary_scaling) or "default",
            "rope_theta": config.rotary_base}
