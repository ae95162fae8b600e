"""Native decode kernels, compiled from C with the system's compiler at first use and cached on disk.

Decoding is bound by memory reads. Five kernels in runtime/kernels/ serve that case:
- ``matvec.c``: a linear layer for the tokens of a decode step (one per sequence) over the checkpoint's
  (out, in) fp32 or fp16 weights, read once for all of them;
- ``quant_matvec.c``: the same over W8A16, W4A16-AWQ, int4-g32 and int8-head weights, dequantized in registers
  (both on ``vec.h``'s vectors: 16 lanes with AVX-512, 8 with AVX2);
- ``decode_attention.c``: the attention of one token straight from a paged cache of int8
  (static or per-token scales), fp16 or fp32 elements, with no gather and no converted copy of
  the history (built per element type, head size and group);
- ``int4_dequantize.c``: a sequence's INT4 blocks of one layer to fp32 K and V in one pass
  (built per head size and value group);
- ``decode_step.c``: a whole decode step of one or several sequences (a token each) through every layer (norms,
  the linear kernels above on all the tokens at once, RoPE, the new K/V stored, attention, MLP) in one call, over
  a cache whose pools convert with one static scale per layer (fp32, fp16, int8 with static scales; built like the
  attention kernel).

They are built with ``-O3 -march=native -fopenmp`` (the linear kernels split large matrices by rows, and attention
a long history, over the threads of the OpenMP runtime torch loads, so ``torch.set_num_threads`` sets theirs too;
the results do not depend on the thread count) into ``$CABIN_KERNEL_DIR`` (default
``~/.cache/cabinllm/kernels``) and loaded with ctypes. Where no C compiler is found or a build
fails, a warning names the cause and the model keeps its torch path (same math, slower).
``CABIN_NATIVE_KERNELS=0`` turns them off; ``CC`` picks the compiler (default ``cc``).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from enum import IntEnum
from importlib import resources
from pathlib import Path

import torch

KERNEL_SOURCES = Path(str(resources.files("cabinllm.runtime.kernels")))
# -ffast-math only when compiling: linked with it, the library would switch the whole process to
# flushing subnormal floats to zero when it is loaded.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
_POINTER, _SIZE, _REAL = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
GROUP_INPUTS = 32  # inputs per scale of the group kernels (llama.cpp's blocks)
MATVEC_MAX_TOKENS = 16  # tokens of a step the linear kernel takes (one per decoding sequence); more: BLAS
ELEMENT_DEFINES = {torch.int8: {"ELEMENT": "int8_t", "INT8_ELEMENTS": 1}, torch.float32: {"ELEMENT": "float"},
                   torch.float16: {"ELEMENT": "uint16_t", "HALF_ELEMENTS": 1}}


@dataclass
class StoredKV:
    """One layer's K and V as a cache stores them, for the decode attention kernel to read in place.

    k, v: contiguous pools (blocks, tokens_per_block, kv_heads, head_size) of int8, fp16 or fp32;
    block_table: int64 block ids of the sequence in those pools; k_scale, v_scale: static INT8 scales
    (1 otherwise); k_token_scales, v_token_scales: fp16 scales (blocks, tokens_per_block, kv_heads)
    of a per-token INT8 cache.
    """

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    k_token_scales: torch.Tensor | None = None
    v_token_scales: torch.Tensor | None = None


@dataclass
class StaticPools:
    """All layers' K and V pools (layers, blocks, tokens_per_block, kv_heads, head_size) of a cache whose
    elements are each layer's values divided by one static scale (float32 (layers,); ones for fp32 and fp16
    pools): what a fused decode step stores into and reads."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor
    v_scales: torch.Tensor


class WeightsKind(IntEnum):
    """How decode_step.c reads a linear op's weights (its WEIGHTS_* codes)."""

    FP32 = 0
    FP16 = 1
    INT8 = 2
    INT4 = 3
    Q4G32 = 4
    Q4G32_INT8_X = 5


