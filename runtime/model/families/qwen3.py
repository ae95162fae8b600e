"""Qwen3: Llama with an RMSNorm of each q and k head before RoPE, no biases; tools in the ``hermes`` format.

TensorRT-LLM builds it through the same QWenForCausalLM as Qwen2: q/k norms follow from ``qwen_type`` "qwen3" alone
(models/qwen/config.py L97, L127-128 at 373970a8; model.py L61 ``qk_layernorm = config.qwen_type in ('qwen3',
'qwen3_moe')``).
"""
from __future__ import annotations

import dataclasses

from cabinllm.runtime.formats.checkpoint import CheckpointArchitecture
from cabinllm.runtime.model.families import qwen2
from cabinllm.runtime.model.families.family import HF_NAMES, QK_NORMS, Family, Reference

FAMILY = Family(
    checkpoint=CheckpointArchitecture("Qwen3ForCausalLM", qwen2.trtllm_keys),
    model_types=("qwen3",),
    reference=Reference("Qwen3Config", "Qwen3ForCausalLM",
                        lambda config: dict(use_sliding_window=False, attention_bias=False), "qwen"),
    names=dataclasses.replace(HF_NAMES, **QK_NORMS),
    fields=lambda data, source: dict(qk_layernorm=True),
    # models/__init__.py MODEL_MAP at 02267d3d L202
    trtllm={"1.x": None, "v0.12": "Qwen3 is newer than TensorRT-LLM 0.12: its QWen config takes qwen_type qwen, "
                                  "qwen2 and qwen2_moe only, and Qwen3's q/k norms reached the TensorRT path with PR "
                                  "#5650 (July 2025, the 1.x line)"},
)
FAMILIES = (FAMILY,)
