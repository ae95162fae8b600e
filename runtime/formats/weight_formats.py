"""The one registry of stored weight formats: full precision, W8A16, W4A16-AWQ, int4-g32 and int4-g32-a8
(``WEIGHT_FORMATS``), and of the head's formats (``HEAD_FORMATS``).

A format names the ``quantization.quant_algo`` of a TensorRT-LLM checkpoint, the tensors each linear layer
stores (names, shapes, dtypes: what ModelOpt's ``export_tensorrt_llm_checkpoint`` writes and TensorRT-LLM's
loaders read) and their bytes; the op that runs each format is ``cabinllm.runtime.model.linear.linear_op``.
int4-g32 is not TensorRT-LLM's: llama.cpp's 4-bit blocks of 32 (Q4_0, Q4_1) held exactly, for the reference engine
and ONNX Runtime (``MatMulNBits`` with zero points); int4-g32-a8 stores the same blocks and computes as llama.cpp does,
each input rounded to int8 per 32 (Q8_1 blocks) as it runs, its integer products summed exactly. Embedding, lm_head and norms stay in the checkpoint's float
dtype (ModelOpt exports ``exclude_modules: ["lm_head"]``) unless the quantization block's ``head`` says ``int8``:
int8 rows with an fp16 scale per 32 (llama.cpp's Q8_0 block), for the reference engine only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cabinllm.runtime.errors import ConfigError, Fix, Hint, WeightFormatError

LINEAR_LAYERS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
SCALE = "weights_scaling_factor"
PREQUANT = "prequant_scaling_factor"
MINIMUM = "weights_minimum"
AWQ_GROUP_SIZES = (128, 64)  # TensorRT-LLM's groupwise W4A16 kernels take 64 and 128; 128 preferred
GGUF_GROUP = 32  # inputs per block of llama.cpp's Q4_0, Q4_1 and Q8_0
HEAD_KEY = "head"  # the quantization block's key naming the head format (absent: fp16)
HEAD_TENSORS = ("transformer.vocab_embedding", "lm_head")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Stored:
    """One tensor a linear layer stores: its shape and the dtypes it may have."""

    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class WeightFormat:
    """Full-precision linear weights: ``weight`` (out, in) in the checkpoint's float dtype."""

    name: str = "fp16"
    quant_algo: str | None = None
    label: str = "full precision (fp16 or fp32 as stored)"
    tensors: tuple[str, ...] = ("weight",)  # what each linear layer stores, by name suffix
    trtllm: bool = True  # TensorRT-LLM builds engines from it
    group_sizes: tuple[int, ...] = ()  # the group sizes it takes (none: not grouped)
    conversion: str = "the source's values as floats, nothing rounded (a GGUF's blocks dequantized)"
    int8_activations: bool = False  # each linear op's input rounded to int8 per 32 inputs as it runs

    def group_size(self, quantization: dict) -> int | None:
        """Inputs per scale group (None: per channel or not quantized)."""
        return None

    def stored(self, out: int, inp: int, quantization: dict) -> dict[str, Stored]:
        """Suffix (``weight``, ``weights_scaling_factor``, ...) -> the tensor a linear (out, in) layer stores."""
        return {"weight": Stored((out, inp), _FLOATS)}


    def weight_bytes(self, out: int, inp: int, quantization: dict, float_bytes: int = 2) -> int:
        """Bytes a linear (out, in) layer stores, scales included (float tensors at ``float_bytes`` each)."""
        return out * inp * float_bytes


@dataclass(frozen=True)
class W8A16(WeightFormat):
    """int8 (out, in) weights, one float32 scale per output channel (TensorRT-LLM's W8A16)."""

    name: str = "int8"
    quant_algo: str | None = "W8A16"
    label: str = "int8 weight-only, per-channel scales (W8A16)"
    tensors: tuple[str, ...] = ("weight", SCALE)
    conversion: str = "rounds every weight to 8 bits per channel (default model: +0.17% perplexity)"

    def stored(self, out: int, inp: int, quantization: dict) -> dict[str, Stored]:
        return {"weight": Stored((out, inp), (torch.int8,)), SCALE: Stored((out,), (torch.float32,) + _FLOATS)}


    def weight_bytes(self, out: int, inp: int, quantization: dict, float_bytes: int = 2) -> int:
        return out * inp + 4 * out


