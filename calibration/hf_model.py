"""The transformers model of a checkpoint's family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM) holding its weights in fp32 (quantized ones dequantized):
the model ModelOpt quantizes and the reference our engine is checked against.

The weights go back to the HF names by the import's own plan (cabinllm.runtime.sources.weight_plan with the
family's names of cabinllm.runtime.sources.hf_names), run in reverse: concatenated sources (q, k, v) split
again, fused ones (Phi-3's qkv_proj, gate_up_proj) put back together, and the offset the import added (Gemma's
1 + weight norms) taken off. What differs per family is the table ``FAMILIES``: the transformers classes and
the config keys the family adds to the common ones.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.weight_formats import LINEAR_LAYERS
from cabinllm.runtime.model.linear import full_precision, linear_op
from cabinllm.runtime.model.rope import scaling_kind
from cabinllm.runtime.sources.hf_names import source_names
from cabinllm.runtime.sources.weight_plan import weight_plan


@dataclass(frozen=True)
class Family:
    """A family's transformers config and model classes, what its config adds, and ModelOpt's decoder type."""

    config_class: str
    model_class: str
    extra: Callable[[ModelConfig], dict]  # config keys beyond the common ones
    decoder: str  # ModelOpt export_tensorrt_llm_checkpoint's decoder_type


def rope_parameters(config: ModelConfig) -> dict:
    """transformers' rope_parameters of the global layers: base and scaling (LongRoPE's factors included)."""
    scaling = {k: v for k, v in (config.rotary_scaling or {}).items() if k != "type"}
    return {**scaling, "rope_type": scaling_kind(config.rotary_scaling) or "default",
            "rope_theta": config.rotary_base}


def _gemma3(config: ModelConfig) -> dict:
    layers = range(config.num_hidden_layers)
    return dict(
        hidden_activation=config.hidden_act, query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_size,
        sliding_window=config.sliding_window, final_logit_softcapping=config.final_logit_softcapping,
        attn_logit_softcapping=None,
        layer_types=["full_attention" if config.layer_window(i) is None else "sliding_attention" for i in layers],
        rope_parameters={"full_attention": rope_parameters(config), "sliding_attention": {
            "rope_type": "default", "rope_theta": config.rope_local_base_freq or config.rotary_base}})


def _phi3(config: ModelConfig) -> dict:
    params = {**rope_parameters(config), "partial_rotary_factor": config.rotated_channels / config.head_size}
    original = params.get("original_max_position_embeddings", config.max_position_embeddings)
    extra = {"head_dim": config.head_size} if config.head_size * config.num_attention_heads != config.hidden_size \
        else {}
    return dict(rope_parameters=params, original_max_position_embeddings=original, sliding_window=None, **extra)


FAMILIES = {
    "LlamaForCausalLM": Family("LlamaConfig", "LlamaForCausalLM", lambda c: {}, "llama"),
    "MistralForCausalLM": Family("MistralConfig", "MistralForCausalLM", lambda c: dict(sliding_window=None),
                                 "llama"),
    "Qwen2ForCausalLM": Family("Qwen2Config", "Qwen2ForCausalLM", lambda c: dict(use_sliding_window=False), "qwen"),
    "Qwen3ForCausalLM": Family("Qwen3Config", "Qwen3ForCausalLM",
                               lambda c: dict(use_sliding_window=False, attention_bias=False), "qwen"),
    "Gemma3ForCausalLM": Family("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3, "gemma3"),
    # ModelOpt's phi3 decoder swaps gate_up_proj's halves into TensorRT-LLM's order (and writes no config);
    # llama keeps HF's order, which checkpoint_tensors splits into fc and gate
    "Phi3ForCausalLM": Family("Phi3Config", "Phi3ForCausalLM", _phi3, "llama"),
}


def family(config: ModelConfig) -> Family:
    """The FAMILIES entry of a checkpoint's architecture; ConfigError for one without."""
    try:
        return FAMILIES[config.architecture]
    except KeyError:
        raise ConfigError(f"{config.architecture} has no transformers reference here; supported: "
                          f"{', '.join(FAMILIES)}") from None


def transformers_config(config: ModelConfig):
    """The transformers config of a checkpoint's family with every key the checkpoint's config carries
    (embeddings untied: the checkpoint stores lm_head, possibly with a padded vocabulary; no special tokens:
    they are the tokenizer's, callers of ``generate`` pass them)."""
    import transformers

    fam = family(config)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_size,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_epsilon,
        hidden_act=config.hidden_act, rope_parameters=rope_parameters(config), tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)  # the tokenizer's, not the checkpoint's
    if fam.config_class == "Phi3Config":
        del common["head_dim"]  # Phi3Config has no such key (its _phi3 extra adds one where it differs)
    return getattr(transformers, fam.config_class)(**{**common, **fam.extra(config)})


def hf_state_dict(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the family's HF names, in fp32 (quantized linears dequantized)."""
    fmt = config.weight_format
    untied = replace(config, tie_word_embeddings=False)  # the checkpoint's lm_head is its own tensor
    state: dict[str, torch.Tensor] = {}
    for name, parts in weight_plan(untied, source_names(config.architecture)).items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.endswith(LINEAR_LAYERS):
            tensor = full_precision(linear_op(fmt, {s: weights[f"{base}.{s}"] for s in fmt.tensors},
                                              config.quantization))
        else:
            tensor = weights[name].float()
        if len(parts) == 1 and parts[0].rows is not None:  # rows of a fused source (Phi-3's gate_up_proj)
            part = parts[0]
            fused = state.setdefault(part.name, torch.empty(part.shape))
            fused[part.rows[0]:part.rows[1]] = tensor
            continue
        for part, piece in zip(parts, tensor.split([part.shape[0] for part in parts])):
            state[part.name] = piece - part.offset if part.offset else piece
    return state


def transformers_model(config: ModelConfig, weights: dict[str, torch.Tensor]):
    """A checkpoint's config and weights as its family's transformers model (``FAMILIES``), in fp32, eval mode.

    Quantized linear weights become the fp32 matrices the reference engine multiplies by (an AWQ prequant
    scale folded in); a vocabulary padded by the export keeps its padded rows. Loaded strictly: every parameter
    of the model comes from the checkpoint.
    """
    import transformers

    model = getattr(transformers, family(config).model_class)(transformers_config(config)).float().eval()
    model.load_state_dict(hf_state_dict(config, weights), strict=True)
    return model
