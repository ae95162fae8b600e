"""Gemma 3 (its text model; of a Gemma3ForConditionalGeneration folder, the text model alone).

Beyond Llama: RMSNorm scaling by (1 + weight) (the checkpoint stores 1 + weight, as TensorRT-LLM's converter does),
q/k norms, norms after attention and around the MLP (``inter_layernorms``), tanh-GELU, embeddings scaled by
sqrt(hidden_size), queries by ``query_pre_attn_scalar``, logits soft-capped, tied embeddings by default, and local
layers attending over ``sliding_window`` tokens with their own RoPE base, one global layer every
``sliding_window_pattern``.

TensorRT-LLM reads GemmaConfig's ``attn_bias``/``mlp_bias`` (models/gemma/config.py L101-103 at 9df6d722) and the
layer pattern under both names it has had: ``_sliding_window_pattern`` (config.py L55, model.py L76-77 at 5dedf53b)
and ``sliding_window_pattern`` (Gemma3ConfigGroup, modeling_utils.py L67-72 at 01ea6d79).
"""
from __future__ import annotations

import dataclasses

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import CheckpointArchitecture, ModelConfig
from cabinllm.runtime.model.families.family import (HF_NAMES, QK_NORMS, Family, Reference, hf_rope_parameters,
                                                  reference_rope)

VISION_LANGUAGE = "Gemma3ForConditionalGeneration"  # its text model imports; its vision part is not run


def fields(data: dict, source: str) -> dict:
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
    local = hf_rope_parameters(data, "sliding_attention")
    return dict(
        inter_layernorms=True, qk_layernorm=True, query_pre_attn_scalar=data.get("query_pre_attn_scalar"),
        sliding_window=data.get("sliding_window"), sliding_window_pattern=pattern,
        rope_local_base_freq=float(data.get("rope_local_base_freq", local.get("rope_theta", 10000.0))),
        final_logit_softcapping=data.get("final_logit_softcapping"))


def hf_config(data: dict) -> dict:
    """A Gemma 3 config with transformers' Gemma3TextConfig defaults filled in (the Hub's files leave heads,
    vocabulary, context and scales to them); of a Gemma3ForConditionalGeneration, its text model's."""
    import transformers

    text = data.get("text_config") or {} if data["architectures"][0] == VISION_LANGUAGE else data
    known = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    return {**transformers.Gemma3TextConfig(**known).to_dict(), "architectures": ["Gemma3ForCausalLM"]}


def reference(config: ModelConfig) -> dict:
    """Gemma3TextConfig's keys beyond the common ones."""
    layers = range(config.num_hidden_layers)
    return dict(
        hidden_activation=config.hidden_act, query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_size,
        sliding_window=config.sliding_window, final_logit_softcapping=config.final_logit_softcapping,
        attn_logit_softcapping=None,
        layer_types=["full_attention" if config.layer_window(i) is None else "sliding_attention" for i in layers],
        rope_parameters={"full_attention": reference_rope(config), "sliding_attention": {
            "rope_type": "default", "rope_theta": config.rope_local_base_freq or config.rotary_base}})


FAMILY = Family(
    checkpoint=CheckpointArchitecture(
        "Gemma3ForCausalLM", embedding_scaled=True,
        trtllm_keys=lambda config: {"attn_bias": False, "mlp_bias": False,
                                    "_sliding_window_pattern": config.sliding_window_pattern}),
    model_types=("gemma3_text",),
    reference=Reference("Gemma3TextConfig", "Gemma3ForCausalLM", reference, "gemma3"),
    names=dataclasses.replace(
        HF_NAMES, **QK_NORMS, pre_ff_norm="model.layers.{l}.pre_feedforward_layernorm.weight",
        post_ff_norm="model.layers.{l}.post_feedforward_layernorm.weight", norm_offset=1.0),
    hf_architectures=(VISION_LANGUAGE,),
    fields=fields,
    hf_config=hf_config,
    tied_by_default=True,
    windowed_layers=True,
    # models/__init__.py MODEL_MAP at 02267d3d L194
    trtllm={"1.x": None, "v0.12": "Gemma 3 is newer than TensorRT-LLM 0.12: Gemma 2 arrived in 0.13, Gemma 3's local "
                                  "layers' RoPE base (rotary_embedding_base_local) later still"},
)
FAMILIES = (FAMILY,)
