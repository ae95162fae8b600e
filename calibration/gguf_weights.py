"""int4-g32 linear weights and the int8 head, made from a model's source without re-rounding where it can be.

A tensor whose source holds it in llama.cpp's blocks (Q4_0 / Q4_1 for a linear layer, Q8_0 for the embedding) is
taken as stored, block for block, when the checkpoint's values are still those blocks' (KV equalization, folded
into the weights before this step, changes them); every other tensor is rounded as llama.cpp's quantize writes
Q4_1 and Q8_0 (gguf-py's reference quantizer: per block of 32, d = (max - min) / 15 and m = min; d = amax / 127).
The checkpoint's layouts: cabinllm.runtime.model.linear.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cabinllm.runtime.formats.checkpoint import ModelConfig, layer_prefix, linear_inputs
from cabinllm.runtime.formats.weight_formats import (GGUF_GROUP, HEAD_KEY, HEAD_TENSORS, MINIMUM, SCALE, Int4G32,
                                                     Int8G32Head)
from cabinllm.runtime.model.linear import Int4G32Linear, Int8G32Table
from cabinllm.runtime.sources.gguf import Blocks, parse_blocks
from cabinllm.runtime.sources.weight_plan import SourceModel


@dataclass
class Conversion:
    """Which tensors a conversion took from the source's blocks and which it rounded."""

    exact: list[str] = field(default_factory=list)
    rounded: list[str] = field(default_factory=list)

    def record(self) -> dict:
        """The manifest's record: counts and the rounded tensors' names."""
        return {"from_source_blocks": len(self.exact), "rounded": len(self.rounded), "rounded_tensors": self.rounded}

    def summary(self, what: str) -> str:
        """One line for the build log."""
        total = len(self.exact) + len(self.rounded)
        text = f"{what}: {len(self.exact)} of {total} tensors taken from the source's blocks as stored"
        return text + (f", {len(self.rounded)} rounded (e.g. {self.rounded[0]})" if self.rounded else " (lossless)")


def source_blocks(source: SourceModel | None, name: str, bits: int) -> Blocks | None:
    """The blocks of the source tensors a checkpoint tensor is made of (rows concatenated), when each of them is
    stored in blocks of ``bits`` bits; None otherwise."""
    parts = None if source is None else source.plan.get(name)
    if not parts:
        return None
    found = []
    for part in parts:
        blocks = source.load_blocks(part.name)
        if blocks is None or blocks.bits != bits:
            return None
        found.append(blocks if part.rows is None else blocks.rows(slice(*part.rows)))
    if bits == 8:
        return Blocks(*(np.concatenate([getattr(b, k) for b in found]) for k in ("codes", "scale")), None)
    return Blocks(*(np.concatenate([getattr(b, k) for b in found]) for k in ("codes", "scale", "minimum")))


def _op(blocks: Blocks) -> Int4G32Linear | Int8G32Table:
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in (blocks.codes, blocks.scale, blocks.minimum)
               if a is not None]
    return Int8G32Table(*tensors) if blocks.bits == 8 else Int4G32Linear(*tensors)


def _rounded(weight: torch.Tensor, bits: int) -> Blocks:
    kind = GGMLQuantizationType.Q8_0 if bits == 8 else GGMLQuantizationType.Q4_1
    return parse_blocks(quantize(weight.float().numpy(), kind), kind)


def _convert(weights: dict[str, torch.Tensor], name: str, source: SourceModel | None, bits: int,
             done: Conversion) -> Blocks:
    """One (out, in) tensor in blocks: the source's where they still give the checkpoint's values, else rounded."""
    weight = weights[name]
    blocks = source_blocks(source, name, bits)
    if blocks is not None and torch.equal(_op(blocks).dequantize().to(weight.dtype), weight):
        done.exact.append(name)
        return blocks
    done.rounded.append(name)
    return _rounded(weight, bits)


def to_int4_g32(config: ModelConfig, weights: dict[str, torch.Tensor], source: SourceModel | None,
                fmt: Int4G32 = Int4G32()) -> tuple[ModelConfig, dict[str, torch.Tensor], Conversion]:
    """Full-precision ``config``/``weights`` with every linear layer in int4-g32 (Q4_0 / Q4_1 blocks of ``source``
    taken as stored where they still give the weights, the rest rounded to Q4_1), named ``fmt`` (int4-g32 or its
    int8-activation form)."""
    out, done = dict(weights), Conversion()
    for layer in range(config.num_hidden_layers):
        for linear in linear_inputs(config):
            base = f"{layer_prefix(layer)}.{linear}"
            blocks = _convert(out, f"{base}.weight", source, 4, done)
            out[f"{base}.weight"] = torch.from_numpy(blocks.codes)
            out[f"{base}.{SCALE}"] = torch.from_numpy(blocks.scale)
            out[f"{base}.{MINIMUM}"] = torch.from_numpy(blocks.minimum)
    quantization = {**config.quantization, "quant_algo": fmt.quant_algo, "group_size": GGUF_GROUP,
                    "has_zero_point": True}
    return replace(config, quantization=quantization), out, done


def to_int8_head(config: ModelConfig, weights: dict[str, torch.Tensor],
                 source: SourceModel | None) -> tuple[ModelConfig, dict[str, torch.Tensor], Conversion]:
    """``weights`` with the embedding and lm_head as int8 tables, an fp16 scale per 32 (the source's Q8_0 blocks
    where they still give the tables, the rest rounded to Q8_0)."""
    out, done = dict(weights), Conversion()
    for base in HEAD_TENSORS:
        blocks = _convert(out, f"{base}.weight", source, 8, done)
        out[f"{base}.weight"] = torch.from_numpy(blocks.codes)
        out[f"{base}.{SCALE}"] = torch.from_numpy(blocks.scale)
    return replace(config, quantization={**config.quantization, HEAD_KEY: Int8G32Head.name}), out, done
