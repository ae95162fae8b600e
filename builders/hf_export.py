"""A transformers ``LlamaForCausalLM`` holding a checkpoint's weights: the reference our engine is checked against."""
from __future__ import annotations

from pathlib import Path

from runtime.checkpoint import layer_prefix, load_checkpoint


def to_transformers(folder: str | Path):
    """Load a Llama/Mistral checkpoint folder into transformers' LlamaForCausalLM, in fp32."""
    import transformers

    config, weights = load_checkpoint(folder)
    if config.qkv_bias:
        raise ValueError(f"{folder}: qkv bias (Qwen2) has no LlamaForCausalLM equivalent")
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_size,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_epsilon,
        rope_theta=config.rotary_base, rope_scaling=config.rotary_scaling, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_config).float().eval()
    q, kv = config.num_attention_heads * config.head_size, config.kv_channels
    state = {"model.embed_tokens.weight": weights["transformer.vocab_embedding.weight"],
             "model.norm.weight": weights["transformer.ln_f.weight"], "lm_head.weight": weights["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        p, h = layer_prefix(i), f"model.layers.{i}"
        q_w, k_w, v_w = weights[f"{p}.attention.qkv.weight"].split([q, kv, kv])
        state.update({
            f"{h}.self_attn.q_proj.weight": q_w, f"{h}.self_attn.k_proj.weight": k_w,
            f"{h}.self_attn.v_proj.weight": v_w,
            f"{h}.self_attn.o_proj.weight": weights[f"{p}.attention.dense.weight"],
            f"{h}.mlp.gate_proj.weight": weights[f"{p}.mlp.fc.weight"],
            f"{h}.mlp.up_proj.weight": weights[f"{p}.mlp.gate.weight"],
            f"{h}.mlp.down_proj.weight": weights[f"{p}.mlp.proj.weight"],
            f"{h}.input_layernorm.weight": weights[f"{p}.input_layernorm.weight"],
            f"{h}.post_attention_layernorm.weight": weights[f"{p}.post_layernorm.weight"],
        })
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model
