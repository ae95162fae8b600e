"""Qwen2 (Qwen2.5): Llama with biases on the q/k/v projections; tools in the ``hermes`` format.

TensorRT-LLM builds it through its QWenForCausalLM, whose layers read ``config.qwen_type`` with no default
(QWenConfig takes it only as an extra key, which PretrainedConfig.__init__ sets as an attribute; the official
converter writes it from the HF ``model_type``); ``attn_bias`` and ``mlp_bias`` are QWenConfig's own keys, written
so the build does not rest on its defaults (attn_bias=True, mlp_bias=False).
"""
from __future__ import annotations

from cabinllm.runtime.formats.checkpoint import CheckpointArchitecture, ModelConfig
from cabinllm.runtime.model.families.family import Family, Reference


def trtllm_keys(config: ModelConfig) -> dict:
    """QWenConfig's keys: ``qwen_type`` from the architecture ("qwen2", "qwen3"), the biases."""
    return {"qwen_type": config.architecture[:5].lower(), "attn_bias": config.qkv_bias, "mlp_bias": False}


FAMILY = Family(
    checkpoint=CheckpointArchitecture("Qwen2ForCausalLM", trtllm_keys),
    model_types=("qwen2",),
    reference=Reference("Qwen2Config", "Qwen2ForCausalLM", lambda config: dict(use_sliding_window=False), "qwen"),
    qkv_bias=True,
    vision_text=True,
    gguf_architecture="qwen2",
    trtllm={"1.x": None, "v0.12": None},
)
FAMILIES = (FAMILY,)
