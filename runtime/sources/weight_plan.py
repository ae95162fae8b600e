"""Which source tensors make each checkpoint tensor, and their expected shapes.

A plan maps every TensorRT-LLM weight name to the source tensors that are
concatenated on dim 0 to build it (one source for most, q/k/v for ``qkv``).
HF and GGUF differ only in their names (``SourceNames``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import ModelConfig, expected_shapes, layer_prefix


@dataclass(frozen=True)
class Part:
    """One source tensor and the shape it must have (linear weights are (out, in))."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SourceNames:
    """Weight names of a source format; ``{l}`` stands for the layer index.

    Biases (Qwen2's q/k/v) are named like the weight with ``.weight`` -> ``.bias``.
    """

    embedding: str
    final_norm: str
    lm_head: str
    input_norm: str
    post_norm: str
    q: str
    k: str
    v: str
    dense: str
    mlp_gate: str  # the SiLU branch (HF gate_proj) -> mlp.fc
    mlp_up: str  # HF up_proj -> mlp.gate
    mlp_down: str  # -> mlp.proj


@dataclass
class SourceModel:
    """A model opened for import: its config, its plan and a loader of source tensors by name."""

    config: ModelConfig
    plan: dict[str, list[Part]]
    load: Callable[[str], torch.Tensor]


def weight_plan(config: ModelConfig, names: SourceNames) -> dict[str, list[Part]]:
    """The plan for every weight ``expected_shapes(config)`` lists; tied models take lm_head from the embedding."""
    shapes = expected_shapes(config)
    hidden = config.hidden_size
    q_rows, kv_rows = config.num_attention_heads * config.head_size, config.kv_channels
    top = {
        "transformer.vocab_embedding.weight": names.embedding,
        "transformer.ln_f.weight": names.final_norm,
        "lm_head.weight": names.embedding if config.tie_word_embeddings else names.lm_head,
    }
    plan = {name: [Part(source, shapes[name])] for name, source in top.items()}
    for layer in range(config.num_hidden_layers):
        prefix = layer_prefix(layer)
        single = {
            "input_layernorm.weight": names.input_norm,
            "post_layernorm.weight": names.post_norm,
            "attention.dense.weight": names.dense,
            "mlp.fc.weight": names.mlp_gate,
            "mlp.gate.weight": names.mlp_up,
            "mlp.proj.weight": names.mlp_down,
        }
        for suffix, template in single.items():
            plan[f"{prefix}.{suffix}"] = [Part(template.format(l=layer), shapes[f"{prefix}.{suffix}"])]
        qkv = [(names.q, q_rows), (names.k, kv_rows), (names.v, kv_rows)]
        plan[f"{prefix}.attention.qkv.weight"] = [Part(t.format(l=layer), (rows, hidden)) for t, rows in qkv]
        if config.qkv_bias:
            plan[f"{prefix}.attention.qkv.bias"] = [
                Part(t.format(l=layer).replace(".weight", ".bias"), (rows,)) for t, rows in qkv
            ]
    return plan


def check_plan(plan: dict[str, list[Part]], shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise CheckpointError naming the first source tensor that is missing or misshapen."""
    for parts in plan.values():
        for part in parts:
            if part.name not in shapes:
                raise CheckpointError(
                    f"{source}: tensor {part.name} is missing; the model files are incomplete "
                    "or do not match the architecture in the config"
                )
            if tuple(shapes[part.name]) != part.shape:
                raise CheckpointError(
                    f"{source}: tensor {part.name} has shape {list(shapes[part.name])}, expected "
                    f"{list(part.shape)} from the model config; the config and the weights disagree"
                )


def all_finite(tensor: torch.Tensor) -> bool:
    """True when the tensor holds no NaN and no infinite value."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor)  # NaN and inf reach the extremes; far cheaper than isfinite().all()
    return bool(low.isfinite() and high.isfinite())


def iter_weights(model: SourceModel, source: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each checkpoint tensor as a fresh tensor (sources concatenated on dim 0); CheckpointError naming the
    first source tensor with a NaN or infinite value (``source`` names the model in it)."""
    for name, parts in model.plan.items():
        tensors = [model.load(part.name) for part in parts]
        for part, tensor in zip(parts, tensors):
            if not all_finite(tensor):
                raise CheckpointError(
                    f"{source}: tensor {part.name} has {int(tensor.isnan().sum())} NaN and "
                    f"{int(tensor.isinf().sum())} infinite values (of {tensor.numel()}); a model with NaN or "
                    "infinite weights cannot run: the file is damaged or the weights diverged in training, use "
                    "another copy of the model"
                )
        yield name, torch.cat(tensors, dim=0)
