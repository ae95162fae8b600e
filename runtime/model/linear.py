"""The linear op of every stored weight format: full precision, W8A16, W4A16-AWQ and int4-g32 (and the int8 head),
dequantized on the fly (the few tokens of a native decode step: dequantized in registers by
runtime/kernels/quant_matvec.c).

Layouts are those of a TensorRT-LLM checkpoint as ModelOpt exports it (modelopt/torch/export/quant_utils.py,
``to_quantized_weight`` and ``pack_int4_in_uint8``; read by TensorRT-LLM's ``WeightOnlyQuantLinear`` and
``WeightOnlyGroupwiseQuantLinear`` in tensorrt_llm/quantization/layers.py):

- W8A16: ``weight`` int8 (out, in), ``weights_scaling_factor`` float32 (out,); w = q * s[out].
- W4A16_AWQ: ``weight`` int8 (out / 2, in) holding two signed int4 per byte, row 2r in the low nibble and
  row 2r + 1 in the high one; ``weights_scaling_factor`` (out, in / group); ``prequant_scaling_factor`` (in,),
  which multiplies the input: y = (x * p) @ (q * s[out, in // group]).T.
- int4-g32 (llama.cpp's Q4_1 block, ggml-quants.c ``dequantize_row_q4_1``): ``weight`` uint8 (out, in / 2), the 32
  inputs of a group in 16 bytes, input j in the low nibble of byte j and input j + 16 in the high one;
  ``weights_scaling_factor`` and ``weights_minimum`` fp16 (out, in / 32); w = q * d + m.
- int8 head (llama.cpp's Q8_0 block, ``dequantize_row_q8_0``): int8 (vocab, hidden), fp16 scale (vocab, hidden / 32);
  w = q * d.

The int4-g32 and int8-head ops take ``int8_x`` (int4-g32-a8): the input rounded to int8 per 32 inputs first
(``int8_blocks``), which the native kernels multiply as integers and the torch path as the floats they stand for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from cabinllm.runtime.formats.weight_formats import GGUF_GROUP, MINIMUM, PREQUANT, SCALE, Int4G32, WeightFormat
from cabinllm.runtime.kernels.bindings import KernelLinear, MatVec, WeightsKind, quant_matvec

INT4_MIN, INT4_MAX = -8, 7


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 values (out, in) in [-8, 7] -> int8 (out / 2, in), even rows in the low nibbles."""
    q = q.to(torch.int8)
    return (q[0::2] & 0x0F) | (q[1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 (out / 2, in) of ``pack_int4`` -> int8 (out, in) with values in [-8, 7]."""
    low = (packed << 4) >> 4  # arithmetic shifts sign-extend the low nibble
    high = packed >> 4
    return torch.stack([low, high], dim=1).reshape(2 * packed.shape[0], packed.shape[1])


@dataclass
class Int8Linear:
    """W8A16: int8 (out, in) weights with one float32 scale per output channel."""

    weight: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The fp32 (out, in) weight."""
        return self.weight.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
        kernel = quant_matvec() if native else None
        if kernel is not None:
            return kernel.int8(x, self.weight, self.scale, bias)
        return F.linear(x, self.dequantize(), bias)

    def full_precision(self) -> torch.Tensor:
        """The fp32 (out, in) weight of the same op."""
        return self.dequantize()


@dataclass
class Int4AwqLinear:
    """W4A16-AWQ: packed int4 weights, one scale per output channel and input group, a per-input prequant scale."""

    packed: torch.Tensor
    scale: torch.Tensor
    prequant: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """The fp32 (out, in) weight the prequant-scaled input is multiplied by."""
        return unpack_int4(self.packed).float() * self.scale.float().repeat_interleave(self.group_size, dim=1)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
        kernel = quant_matvec() if native else None
        if kernel is not None:
            return kernel.int4(x * self.prequant, self.packed, self.scale, self.group_size, bias)
        return F.linear(x * self.prequant, self.dequantize(), bias)

    def full_precision(self) -> torch.Tensor:
        """The fp32 (out, in) weight of the same op on the unscaled input (prequant scale folded in)."""
        return self.dequantize() * self.prequant.float()[None, :]


def unpack_g32(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (out, in / 2) of int4-g32 -> (out, in) values in [0, 15], in input order."""
    out = codes.shape[0]
    blocks = codes.view(out, -1, GGUF_GROUP // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(out, -1)


def pack_g32(q: torch.Tensor) -> torch.Tensor:
    """Values (out, in) in [0, 15] -> uint8 codes (out, in / 2) of ``unpack_g32``."""
    blocks = q.to(torch.uint8).view(q.shape[0], -1, GGUF_GROUP)
    half = GGUF_GROUP // 2
    return (blocks[..., :half] | (blocks[..., half:] << 4)).reshape(q.shape[0], -1)


def _per_input(groups: torch.Tensor) -> torch.Tensor:
    return groups.float().repeat_interleave(GGUF_GROUP, dim=-1)


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x (..., in) as int8 activations see it: per 32 inputs e = max |x| / 127 and x -> round(x / e) * e (llama.cpp's
    quantize_row_q8_1 with a float32 e; ties to even, as quant_matvec.c's int8_blocks rounds)."""
    blocks = x.float().unflatten(-1, (-1, GGUF_GROUP))
    e = blocks.abs().amax(-1, keepdim=True) * (1.0 / 127.0)
    inverse = torch.where(e > 0, 1.0 / e, 0.0)
    return (torch.round(blocks * inverse).clamp(-127, 127) * e).flatten(-2)


@dataclass
class Int4G32Linear:
    """int4-g32: 4-bit codes with an fp16 scale and minimum per 32 inputs (llama.cpp's Q4_1 block)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    int8_x: bool = False

    def dequantize(self) -> torch.Tensor:
        """The fp32 (out, in) weight, q * d + m as llama.cpp computes it."""
        return unpack_g32(self.codes).float() * _per_input(self.scale) + _per_input(self.minimum)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
        kernel = quant_matvec() if native else None
        if kernel is not None:
            return kernel.q4g32(x, self.codes, self.scale, self.minimum, bias, self.int8_x)
        return F.linear(int8_blocks(x) if self.int8_x else x, self.dequantize(), bias)

    def full_precision(self) -> torch.Tensor:
        """The fp32 (out, in) weight of the same op."""
        return self.dequantize()


@dataclass
class Int8G32Table:
    """The int8 head: int8 rows with an fp16 scale per 32 columns (llama.cpp's Q8_0 block), as the embedding table
    (rows looked up and dequantized) and as the lm_head."""

    codes: torch.Tensor
    scale: torch.Tensor
    int8_x: bool = False  # the lm_head's input rounded to int8 per 32 (int4-g32-a8)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows of these ids."""
        return self.codes[ids].float() * _per_input(self.scale[ids])

    def dequantize(self) -> torch.Tensor:
        """The fp32 (vocab, hidden) table."""
        return self.codes.float() * _per_input(self.scale)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
        kernel = quant_matvec() if native else None
        if kernel is not None:
            return kernel.q8g32(x, self.codes, self.scale, bias, self.int8_x)
        return F.linear(int8_blocks(x) if self.int8_x else x, self.dequantize(), bias)

    def full_precision(self) -> torch.Tensor:
        """The fp32 (vocab, hidden) table of the same op."""
        return self.dequantize()


@dataclass
class Stacked:
    """Two linears of the same input whose outputs are concatenated (the MLP's fc and gate when they do not share
    their prequant scales)."""

    parts: tuple[Linear, Linear]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
        return torch.cat([part(x, None, native) for part in self.parts], dim=-1)

    def full_precision(self) -> torch.Tensor:
        """The fp32 weight of both parts, stacked."""
        return torch.cat([full_precision(part) for part in self.parts])


Linear = Union[torch.Tensor, Int8Linear, Int4AwqLinear, Int4G32Linear, Int8G32Table, Stacked]


def linear_op(fmt: WeightFormat, tensors: dict[str, torch.Tensor], quantization: dict) -> Linear:
    """The reference engine's linear op over one layer's stored tensors (by suffix) in format ``fmt``."""
    if fmt.name == "int8":
        return Int8Linear(tensors["weight"].contiguous(), tensors[SCALE].float().contiguous())
    if fmt.name == "int4-awq":
        return Int4AwqLinear(tensors["weight"].contiguous(), tensors[SCALE].float().contiguous(),
                             tensors[PREQUANT].float(), fmt.group_size(quantization))
    if isinstance(fmt, Int4G32):
        return Int4G32Linear(tensors["weight"].contiguous(), tensors[SCALE].contiguous(),
                             tensors[MINIMUM].contiguous(), fmt.int8_activations)
    return tensors["weight"].float().contiguous()


def stack(first: Linear, second: Linear) -> Linear:
    """One linear computing both outputs, concatenated: one matrix where the formats allow it."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return torch.cat([first, second])
    if isinstance(first, Int8Linear) and isinstance(second, Int8Linear):
        return Int8Linear(torch.cat([first.weight, second.weight]), torch.cat([first.scale, second.scale]))
    if isinstance(first, Int4G32Linear) and isinstance(second, Int4G32Linear) and first.int8_x == second.int8_x:
        return Int4G32Linear(*(torch.cat([a, b]) for a, b in zip((first.codes, first.scale, first.minimum),
                                                                  (second.codes, second.scale, second.minimum))),
                             first.int8_x)
    return Stacked((first, second))


def linear(x: torch.Tensor, weight: Linear, mv: MatVec | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; on the native kernels where there are (``mv`` given: a decode step of at most
    MATVEC_MAX_TOKENS tokens)."""
    if not isinstance(weight, torch.Tensor):
        return weight(x, bias, mv is not None)
    return mv(x, weight, bias) if mv is not None else F.linear(x, weight.float(), bias)


def full_precision(weight: Linear) -> torch.Tensor:
    """The fp32 (out, in) matrix W of an op computing x @ W.T (quantized weights dequantized, scales folded in)."""
    return weight.float() if isinstance(weight, torch.Tensor) else weight.full_precision()


def halves(both: Linear) -> tuple[Linear, Linear]:
    """The two ops ``stack`` joined, as views of its weights."""
    if isinstance(both, Stacked):
        return both.parts
    if isinstance(both, Int8Linear):
        rows = both.weight.shape[0] // 2
        return (Int8Linear(both.weight[:rows], both.scale[:rows]), Int8Linear(both.weight[rows:], both.scale[rows:]))
    if isinstance(both, Int4G32Linear):
        rows = both.codes.shape[0] // 2
        return (Int4G32Linear(both.codes[:rows], both.scale[:rows], both.minimum[:rows], both.int8_x),
                Int4G32Linear(both.codes[rows:], both.scale[rows:], both.minimum[rows:], both.int8_x))
    if isinstance(both, torch.Tensor):
        return both[: both.shape[0] // 2], both[both.shape[0] // 2:]
    raise ValueError(f"{type(both).__name__} is not a stacked pair of linear ops")


def kernel_linear(weight: Linear, bias: torch.Tensor | None = None) -> KernelLinear | None:
    """The op as the fused decode step runs it (runtime/kernels/decode_step.c); None where it has no such form
    (a pair of ops, weights of another dtype)."""
    bias = None if bias is None else bias.float().contiguous()
    if isinstance(weight, Int8Linear):
        return KernelLinear(WeightsKind.INT8, weight.weight.contiguous(), *weight.weight.shape,
                            scale=weight.scale.float().contiguous(), bias=bias)
    if isinstance(weight, Int4AwqLinear):
        return KernelLinear(WeightsKind.INT4, weight.packed.contiguous(), 2 * weight.packed.shape[0],
                            weight.packed.shape[1], scale=weight.scale.float().contiguous(),
                            prequant=weight.prequant.float().contiguous(), group=weight.group_size, bias=bias)
    if isinstance(weight, Int4G32Linear):
        kind = WeightsKind.Q4G32_INT8_X if weight.int8_x else WeightsKind.Q4G32
        return KernelLinear(kind, weight.codes.contiguous(), weight.codes.shape[0],
                            2 * weight.codes.shape[1], scale=weight.scale.contiguous(), group=GGUF_GROUP, bias=bias,
                            minimum=weight.minimum.contiguous())
    kinds = {torch.float32: WeightsKind.FP32, torch.float16: WeightsKind.FP16}
    if isinstance(weight, torch.Tensor) and weight.dtype in kinds:
        return KernelLinear(kinds[weight.dtype], weight.contiguous(), *weight.shape, bias=bias)
    return None
