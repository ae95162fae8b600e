"""The transformers model of a checkpoint's family (its ``Reference`` in cabinllm.runtime.model.families) holding
its weights in fp32 (quantized ones dequantized): the model ModelOpt quantizes and the reference our engine is
checked against.

The weights go back to the HF names by the import's own plan (cabinllm.runtime.sources.weight_plan with the
family's names of cabinllm.runtime.sources.hf_names), run in reverse: concatenated sources (q, k, v) split
again, fused ones (Phi-3's qkv_proj, gate_up_proj) put back together, and the offset the import added (Gemma's
1 + weight norms) taken off. What differs per family is its ``Reference``: the transformers classes and the config
keys the family adds to the common ones.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.weight_formats import LINEAR_LAYERS
from cabinllm.runtime.model.families import FAMILIES
from cabinllm.runtime.model.families.family import Reference, reference_rope
from cabinllm.runtime.model.linear import full_precision, linear_op
from cabinllm.runtime.sources.hf_names import source_names
from cabinllm.runtime.sources.weight_plan import weight_plan


def reference(config: ModelConfig) -> Reference:
    """The transformers reference of a checkpoint's family; ConfigError for one without."""
    try:
        return FAMILIES[config.architecture].reference
    except KeyError:
        raise ConfigError(f"{config.architecture} has no transformers reference here; supported: "
                          f"{', '.join(FAMILIES)}") from None


def transformers_config(config: ModelConfig):
    """The transformers config of a checkpoint's family with every key the checkpoint's config carries
    (embeddings untied: the checkpoint stores lm_head, possibly with a padded vocabulary; no special tokens:
    they are the tokenizer's, callers of ``generate`` pass them)."""
    import transformers

    fam = reference(config)
    common = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_size,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_epsilon,
        hidden_act=config.hidden_act, rope_parameters=reference_rope(config), tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)  # the tokenizer's, not the checkpoint's
    if not fam.head_dim_key:
        del common["head_dim"]  # Phi3Config has no such key (its extra adds one where it differs)
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


def transformers_model(config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32):
    """A checkpoint's config and weights as its family's transformers model (its ``Reference``), in eval mode, on
    ``device`` in ``dtype`` (fp32 on the CPU by default).

    Quantized linear weights become the fp32 matrices the reference engine multiplies by (an AWQ prequant
    scale folded in); a vocabulary padded by the export keeps its padded rows. Loaded strictly: every parameter
    of the model comes from the checkpoint.
    """
    import transformers

    with torch.device(device):  # drawn where it runs: a 3B model's init on the CPU takes minutes
        model = getattr(transformers, reference(config).model_class)(transformers_config(config)).to(dtype).eval()
    model.load_state_dict(hf_state_dict(config, weights), strict=True)
    return model
