"""HF Llama/Mistral/Qwen2 names and config.json -> the TensorRT-LLM checkpoint's."""
from __future__ import annotations

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


def _rope(data: dict) -> tuple[float, dict | None]:
    """(rotary_base, rotary_scaling) from transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters) keys."""
    params = data.get("rope_parameters") or {}
    base = float(data.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = data.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return base, None
    kept = {k: v for k, v in scaling.items() if k != "rope_theta"}  # transformers 5 keeps it in rope_parameters
    # TensorRT-LLM 0.12 reads "type", newer releases "rope_type": write both.
    return base, {**kept, "type": rope_type, "rope_type": rope_type}


def config_from_hf(data: dict, source: str) -> ModelConfig:
    """A ModelConfig from an HF ``config.json`` dict; ``source`` names the file in errors."""
    architecture = (data.get("architectures") or [None])[0]
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
        rotary_base, rotary_scaling = _rope(data)
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
            hidden_act=data.get("hidden_act", "silu"),
            qkv_bias=architecture == "Qwen2ForCausalLM",
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )
    except KeyError as err:
        raise CheckpointError(f"{source}: missing key {err.args[0]!r}; is this an HF model config.json?") from err
    config.check(source, SOURCE_FIX)
    return config