@dataclass
class KernelLinear:
    """One linear op as decode_step.c runs it: y = W x + b over (rows, cols) weights of ``kind``; INT8: per-row
    ``scale``; INT4: packed (rows / 2, cols) weights, ``scale`` (rows, cols / group) and the input's
    ``prequant`` scale; Q4G32: uint8 codes (rows, cols / 2), fp16 ``scale`` and ``minimum`` (rows, cols / 32)
    (cabinllm.runtime.model.linear's layouts)."""

    kind: WeightsKind
    weight: torch.Tensor
    rows: int
    cols: int
    scale: torch.Tensor | None = None
    prequant: torch.Tensor | None = None
    group: int = 0
    bias: torch.Tensor | None = None
    minimum: torch.Tensor | None = None


@dataclass
class KernelLayer:
    """One decoder layer's weights for decode_step.c: fp32 norm weights, its five linear ops and, where the model
    normalizes each query and key head (Qwen3), those norms' weights."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: KernelLinear
    dense: KernelLinear
    fc: KernelLinear
    gate: KernelLinear
    proj: KernelLinear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def compiler() -> str:
    """The C compiler the kernels are built with: ``$CC``, else ``cc``."""
    return os.environ.get("CC", "cc")


def _bind(library: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    """A C function of the library with its argument types set; it returns nothing."""
    function = getattr(library, name)
    function.argtypes, function.restype = argtypes, None
    return function


def native_kernels_enabled() -> bool:
    """False when ``CABIN_NATIVE_KERNELS=0`` asks for the torch path only."""
    return os.environ.get("CABIN_NATIVE_KERNELS", "1") != "0"


class MatVec:
    """``F.linear`` for up to ``MATVEC_MAX_TOKENS`` tokens (a decode step), over contiguous fp32 or fp16 (out, in)
    weights."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {dtype: _bind(library, name, [_POINTER] * 4 + [_SIZE, _SIZE, _SIZE])
                     for dtype, name in ((torch.float32, "matvec"), (torch.float16, "matvec_half"))}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (n, in) times weight (out, in) transposed, plus bias (out,); returns (n, out) in fp32. Each token's
        row is computed as it would be alone; fp16 weights as their exact fp32 values."""
        rows, cols = weight.shape
        if (x.dim() != 2 or not 1 <= x.shape[0] <= MATVEC_MAX_TOKENS or x.shape[1] != cols
                or x.dtype != torch.float32 or weight.dtype not in self._fns
                or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous())):
            raise ValueError(f"matvec needs fp32 x of shape (n, {cols}) with 1 <= n <= {MATVEC_MAX_TOKENS} and "
                             f"contiguous fp32 or fp16 weights, got {x.dtype} {tuple(x.shape)} against "
                             f"{weight.dtype} weights {tuple(weight.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], rows)
        self._fns[weight.dtype](weight.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                out.data_ptr(), x.shape[0], rows, cols)
        return out


class QuantMatVec:
    """``F.linear`` for up to ``MATVEC_MAX_TOKENS`` tokens (a decode step) over W8A16, W4A16-AWQ, int4-g32 or int8
    head weights (cabinllm.runtime.model.linear's layouts), dequantized in registers."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._int8 = _bind(library, "matvec_int8", [_POINTER] * 5 + [_SIZE, _SIZE, _SIZE])
        self._int4 = _bind(library, "matvec_int4", [_POINTER] * 5 + [_SIZE, _SIZE, _SIZE, _SIZE])
        self._q4g32 = _bind(library, "matvec_q4g32", [_POINTER] * 6 + [_SIZE] * 4)
        self._q8g32 = _bind(library, "matvec_q8g32", [_POINTER] * 5 + [_SIZE] * 4)

    def q4g32(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              bias: torch.Tensor | None = None, int8_x: bool = False) -> torch.Tensor:
        """x (n, in) times int4-g32 weights (uint8 codes (out, in / 2), fp16 scale and minimum (out, in / 32)),
        plus bias; returns (n, out), each token's row as it would be alone. ``int8_x``: x rounded to int8 per 32
        inputs first (cabinllm.runtime.model.linear.int8_blocks), the products summed as integers."""
        rows, cols = codes.shape[0], 2 * codes.shape[1]
        _check_groups(x, codes, torch.uint8, (scale, minimum), bias, rows, cols)
        out = torch.empty(x.shape[0], rows)
        self._q4g32(codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), x.contiguous().data_ptr(),
                    None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], rows, cols, int8_x)
        return out

    def q8g32(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, int8_x: bool = False) -> torch.Tensor:
        """x (n, in) times int8 codes (out, in) with an fp16 scale per 32 inputs (out, in / 32), plus bias; returns
        (n, out), each token's row as it would be alone; ``int8_x`` as for q4g32."""
        rows, cols = codes.shape
        _check_groups(x, codes, torch.int8, (scale,), bias, rows, cols)
        out = torch.empty(x.shape[0], rows)
        self._q8g32(codes.data_ptr(), scale.data_ptr(), x.contiguous().data_ptr(),
                    None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], rows, cols, int8_x)
        return out

    def int8(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (n, in) times int8 weight (out, in) with per-row float32 scales, plus bias; returns (n, out), each
        token's row as it would be alone."""
        rows, cols = weight.shape
        _check_quantized(x, weight, scale, bias, cols, (rows,))
        out = torch.empty(x.shape[0], rows)
        self._int8(weight.data_ptr(), scale.data_ptr(), x.contiguous().data_ptr(),
                   None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], rows, cols)
        return out

    def int4(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (n, in), already times the prequant scale, against packed int4 weights (out / 2, in) with float32
        scales (out, in / group), plus bias; returns (n, out), each token's row as it would be alone."""
        rows, cols = 2 * packed.shape[0], packed.shape[1]
        _check_quantized(x, packed, scale, bias, cols, (rows, cols // group))
        if cols % group:
            raise ValueError(f"group size {group} does not divide the {cols} inputs")
        out = torch.empty(x.shape[0], rows)
        self._int4(packed.data_ptr(), scale.data_ptr(), x.contiguous().data_ptr(),
                   None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], rows, cols, group)
        return out


def _check_quantized(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     cols: int, scale_shape: tuple[int, ...]) -> None:
    if (x.dim() != 2 or not 1 <= x.shape[0] <= MATVEC_MAX_TOKENS or x.shape[1] != cols
            or x.dtype != torch.float32 or weight.dtype != torch.int8
            or not weight.is_contiguous() or scale.dtype != torch.float32 or not scale.is_contiguous()
            or tuple(scale.shape) != scale_shape or (bias is not None and not bias.is_contiguous())):
        raise ValueError(f"quantized matvec needs fp32 x (n, {cols}) with 1 <= n <= {MATVEC_MAX_TOKENS}, "
                         f"contiguous int8 weights and float32 scales {list(scale_shape)}, got {x.dtype} "
                         f"{tuple(x.shape)}, {weight.dtype} {tuple(weight.shape)}, {scale.dtype} "
                         f"{tuple(scale.shape)}")


def _check_groups(x: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype, scales: tuple[torch.Tensor, ...],
                  bias: torch.Tensor | None, rows: int, cols: int) -> None:
    shape = (rows, cols // GROUP_INPUTS)
    if (x.dim() != 2 or not 1 <= x.shape[0] <= MATVEC_MAX_TOKENS or x.shape[1] != cols or x.dtype != torch.float32
            or cols % GROUP_INPUTS or codes.dtype != dtype or not codes.is_contiguous()
            or any(s.dtype != torch.float16 or not s.is_contiguous() or tuple(s.shape) != shape for s in scales)
            or (bias is not None and not bias.is_contiguous())):
        raise ValueError(f"group matvec needs fp32 x (n, {cols}) with 1 <= n <= {MATVEC_MAX_TOKENS} and inputs a "
                         f"multiple of {GROUP_INPUTS}, contiguous "
                         f"{dtype} codes and fp16 scales {list(shape)}, got {x.dtype} {tuple(x.shape)}, "
                         f"{codes.dtype} {tuple(codes.shape)}, {[(s.dtype, tuple(s.shape)) for s in scales]}")


class DecodeAttention:
    """The attention kernel for one element type, head size and group; call it once per layer and decoded token."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype, head_size: int, group: int) -> None:
        self.dtype, self.head_size, self.group = dtype, head_size, group
        self._fn = _bind(library, "decode_attention",
                         [_POINTER] * 6 + [_SIZE, _SIZE, _SIZE, _SIZE, _REAL, _REAL, _POINTER, _POINTER])
        self._scratch = _bind(library, "decode_attention_scratch", [_SIZE, _SIZE, _SIZE])
        self._scratch.restype = _SIZE

    def __call__(self, q: torch.Tensor, stored: StoredKV, num_tokens: int, first: int = 0) -> torch.Tensor:
        """Attention of q (heads, head_size) over the tokens [first, num_tokens) of the table's cached ones.

        Returns (1, heads * head_size) in fp32.
        """
        _blocks, tokens_per_block, kv_heads, head_size = stored.k.shape
        token_scales = (stored.k_token_scales, stored.v_token_scales)
        pools = [stored.k, stored.v] + [t for t in token_scales if t is not None]
        if (stored.k.dtype != self.dtype or stored.v.dtype != self.dtype or head_size != self.head_size
                or q.shape[0] != kv_heads * self.group or not all(t.is_contiguous() for t in pools)
                or any(t is not None and t.dtype != torch.float16 for t in token_scales)):
            raise ValueError(f"kernel built for {self.dtype}, head size {self.head_size} and group {self.group} "
                             f"got q {tuple(q.shape)} over {stored.k.dtype} pools {tuple(stored.k.shape)} "
                             "(contiguous pools and fp16 token scales needed)")
        block_table = _int64_table(stored.block_table)
        if len(block_table) * tokens_per_block < num_tokens:
            raise ValueError(f"{num_tokens} tokens do not fit the {len(block_table)} blocks of the table")
        q = q.contiguous()
        scratch = torch.empty(self._scratch(num_tokens, tokens_per_block, kv_heads))
        out = torch.empty(q.shape[0], head_size)
        self._fn(q.data_ptr(), stored.k.data_ptr(), stored.v.data_ptr(),
                 *(None if t is None else t.data_ptr() for t in token_scales), block_table.data_ptr(),
                 num_tokens, first, tokens_per_block, kv_heads, stored.k_scale / head_size ** 0.5, stored.v_scale,
                 scratch.data_ptr(), out.data_ptr())
        return out.view(1, -1)


_LAYER_OPS = ("qkv", "dense", "fc", "gate", "proj")  # KernelLayer's linear ops, in the C struct's order


class _LinearOp(ctypes.Structure):
    _fields_ = [("kind", _SIZE), ("rows", _SIZE), ("cols", _SIZE), ("group", _SIZE), ("weight", _POINTER),
                ("scale", _POINTER), ("prequant", _POINTER), ("bias", _POINTER), ("minimum", _POINTER)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", _POINTER), ("post_norm", _POINTER)] + \
        [(name, _LinearOp) for name in _LAYER_OPS] + [("q_norm", _POINTER), ("k_norm", _POINTER)]


ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}  # decode_step.c's ACT_* codes


class StepWeights:
    """A model's layers as the C structs decode_step.c reads, and the MLP's activation (a key of
    ``ACTIVATION_CODES``); holds the tensors they point into."""

    def __init__(self, layers: list[KernelLayer], activation: str = "silu") -> None:
        self.layers, self.activation = layers, ACTIVATION_CODES[activation]
        self.array = (_LayerWeights * len(layers))(*(_layer_struct(layer) for layer in layers))
        first = layers[0]
        self.hidden, self.intermediate = first.dense.rows, first.fc.rows


def _pointer(tensor: torch.Tensor | None) -> int | None:
    if tensor is not None and not tensor.is_contiguous():
        raise ValueError(f"decode step weights must be contiguous, got strides {tensor.stride()}")
    return None if tensor is None else tensor.data_ptr()


def _layer_struct(layer: KernelLayer) -> _LayerWeights:
    ops = {name: getattr(layer, name) for name in _LAYER_OPS}
    return _LayerWeights(_pointer(layer.input_norm), _pointer(layer.post_norm),
                         **{name: _LinearOp(op.kind, op.rows, op.cols, op.group, _pointer(op.weight),
                                            _pointer(op.scale), _pointer(op.prequant), _pointer(op.bias),
                                            _pointer(op.minimum))
                            for name, op in ops.items()},
                         q_norm=_pointer(layer.q_norm), k_norm=_pointer(layer.k_norm))


class DecodeStep:
    """The fused decode step (one token for each of up to ``MATVEC_MAX_TOKENS`` sequences) for one element type,
    head size and group."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype, head_size: int, group: int) -> None:
        self.dtype, self.head_size, self.group = dtype, head_size, group
        self._fn = library.decode_step
        self._fn.argtypes = [_POINTER, _SIZE, _POINTER, _SIZE, _SIZE, _SIZE, _SIZE, _SIZE, _REAL, _POINTER, _POINTER,
                             _SIZE, _POINTER, _POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER,
                             _POINTER, _SIZE]
        self._fn.restype = ctypes.c_int

    def __call__(self, weights: StepWeights, x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 pools: StaticPools, block_tables: list[torch.Tensor], slots: list[int],
                 num_tokens: list[int]) -> torch.Tensor:
        """Run the tokens whose embeddings are x (n, hidden), one per sequence, at the positions of the cos / sin
        rows (n, rotated channels, at most head_size) through every layer: stores token t's K/V at ``slots[t]``
        and attends over the first ``num_tokens[t]`` tokens of ``block_tables[t]``'s blocks. Returns the last
        hidden states (n, hidden), each token's as if it ran alone."""
        layers, blocks, tokens_per_block, kv_heads, head_size = pools.k.shape
        n = x.shape[0]
        if (pools.k.dtype != self.dtype or pools.v.dtype != self.dtype or head_size != self.head_size
                or layers != len(weights.layers) or not pools.k.is_contiguous() or not pools.v.is_contiguous()
                or x.dim() != 2 or x.shape[1] != weights.hidden or not 1 <= n <= MATVEC_MAX_TOKENS
                or cos.dim() != 2 or cos.shape[0] != n or not 0 < cos.shape[1] <= head_size or cos.shape[1] % 2
                or sin.shape != cos.shape or not len(block_tables) == len(slots) == len(num_tokens) == n):
            raise ValueError(f"decode step built for {self.dtype} pools of head size {self.head_size} got "
                             f"{pools.k.dtype} pools {tuple(pools.k.shape)}, x {tuple(x.shape)}, rotary rows "
                             f"{tuple(cos.shape)} and {len(weights.layers)} layers of weights for "
                             f"{len(block_tables)} block tables")
        tables = [_int64_table(table) for table in block_tables]
        for table, count in zip(tables, num_tokens):
            if len(table) * tokens_per_block < count:
                raise ValueError(f"{count} tokens do not fit the {len(table)} blocks of the table")
        flat = torch.cat(tables)
        starts = torch.tensor([0, *(len(t) for t in tables[:-1])], dtype=torch.int64).cumsum(0)
        slots_t, counts = torch.tensor(slots, dtype=torch.int64), torch.tensor(num_tokens, dtype=torch.int64)
        x = x.float().contiguous().clone()
        k_scales, v_scales = pools.k_scales.float().contiguous(), pools.v_scales.float().contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        status = self._fn(ctypes.addressof(weights.array), layers, x.data_ptr(), n, weights.hidden, kv_heads,
                          weights.intermediate, weights.activation, eps, cos.data_ptr(), sin.data_ptr(), cos.shape[1],
                          pools.k.data_ptr(), pools.v.data_ptr(), blocks * tokens_per_block * kv_heads * head_size,
                          k_scales.data_ptr(), v_scales.data_ptr(), flat.data_ptr(), starts.data_ptr(),
                          slots_t.data_ptr(), counts.data_ptr(), tokens_per_block)
        if status != 0:
            raise MemoryError("the decode step could not allocate its work buffers")
        return x


class Int4Dequantize:
    """The INT4 block dequantizer for one head size and value group."""

    def __init__(self, library: ctypes.CDLL, head_size: int, value_group: int) -> None:
        self.head_size, self.value_group = head_size, value_group
        self._fn = _bind(library, "int4_dequantize", [_POINTER] * 7 + [_SIZE, _SIZE, _SIZE, _POINTER, _POINTER])

    def __call__(self, k: tuple[torch.Tensor, ...], v: tuple[torch.Tensor, ...],
                 block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V (blocks, tokens_per_block, kv_heads, head_size) of the blocks in block_table.

        k, v: one layer's (codes, scale, zero) pools as cabinllm.runtime.kv.int4.Int4KV holds them.
        """
        k_codes = k[0]
        _blocks, tokens_per_block, kv_heads, half = k_codes.shape
        if (half * 2 != self.head_size or v[1].shape[-1] * self.value_group != self.head_size
                or any(t.dtype != torch.float16 for t in (*k[1:], *v[1:]))
                or not all(t.is_contiguous() for t in (*k, *v))):
            raise ValueError(f"kernel built for head size {self.head_size} and value groups of {self.value_group} "
                             f"got codes {tuple(k_codes.shape)} and value scales {tuple(v[1].shape)}")
        block_table = _int64_table(block_table)
        k_out = torch.empty(len(block_table), tokens_per_block, kv_heads, self.head_size)
        v_out = torch.empty_like(k_out)
        self._fn(*(t.data_ptr() for t in (*k, *v, block_table)), len(block_table), tokens_per_block, kv_heads,
                 k_out.data_ptr(), v_out.data_ptr())
        return k_out, v_out


def _int64_table(block_table: torch.Tensor) -> torch.Tensor:
    if block_table.dtype != torch.int64:
        raise ValueError(f"block tables are int64 block ids, got {block_table.dtype}")
    return block_table.contiguous()


@functools.cache
def matvec() -> MatVec | None:
    """The one-token linear kernel, built on first use; None (after a warning) if it cannot be."""
    library = _load("matvec", {})
    return MatVec(library) if library else None


@functools.cache
def quant_matvec() -> QuantMatVec | None:
    """The decode-step kernels over int8 and int4 weights, built on first use; None (after a warning) if they
    cannot be."""
    library = _load("quant_matvec", {})
    return QuantMatVec(library) if library else None


@functools.cache
def decode_attention(dtype: torch.dtype, head_size: int, group: int) -> DecodeAttention | None:
    """The attention kernel for pools of this dtype (int8, float16, float32), head size and group,
    built on first use; None for another dtype (no kernel: the torch path) or, after a warning, if it
    cannot be built."""
    if dtype not in ELEMENT_DEFINES:
        return None
    library = _load("decode_attention", {**ELEMENT_DEFINES[dtype], "HEAD_SIZE": head_size, "GROUP": group})
    return DecodeAttention(library, dtype, head_size, group) if library else None


@functools.cache
def decode_step(dtype: torch.dtype, head_size: int, group: int) -> DecodeStep | None:
    """The fused decode step for pools of this dtype (int8, float16, float32), head size and group, built
    on first use; None for another dtype or, after a warning, if it cannot be built."""
    if dtype not in ELEMENT_DEFINES:
        return None
    library = _load("decode_step", {**ELEMENT_DEFINES[dtype], "HEAD_SIZE": head_size, "GROUP": group})
    return DecodeStep(library, dtype, head_size, group) if library else None


@functools.cache
def int4_dequantize(head_size: int, value_group: int) -> Int4Dequantize | None:
    """The INT4 dequantizer for this head size and value group, built on first use; None (after a warning)
    if it cannot be."""
    library = _load("int4_dequantize", {"HEAD_SIZE": head_size, "VALUE_GROUP": value_group})
    return Int4Dequantize(library, head_size, value_group) if library else None


def _load(name: str, defines: dict[str, int | str]) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(_build(name, defines)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        warnings.warn(f"native kernel {name} unavailable ({detail}); decoding on the slower torch path. "
                      "Install a C compiler (gcc or clang, or set CC) to enable it.", RuntimeWarning, stacklevel=3)
        return None


def _build(name: str, defines: dict[str, int | str]) -> Path:
    """Compile one kernel into the cache folder (atomically) unless an identical build is there."""
    cc = compiler()
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler {cc!r} on PATH")
    source = KERNEL_SOURCES / f"{name}.c"
    flags = COMPILE_FLAGS + [f"-D{key}={value}" for key, value in defines.items()]
    sources = sorted(p for p in KERNEL_SOURCES.iterdir() if p.suffix in (".c", ".h"))  # kernels include each other
    key = hashlib.sha256(b"".join(path.read_bytes() for path in sources))
    for part in (cc, *flags, platform.machine(), _cpu_flags()):
        key.update(part.encode())
    folder = Path(os.environ.get("CABIN_KERNEL_DIR", Path.home() / ".cache" / "cabinllm" / "kernels"))
    library = folder / f"{name}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as temp:
        objects, built = Path(temp) / f"{name}.o", Path(temp) / library.name
        subprocess.run([cc, *flags, "-c", str(source), "-o", str(objects)], check=True, capture_output=True,
                       text=True)
        subprocess.run([cc, "-shared", "-fopenmp", str(objects), "-o", str(built), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, library)
    return library


def _cpu_flags() -> str:
    """The CPU's feature list, so a build made for one CPU is not loaded on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
