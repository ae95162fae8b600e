"""HF names and config.json of Llama (3.x included), Mistral, Qwen2, Qwen3, Gemma 3 and Phi-3 (Phi-4-mini) ->
the TensorRT-LLM checkpoint's."""
from __future__ import annotations

import dataclasses

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import SOURCE_FIX, SUPPORTED_ARCHITECTURES, ModelConfig, default_head_size
from cabinllm.runtime.sources.weight_plan import SourceNames

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
_QK_NORMS = dict(q_norm="model.layers.{l}.self_attn.q_norm.weight", k_norm="model.layers.{l}.self_attn.k_norm.weight")
FAMILY_NAMES = {
    "Qwen3ForCausalLM": dataclasses.replace(HF_NAMES, **_QK_NORMS),
    # Gemma's RMSNorm scales by (1 + weight): the checkpoint stores 1 + weight, as TensorRT-LLM's converter does
    "Gemma3ForCausalLM": dataclasses.replace(
        HF_NAMES, **_QK_NORMS, pre_ff_norm="model.layers.{l}.pre_feedforward_layernorm.weight",
        post_ff_norm="model.layers.{l}.post_feedforward_layernorm.weight", norm_offset=1.0),
    "Phi3ForCausalLM": dataclasses.replace(
        HF_NAMES, q="model.layers.{l}.self_attn.qkv_proj.weight", mlp_gate="model.layers.{l}.mlp.gate_up_proj.weight",
        fused_qkv=True, fused_gate_up=True),
}


def source_names(architecture: str) -> SourceNames:
    """The HF tensor names of an architecture."""
    return FAMILY_NAMES.get(architecture, HF_NAMES)


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


def _rope_parameters(data: dict, layer_type: str) -> dict:
    """transformers 5's rope_parameters for one layer type (Gemma 3 keeps one object per type)."""
    params = data.get("rope_parameters") or {}
    return params.get(layer_type, params) if isinstance(params.get(layer_type), dict) else params


def _gemma3_fields(data: dict, source: str) -> dict:
    """ModelConfig fields of Gemma 3's text model: windows, the local layers' RoPE base, the query scale."""
    if data.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"{source}: attn_logit_softcapping is not supported (Gemma 3 has none); "
                              "import a model with attn_logit_softcapping null")
    layer_types = data.get("layer_types")
    pattern = data.get("sliding_window_pattern", 6)
    if layer_types:
        global_layers = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
        pattern = global_layers[0] + 1 if global_layers else len(layer_types) + 1
        if layer_types != ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(len(layer_types))]:
            raise CheckpointError(f"{source}: layer_types {layer_types} do not repeat one global layer every N; "
                                  "only Gemma 3's periodic pattern is supported")
    local = _rope_parameters(data, "sliding_attention")
    return dict(
        inter_layernorms=True, qk_layernorm=True, query_pre_attn_scalar=data.get("query_pre_attn_scalar"),
        sliding_window=data.get("sliding_window"), sliding_window_pattern=pattern,
        rope_local_base_freq=float(data.get("rope_local_base_freq", local.get("rope_theta", 10000.0))),
        final_logit_softcapping=data.get("final_logit_softcapping"))


GEMMA3_VLM = "Gemma3ForConditionalGeneration"
# vision-language folders whose text model is imported (the vision part is the engine's vision folder's:
# cabinllm.runtime.model.vision), and what their text config's model_type imports as
VLM_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration",
                     "Qwen2VLForConditionalGeneration")
TEXT_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_vl": "Qwen2ForCausalLM"}


def _vlm_text(data: dict, source: str) -> dict:
    """The text model's config of a vision-language folder (transformers 4's Qwen2-VL keeps it at the top level),
    with the architecture it imports as."""
    text = dict(data.get("text_config") or {k: v for k, v in data.items() if k != "vision_config"})
    kind = text.get("model_type", "llama" if data["architectures"][0] != VLM_ARCHITECTURES[2] else "qwen2")
    if kind not in TEXT_MODEL_TYPES:
        raise CheckpointError(f"{source}: the text model is a {kind!r}; supported: {', '.join(TEXT_MODEL_TYPES)}")
    text.setdefault("tie_word_embeddings", data.get("tie_word_embeddings", False))
    return {**text, "architectures": [TEXT_MODEL_TYPES[kind]]}


def _gemma3_text(data: dict) -> dict:
    """A Gemma 3 config with transformers' Gemma3TextConfig defaults filled in (the Hub's files leave heads,
    vocabulary, context and scales to them); of a Gemma3ForConditionalGeneration, its text model's."""
    import transformers

    text = data.get("text_config") or {} if data["architectures"][0] == GEMMA3_VLM else data
    known = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    return {**transformers.Gemma3TextConfig(**known).to_dict(), "architectures": ["Gemma3ForCausalLM"]}


def _family_fields(architecture: str, data: dict, source: str) -> dict:
    """The ModelConfig fields an architecture adds to Llama's."""
    if architecture == "Qwen3ForCausalLM":
        return dict(qk_layernorm=True)
    if architecture == "Gemma3ForCausalLM":
        return _gemma3_fields(data, source)
    if architecture == "Phi3ForCausalLM":
        params = data.get("rope_parameters") or {}
        factor = data.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
        head = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
        return dict(rotary_dim=None if factor == 1.0 else int(head * factor))
    return {}


def _check_window(architecture: str, data: dict, source: str) -> None:
    """A sliding window outside Gemma 3 is refused unless it never applies (Phi-4-mini's exceeds its context)."""
    window = data.get("sliding_window")
    used = data.get("use_sliding_window", architecture in ("MistralForCausalLM", "Phi3ForCausalLM"))
    if architecture != "Gemma3ForCausalLM" and used and window and window < data["max_position_embeddings"]:
        raise CheckpointError(f"{source}: sliding_window {window} below the context is supported for Gemma 3 only; "
                              "import a model without it (or set use_sliding_window false if it was never trained "
                              "with it)")


def config_from_hf(data: dict, source: str) -> ModelConfig:
    """A ModelConfig from an HF ``config.json`` dict; ``source`` names the file in errors."""
    architecture = (data.get("architectures") or [None])[0]
    if architecture in ("Gemma3ForCausalLM", GEMMA3_VLM):
        data, architecture = _gemma3_text(data), "Gemma3ForCausalLM"
    if architecture in VLM_ARCHITECTURES:
        data = _vlm_text(data, source)
        architecture = data["architectures"][0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if data.get("quantization_config"):
        raise CheckpointError(f"{source}: quantized HF checkpoints are not supported; import the unquantized model")
    if data.get("attention_bias") or data.get("mlp_bias"):
        raise CheckpointError(f"{source}: attention_bias/mlp_bias=true is not supported for {architecture} (only "
                              "Qwen2's q/k/v biases are); import a model trained without those biases")
    try:
        heads = data["num_attention_heads"]
        _check_window(architecture, data, source)
        rotary_base, rotary_scaling = _rope(data, _rope_parameters(data, "full_attention"))
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
            qkv_bias=architecture == "Qwen2ForCausalLM",
            tie_word_embeddings=bool(data.get("tie_word_embeddings", architecture == "Gemma3ForCausalLM")),
            **_family_fields(architecture, data, source),
        )
    except KeyError as err:
        raise CheckpointError(f"{source}: missing key {err.args[0]!r}; is this an HF model config.json?") from err
    config.check(source, SOURCE_FIX)
    return config
