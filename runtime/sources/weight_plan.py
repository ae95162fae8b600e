"""Which source tensors make each checkpoint tensor, and their expected shapes.

A plan maps every TensorRT-LLM weight name to the source tensors that are
concatenated on dim 0 to build it (one source for most, q/k/v for ``qkv``), or to rows of one fused source
(Phi-3's ``gate_up_proj`` holds fc and gate). HF and GGUF differ only in their names (``SourceNames``, each
family's in cabinllm.runtime.model.families).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import ModelConfig, expected_shapes, layer_prefix
from cabinllm.runtime.model.families.family import SourceNames


@dataclass(frozen=True)
class Part:
    """One source tensor and the shape it must have (linear weights are (out, in))."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None  # [start, stop) of a fused source's rows; None: all of it
    offset: float = 0.0  # added on import (Gemma's norms scale by 1 + weight; the checkpoint stores 1 + weight)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the loaded source tensor this checkpoint tensor is made of."""
        tensor = tensor if self.rows is None else tensor[self.rows[0]:self.rows[1]]
        return tensor + self.offset if self.offset else tensor


@dataclass
class SourceModel:
    """A model opened for import: its config, its plan, a loader of source tensors by name and, for a GGUF file, of
    their Q4_0 / Q4_1 / Q8_0 blocks as stored (cabinllm.runtime.sources.gguf.Blocks; None for other tensors)."""

    config: ModelConfig
    plan: dict[str, list[Part]]
    load: Callable[[str], torch.Tensor]
    load_blocks: Callable[[str], object | None] = lambda name: None


def weight_plan(config: ModelConfig, names: SourceNames) -> dict[str, list[Part]]:
    """The plan for every weight ``expected_shapes(config)`` lists; tied models take lm_head from the embedding."""
    shapes = expected_shapes(config)
    hidden, inter, off = config.hidden_size, config.intermediate_size, names.norm_offset
    q_rows, kv_rows = config.num_attention_heads * config.head_size, config.kv_channels
    top = {
        "transformer.vocab_embedding.weight": names.embedding,
        "transformer.ln_f.weight": names.final_norm,
        "lm_head.weight": names.embedding if config.tie_word_embeddings else names.lm_head,
    }
    plan = {name: [Part(source, shapes[name], offset=off if name == "transformer.ln_f.weight" else 0.0)]
            for name, source in top.items()}
    for layer in range(config.num_hidden_layers):
        prefix = layer_prefix(layer)
        norms = {"input_layernorm.weight": names.input_norm, "post_layernorm.weight": names.post_norm,
                 "attention.q_layernorm.weight": names.q_norm, "attention.k_layernorm.weight": names.k_norm,
                 "pre_feedforward_layernorm.weight": names.pre_ff_norm,
                 "post_feedforward_layernorm.weight": names.post_ff_norm}
        linears = {"attention.dense.weight": names.dense, "mlp.proj.weight": names.mlp_down}
        if not names.fused_gate_up:
            linears.update({"mlp.fc.weight": names.mlp_gate, "mlp.gate.weight": names.mlp_up})
        for suffix, template in {**norms, **linears}.items():
            name = f"{prefix}.{suffix}"
            if name in shapes:
                plan[name] = [Part(template.format(l=layer), shapes[name], offset=off if suffix in norms else 0.0)]
        if names.fused_gate_up:
            fused = names.mlp_gate.format(l=layer)
            plan[f"{prefix}.mlp.fc.weight"] = [Part(fused, (2 * inter, hidden), rows=(0, inter))]
            plan[f"{prefix}.mlp.gate.weight"] = [Part(fused, (2 * inter, hidden), rows=(inter, 2 * inter))]
        if names.fused_qkv:
            plan[f"{prefix}.attention.qkv.weight"] = [Part(names.q.format(l=layer), (q_rows + 2 * kv_rows, hidden))]
            continue
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
        tensors = [part.take(model.load(part.name)) for part in parts]
        for part, tensor in zip(parts, tensors):
            if not all_finite(tensor):
                raise CheckpointError(
                    f"{source}: tensor {part.name} has {int(tensor.isnan().sum())} NaN and "
                    f"{int(tensor.isinf().sum())} infinite values (of {tensor.numel()}); a model with NaN or "
                    "infinite weights cannot run: the file is damaged or the weights diverged in training, use "
                    "another copy of the model"
                )
        yield name, torch.cat(tensors, dim=0)
