"""Phi-3 (Phi-4-mini): Llama with fused qkv_proj and gate_up_proj, partial rotary (``partial_rotary_factor`` of each
head) and LongRoPE; its sliding window is on unless config.json says otherwise, and refused below the context.

TensorRT-LLM reads ``rotary_pct`` (models/phi3/config.py L72 at 1e6a4f97; model.py L113 reads it), ``swiglu`` for
SiLU (L138), and LongRoPE as ``position_embedding_type`` "long_rope" with its factors and original context
(L115-121). Its converter keeps ``gate_up_proj`` fused with its halves swapped (convert.py L31 and L56-63 at
89fd9b74; model.py L116: a plain MLP whose SwiGLU splits it): the checkpoint's MLP is one ``mlp.fc`` of [up; gate].
"""
from __future__ import annotations

import dataclasses

from cabinllm.runtime.formats.checkpoint import CheckpointArchitecture, ModelConfig
from cabinllm.runtime.model.families.family import HF_NAMES, Family, Reference, reference_rope


def fields(data: dict, source: str) -> dict:
    """The rotated channels of each head, from ``partial_rotary_factor`` (None: all)."""
    params = data.get("rope_parameters") or {}
    factor = data.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    head = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    return dict(rotary_dim=None if factor == 1.0 else int(head * factor))


def trtllm_keys(config: ModelConfig) -> dict:
    """Phi3Config's rotary_pct, SwiGLU and LongRoPE keys."""
    extra = {"rotary_pct": config.rotated_channels / config.head_size}
    if config.hidden_act == "silu":
        extra["hidden_act"] = "swiglu"
    scaling = config.rotary_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "longrope":
        extra.update(position_embedding_type="long_rope",
                     original_max_position_embeddings=scaling["original_max_position_embeddings"],
                     longrope_scaling_short_factors=scaling["short_factor"],
                     longrope_scaling_long_factors=scaling["long_factor"])
    return extra


def reference(config: ModelConfig) -> dict:
    """Phi3Config's keys beyond the common ones: rope with its partial factor, the original context, head_dim
    where it is not hidden / heads."""
    params = {**reference_rope(config), "partial_rotary_factor": config.rotated_channels / config.head_size}
    original = params.get("original_max_position_embeddings", config.max_position_embeddings)
    extra = {"head_dim": config.head_size} if config.head_size * config.num_attention_heads != config.hidden_size \
        else {}
    return dict(rope_parameters=params, original_max_position_embeddings=original, sliding_window=None, **extra)


FAMILY = Family(
    checkpoint=CheckpointArchitecture("Phi3ForCausalLM", trtllm_keys, fused_mlp=True),
    model_types=("phi3",),
    # ModelOpt's phi3 decoder swaps gate_up_proj's halves into TensorRT-LLM's order (and writes no config);
    # llama keeps HF's order, which checkpoint_tensors splits into fc and gate
    reference=Reference("Phi3Config", "Phi3ForCausalLM", reference, "llama", head_dim_key=False),
    names=dataclasses.replace(
        HF_NAMES, q="model.layers.{l}.self_attn.qkv_proj.weight", mlp_gate="model.layers.{l}.mlp.gate_up_proj.weight",
        fused_qkv=True, fused_gate_up=True),
    fields=fields,
    sliding_window_by_default=True,
    # models/__init__.py MODEL_MAP at 02267d3d L158
    trtllm={"1.x": None, "v0.12": None},
)
FAMILIES = (FAMILY,)
