"""A transformers ``LlamaForCausalLM`` holding a checkpoint's weights in fp32 (quantized ones dequantized): the
model ModelOpt quantizes and the reference our engine is checked against."""
from __future__ import annotations

import torch

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.checkpoint import ModelConfig, layer_prefix
from cabinllm.runtime.model.linear import full_precision, linear_op

HF_LINEARS = {"attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj",
              "mlp.proj": "mlp.down_proj"}


def transformers_model(config: ModelConfig, weights: dict[str, torch.Tensor]):
    """A Llama/Mistral checkpoint's config and weights as transformers' LlamaForCausalLM, in fp32.

    Quantized linear weights become the fp32 matrices the reference engine multiplies by (an AWQ prequant
    scale folded in); a vocabulary padded by the export keeps its padded rows.
    """
    import transformers

    if config.qkv_bias:
        raise ConfigError("qkv bias (Qwen2) has no LlamaForCausalLM equivalent; use a Llama or Mistral model")
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_size,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_epsilon,
        rope_theta=config.rotary_base, rope_scaling=config.rotary_scaling, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_config).float().eval()
    fmt = config.weight_format
    q, kv = config.num_attention_heads * config.head_size, config.kv_channels
    state = {"model.embed_tokens.weight": weights["transformer.vocab_embedding.weight"],
             "model.norm.weight": weights["transformer.ln_f.weight"], "lm_head.weight": weights["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        p, h = layer_prefix(i), f"model.layers.{i}"

        def dense(name: str) -> torch.Tensor:
            return full_precision(linear_op(fmt, {s: weights[f"{p}.{name}.{s}"] for s in fmt.tensors},
                                             config.quantization))

        q_w, k_w, v_w = dense("attention.qkv").split([q, kv, kv])
        state.update({f"{h}.self_attn.q_proj.weight": q_w, f"{h}.self_attn.k_proj.weight": k_w,
                      f"{h}.self_attn.v_proj.weight": v_w,
                      f"{h}.input_layernorm.weight": weights[f"{p}.input_layernorm.weight"],
                      f"{h}.post_attention_layernorm.weight": weights[f"{p}.post_layernorm.weight"]})
        state.update({f"{h}.{hf}.weight": dense(ours) for ours, hf in HF_LINEARS.items()})
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model