@dataclass(frozen=True)
class W4A16Awq(WeightFormat):
    """Packed int4 weights with per-group scales and AWQ's per-input prequant scale (TensorRT-LLM's W4A16_AWQ)."""

    name: str = "int4-awq"
    quant_algo: str | None = "W4A16_AWQ"
    label: str = "int4 weight-only AWQ, per-group scales (W4A16_AWQ)"
    tensors: tuple[str, ...] = ("weight", SCALE, PREQUANT)
    group_sizes: tuple[int, ...] = AWQ_GROUP_SIZES
    conversion: str = ("re-rounds into symmetric groups of 64 / 128 (default model, from its Q4_1 blocks: "
                       "+24% perplexity)")

    def group_size(self, quantization: dict) -> int | None:
        return quantization.get("group_size", 128)

    def stored(self, out: int, inp: int, quantization: dict) -> dict[str, Stored]:
        group = self.group_size(quantization)
        return {"weight": Stored((out // 2, inp), (torch.int8,)),
                SCALE: Stored((out, inp // group), (torch.float32,) + _FLOATS),
                PREQUANT: Stored((inp,), _FLOATS)}


    def weight_bytes(self, out: int, inp: int, quantization: dict, float_bytes: int = 2) -> int:
        return out * inp // 2 + 4 * out * (inp // self.group_size(quantization)) + float_bytes * inp


@dataclass(frozen=True)
class Int4G32(WeightFormat):
    """4-bit codes with an fp16 scale and minimum per 32 inputs, w = scale * q + minimum, q in [0, 15]: llama.cpp's
    Q4_1 block, which holds Q4_0 exactly too (minimum = -8 * scale); not a TensorRT-LLM format."""

    name: str = "int4-g32"
    quant_algo: str | None = "W4A16_G32"
    label: str = "int4 weight-only, scale and minimum per 32 inputs (GGUF Q4_0 / Q4_1 held exactly)"
    tensors: tuple[str, ...] = ("weight", SCALE, MINIMUM)
    trtllm: bool = False
    group_sizes: tuple[int, ...] = (GGUF_GROUP,)
    conversion: str = "copies a GGUF's Q4_0 / Q4_1 blocks: no loss (float weights are rounded to Q4_1 blocks)"

    def group_size(self, quantization: dict) -> int | None:
        return GGUF_GROUP

    def stored(self, out: int, inp: int, quantization: dict) -> dict[str, Stored]:
        groups = (out, inp // GGUF_GROUP)
        return {"weight": Stored((out, inp // 2), (torch.uint8,)), SCALE: Stored(groups, (torch.float16,)),
                MINIMUM: Stored(groups, (torch.float16,))}

    def weight_bytes(self, out: int, inp: int, quantization: dict, float_bytes: int = 2) -> int:
        return out * inp // 2 + 4 * out * (inp // GGUF_GROUP)


@dataclass(frozen=True)
class HeadFormat:
    """The embedding and lm_head as stored: the checkpoint's float dtype."""

    name: str = "fp16"
    label: str = "as the checkpoint's floats (fp16)"

    def stored(self, vocab: int, hidden: int) -> dict[str, Stored] | None:
        """Suffix -> the tensor the embedding (or lm_head) stores; None: one float ``weight``."""
        return None

    def head_bytes(self, vocab: int, hidden: int, float_bytes: int = 2) -> int:
        """Bytes of one of the two (vocab, hidden) tables."""
        return vocab * hidden * float_bytes


@dataclass(frozen=True)
class Int8G32Head(HeadFormat):
    """int8 (vocab, hidden) with an fp16 scale per 32 columns, w = scale * q: llama.cpp's Q8_0 block."""

    name: str = "int8"
    label: str = "int8, an fp16 scale per 32 (GGUF Q8_0 held exactly)"

    def stored(self, vocab: int, hidden: int) -> dict[str, Stored] | None:
        return {"weight": Stored((vocab, hidden), (torch.int8,)),
                SCALE: Stored((vocab, hidden // GGUF_GROUP), (torch.float16,))}

    def head_bytes(self, vocab: int, hidden: int, float_bytes: int = 2) -> int:
        return vocab * hidden + 2 * vocab * (hidden // GGUF_GROUP)


HEAD_FORMATS: dict[str, HeadFormat] = {f.name: f for f in (HeadFormat(), Int8G32Head())}


def head_format(quantization: dict) -> HeadFormat:
    """The head format a checkpoint's ``quantization`` block names; WeightFormatError for an unknown one."""
    name = quantization.get(HEAD_KEY) or "fp16"
    if name not in HEAD_FORMATS:
        raise WeightFormatError(f"quantization.{HEAD_KEY} {name!r} is not a head format the reference engine runs "
                                f"({', '.join(HEAD_FORMATS)})", (Hint(Fix.BUILD_HEAD, " or ".join(HEAD_FORMATS)),))
    return HEAD_FORMATS[name]


@dataclass(frozen=True)
class Int4G32Int8Activations(Int4G32):
    """int4-g32's blocks, each linear op's input rounded to int8 per 32 inputs as it runs (llama.cpp's Q8_1 block
    with a float32 scale): the integer products of the two summed exactly, as llama.cpp's Q4_1 x Q8_1 dot does;
    an int8 head computes on the same int8 inputs (Q8_0 x Q8_1)."""

    name: str = "int4-g32-a8"
    quant_algo: str | None = "W4A8_G32"
    label: str = ("int4 weights, scale and minimum per 32 inputs (GGUF Q4_0 / Q4_1 held exactly), int8 activations "
                  "per 32 inputs")
    conversion: str = ("copies a GGUF's Q4_0 / Q4_1 blocks: no loss in the weights; the activations are rounded to "
                       "int8 as they run (default model: +0.3% perplexity)")
    int8_activations: bool = True


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (WeightFormat(), W8A16(), W4A16Awq(), Int4G32(),
                                                                  Int4G32Int8Activations())}
_BY_ALGO = {f.quant_algo: f for f in WEIGHT_FORMATS.values()}


def weight_format(name: str) -> WeightFormat:
    """The format of a name (fp16, int8, int4-awq); ValueError naming the known ones otherwise."""
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown weight format {name!r}; choose one of {', '.join(WEIGHT_FORMATS)}") from None


def checkpoint_format(quantization: dict, linear_inputs: dict[str, int], source: str) -> WeightFormat:
    """The format of a checkpoint's ``quantization`` block; WeightFormatError naming the problem and the fix for
    a ``quant_algo`` the reference engine does not run or a group size that does not divide a layer's inputs
    (``linear_inputs``: layer suffix -> input size)."""
    algo = quantization.get("quant_algo")
    fmt = _BY_ALGO.get(algo)
    if fmt is None:
        known = ", ".join(str(f.quant_algo) for f in WEIGHT_FORMATS.values() if f.quant_algo)
        raise WeightFormatError(f"{source}: quant_algo {algo!r} is not run by the reference engine (it runs null, "
                                f"{known})", (Hint(Fix.BUILD_WEIGHTS, "|".join(WEIGHT_FORMATS)),))
    group = fmt.group_size(quantization)
    if group is not None:
        if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
            raise WeightFormatError(f"{source}: group_size {group!r} must be a positive integer; export the model "
                                    f"again with group size {' or '.join(map(str, fmt.group_sizes))}")
        for layer, inputs in linear_inputs.items():
            if inputs % group:
                fits = [g for g in fmt.group_sizes if inputs % g == 0]
                problem = f"{source}: group_size {group} does not divide the {inputs} inputs of {layer}; "
                if fits:
                    raise WeightFormatError(problem + f"export the model again with group size {fits[0]}")
                raise WeightFormatError(problem + f"{fmt.name} cannot hold this model",
                                        (Hint(Fix.BUILD_WEIGHTS, "int8"),))
    head_format(quantization)
    return fmt


def awq_group_size(input_sizes: list[int]) -> int:
    """The largest of AWQ_GROUP_SIZES dividing every input size; ValueError when none does."""
    for group in AWQ_GROUP_SIZES:
        if all(size % group == 0 for size in input_sizes):
            return group
    raise ConfigError(f"no AWQ group size of {', '.join(map(str, AWQ_GROUP_SIZES))} divides the input sizes "
                     f"{sorted(set(input_sizes))}", (Hint(Fix.BUILD_WEIGHTS, "int8"),))

