"""Llama (3.x included) and Mistral: the plain decoder every other family is described against (RMSNorm before
attention and MLP, SwiGLU, GPT-NeoX RoPE with linear or llama3 scaling, no biases); tools in the ``llama3-json``
format where the chat template renders them (cabinllm.runtime.model.tools)."""
from __future__ import annotations

from cabinllm.runtime.formats.checkpoint import CheckpointArchitecture
from cabinllm.runtime.model.families.family import Family, Reference

LLAMA = Family(
    checkpoint=CheckpointArchitecture("LlamaForCausalLM"),
    model_types=("llama",),
    reference=Reference("LlamaConfig", "LlamaForCausalLM"),
    vision_text=True,
    gguf_architecture="llama",
    gguf_permuted_qk=True,  # llama.cpp permutes q/k rows of Llama models only
    trtllm={"1.x": None, "v0.12": None},
)
# Mistral's sliding window is on unless config.json says otherwise; one below the context is refused
MISTRAL = Family(
    checkpoint=CheckpointArchitecture("MistralForCausalLM"),
    model_types=("mistral",),
    reference=Reference("MistralConfig", "MistralForCausalLM", lambda config: dict(sliding_window=None)),
    sliding_window_by_default=True,
    vision_text=True,
    trtllm={"1.x": None, "v0.12": None},
)
FAMILIES = (LLAMA, MISTRAL)
