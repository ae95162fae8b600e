"""The one registry of stored weight formats: full precision, W8A16 and W4A16-AWQ (``WEIGHT_FORMATS``).

A format names the ``quantization.quant_algo`` of a TensorRT-LLM checkpoint, the tensors each linear layer
stores (names, shapes, dtypes: what ModelOpt's ``export_tensorrt_llm_checkpoint`` writes and TensorRT-LLM's
loaders read) and their bytes; the op that runs each format is ``cabinllm.runtime.model.linear.linear_op``.
Embedding, lm_head and norms stay in the checkpoint's float dtype in every format (ModelOpt exports
``exclude_modules: ["lm_head"]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cabinllm.runtime.errors import ConfigError, WeightFormatError

LINEAR_LAYERS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
SCALE = "weights_scaling_factor"
PREQUANT = "prequant_scaling_factor"
AWQ_GROUP_SIZES = (128, 64)  # TensorRT-LLM's groupwise W4A16 kernels take 64 and 128; 128 preferred
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

    def group_size(self, quantization: dict) -> int | None:
        return quantization.get("group_size", 128)

    def stored(self, out: int, inp: int, quantization: dict) -> dict[str, Stored]:
        group = self.group_size(quantization)
        return {"weight": Stored((out // 2, inp), (torch.int8,)),
                SCALE: Stored((out, inp // group), (torch.float32,) + _FLOATS),
                PREQUANT: Stored((inp,), _FLOATS)}


    def weight_bytes(self, out: int, inp: int, quantization: dict, float_bytes: int = 2) -> int:
        return out * inp // 2 + 4 * out * (inp // self.group_size(quantization)) + float_bytes * inp


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (WeightFormat(), W8A16(), W4A16Awq())}
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
                                f"{known}); export the model again with one of those (cabin-build --weights "
                                f"{'|'.join(WEIGHT_FORMATS)})")
    group = fmt.group_size(quantization)
    if group is not None:
        if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
            raise WeightFormatError(f"{source}: group_size {group!r} must be a positive integer; export the model "
                                    f"again with group size {' or '.join(map(str, AWQ_GROUP_SIZES))}")
        for layer, inputs in linear_inputs.items():
            if inputs % group:
                fits = [g for g in AWQ_GROUP_SIZES if inputs % g == 0]
                raise WeightFormatError(f"{source}: group_size {group} does not divide the {inputs} inputs of "
                                        f"{layer}; export the model again with group size "
                                        f"{fits[0] if fits else 'that divides every input size'}")
    return fmt


def awq_group_size(input_sizes: list[int]) -> int:
    """The largest of AWQ_GROUP_SIZES dividing every input size; ValueError when none does."""
    for group in AWQ_GROUP_SIZES:
        if all(size % group == 0 for size in input_sizes):
            return group
    raise ConfigError(f"no AWQ group size of {', '.join(map(str, AWQ_GROUP_SIZES))} divides the input sizes "
                     f"{sorted(set(input_sizes))}; use --weights int8 for this model")

