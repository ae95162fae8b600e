"""An HF config.json -> the TensorRT-LLM checkpoint's ModelConfig, by the family it names
(cabinllm.runtime.model.families); a vision-language folder's text model by its model_type."""
from __future__ import annotations

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import ARCHITECTURES, SOURCE_FIX, ModelConfig, default_head_size
from cabinllm.runtime.model.families import FAMILIES, MEDIA_LANGUAGE, Family, family, hf_family, vision_text_types
from cabinllm.runtime.model.families.family import SourceNames, hf_rope_parameters


def source_names(architecture: str) -> SourceNames:
    """The HF tensor names of an architecture."""
    return family(architecture).names


def _rope(data: dict, params: dict) -> tuple[float, dict | None]:
    """(rotary_base, rotary_scaling) from transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters) keys."""
    base = float(data.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = data.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "mrope" if "mrope_section" in scaling else rope_type  # Qwen2-VL (transformers 5 says "default")
    if rope_type == "default":
        return base, None
    rope_type = "longrope" if rope_type in ("su", "yarn") and "short_factor" in scaling else rope_type  # Phi-3's names
    kept = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if rope_type == "longrope":  # transformers takes these from the config; the checkpoint keeps them together
        original = kept.get("original_max_position_embeddings", data.get("original_max_position_embeddings"))
        kept["original_max_position_embeddings"] = original
        if kept.get("factor") is None and isinstance(original, int) and original > 0:
            kept["factor"] = data["max_position_embeddings"] / original
    # TensorRT-LLM 0.12 reads "type", newer releases "rope_type": write both.
    return base, {**kept, "type": rope_type, "rope_type": rope_type}


def _vlm_text(data: dict, source: str) -> dict:
    """The text model's config of a vision- or audio-language folder (transformers 4's Qwen2-VL keeps it at the top
    level), with the architecture it imports as."""
    text = dict(data.get("text_config") or {k: v for k, v in data.items() if k != "vision_config"})
    kind = text.get("model_type", MEDIA_LANGUAGE[data["architectures"][0]].default_text_type)
    types = vision_text_types()
    if kind not in types:
        raise CheckpointError(f"{source}: the text model is a {kind!r}; supported: {', '.join(types)}")
    text.setdefault("tie_word_embeddings", data.get("tie_word_embeddings", False))
    return {**text, "architectures": [types[kind]]}


def _check_window(fam: Family, data: dict, source: str) -> None:
    """A sliding window is refused unless the family runs it in its layers or it never applies (Phi-4-mini's
    exceeds its context)."""
    window = data.get("sliding_window")
    used = data.get("use_sliding_window", fam.sliding_window_by_default)
    if not fam.windowed_layers and used and window and window < data["max_position_embeddings"]:
        windowed = ", ".join(f.architecture for f in FAMILIES.values() if f.windowed_layers)
        raise CheckpointError(f"{source}: sliding_window {window} below the context is supported for {windowed} "
                              "only; import a model without it (or set use_sliding_window false if it was never "
                              "trained with it)")


def _text_config(data: dict, source: str) -> tuple[Family, dict]:
    """The family an HF config.json imports as and its config as the family reads it (a vision-language
    folder's or an audio-language folder's text model's)."""
    architecture = (data.get("architectures") or [None])[0]
    if architecture in MEDIA_LANGUAGE:
        data = _vlm_text(data, source)
        architecture = data["architectures"][0]
    fam = hf_family(architecture)
    if fam is None:
        raise CheckpointError(
            f"{source}: unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return fam, fam.hf_config(data) if fam.hf_config else data


def config_from_hf(data: dict, source: str) -> ModelConfig:
    """A ModelConfig from an HF ``config.json`` dict; ``source`` names the file in errors."""
    fam, data = _text_config(data, source)
    architecture = fam.architecture
    if data.get("quantization_config"):
        raise CheckpointError(f"{source}: quantized HF checkpoints are not supported; import the unquantized model")
    if data.get("attention_bias") or data.get("mlp_bias"):
        biased = ", ".join(f"{f.architecture}'s" for f in FAMILIES.values() if f.qkv_bias)
        raise CheckpointError(f"{source}: attention_bias/mlp_bias=true is not supported for {architecture} (only "
                              f"{biased} q/k/v biases are); import a model trained without those biases")
    try:
        heads = data["num_attention_heads"]
        _check_window(fam, data, source)
        rotary_base, rotary_scaling = _rope(data, hf_rope_parameters(data, "full_attention"))
        config = ModelConfig(
            architecture=architecture,
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_size=data.get("head_dim") or default_head_size(data["hidden_size"], heads),
            intermediate_size=data["intermediate_size"],
            max_position_embeddings=data["max_position_embeddings"],
            rotary_base=rotary_base,
            rotary_scaling=rotary_scaling,
            norm_epsilon=float(data.get("rms_norm_eps", 1e-6)),
            hidden_act=data.get("hidden_activation") or data.get("hidden_act", "silu"),
            qkv_bias=fam.qkv_bias,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", fam.tied_by_default)),
            **fam.fields(data, source),
        )
    except KeyError as err:
        raise CheckpointError(f"{source}: missing key {err.args[0]!r}; is this an HF model config.json?") from err
    config.check(source, SOURCE_FIX)
    return config
