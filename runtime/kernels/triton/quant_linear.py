"""Triton kernels for linears on quantized weights, dequantized inside the product (never into a copy of the weight).

``int8_linear``: W8A16: int8 codes (out, in) with one scale per output row; x @ (q * s).T is (x @ q.T) * s, so the
codes are converted to x's dtype tile by tile and the scale multiplies the finished tile.
``int4_g32_linear``: int4-g32 (llama.cpp's Q4_1 block): uint8 codes (out, in / 2), in each block of 32 inputs byte
``j`` holds input ``j`` in its low nibble and input ``j + 16`` in its high one; w = q * scale + minimum with a fp16
scale and minimum per output row and block. ``int4_awq_linear``: W4A16-AWQ: int8 (out / 2, in), row ``2r`` in the low
nibble of packed row ``r`` and row ``2r + 1`` in its high one (signed, [-8, 7]); w = q * scale with a scale per output
row and group of inputs (the input multiplied by AWQ's prequant scale before). Each reads each weight byte once per
tile of outputs and accumulates in fp32 with ``tl.dot``; tiles are at least 16 rows (a decode step's one token is a
masked tile of 16), so one kernel serves prefill and decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

G32_GROUP = 32  # int4-g32's inputs per block (formats.weight_formats.GGUF_GROUP; kernels sit below formats)
BLOCK_M = 16  # token rows of a tile (the least a tl.dot takes)
BLOCK_N = 64  # output rows of a tile
AWQ_BLOCK_K = 32  # inputs of a W4A16-AWQ tile: a divisor of every AWQ group size (64, 128)
INT8_BLOCK_K = 64  # inputs of a W8A16 tile (the last one masked)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's token rows and output columns, and which of them exist."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, stride_om):
    """The finished fp32 tile into the output, in its dtype."""
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w8_kernel(x_ptr, codes_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_cn, stride_om,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows, cols, row_ok, col_ok = _tile(M, N, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k_ok = start + k < K
        codes = tl.load(codes_ptr + cols[:, None] * stride_cn + start + k[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + start + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(codes.to(x.dtype)), input_precision=PRECISION)
    scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    _store_tile(out_ptr, acc * scale[None, :], rows, cols, row_ok, col_ok, stride_om)


@triton.jit
def _g32_kernel(x_ptr, codes_ptr, scale_ptr, min_ptr, out_ptr, M, N, K,
                stride_xm, stride_cn, stride_sn, stride_om,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, PRECISION: tl.constexpr):
    rows, cols, row_ok, col_ok = _tile(M, N, BLOCK_M, BLOCK_N)
    j = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // (2 * HALF)):
        codes = tl.load(codes_ptr + cols[:, None] * stride_cn + g * HALF + j[None, :], mask=col_ok[:, None], other=0)
        codes = codes.to(tl.int32)
        scale = tl.load(scale_ptr + cols * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        minimum = tl.load(min_ptr + cols * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        w_low = (codes & 0xF).to(tl.float32) * scale + minimum  # (BLOCK_N, HALF): inputs g*32 + j
        w_high = (codes >> 4).to(tl.float32) * scale + minimum  # inputs g*32 + 16 + j
        base = x_ptr + rows[:, None] * stride_xm + g * 2 * HALF + j[None, :]
        x_low = tl.load(base, mask=row_ok[:, None], other=0.0)
        x_high = tl.load(base + HALF, mask=row_ok[:, None], other=0.0)
        acc += tl.dot(x_low, tl.trans(w_low.to(x_low.dtype)), input_precision=PRECISION)
        acc += tl.dot(x_high, tl.trans(w_high.to(x_high.dtype)), input_precision=PRECISION)
    _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, stride_om)


@triton.jit
def _awq_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K, GROUP,
                stride_xm, stride_pr, stride_sn, stride_om,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows, cols, row_ok, col_ok = _tile(M, N, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    odd = (cols % 2 == 1)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        packed = tl.load(packed_ptr + (cols // 2)[:, None] * stride_pr + start + k[None, :], mask=col_ok[:, None],
                         other=0).to(tl.int32)  # sign-extended
        q = tl.where(odd, packed >> 4, (packed << 28) >> 28)  # the row's nibble, signed
        scale = tl.load(scale_ptr + cols * stride_sn + start // GROUP, mask=col_ok, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * scale[:, None]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + start + k[None, :], mask=row_ok[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, stride_om)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., in) times the W8A16 weight (out, in) transposed, codes times each output row's scale: (..., out)."""
    flat, n = _flat(x), codes.shape[0]
    out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _w8_kernel[grid](flat, codes, scale, out, flat.shape[0], n, flat.shape[1], flat.stride(0), codes.stride(0),
                     out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=INT8_BLOCK_K,
                     PRECISION=_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


def int4_g32_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x (..., in) times the int4-g32 weight (out, in) transposed: (..., out) in x's dtype."""
    flat, n = _flat(x), codes.shape[0]
    out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _g32_kernel[grid](flat, codes, scale, minimum, out, flat.shape[0], n, flat.shape[1],
                      flat.stride(0), codes.stride(0), scale.stride(0), out.stride(0),
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HALF=G32_GROUP // 2, PRECISION=_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)


def int4_awq_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (..., in), already times AWQ's prequant scale, times the W4A16-AWQ weight (out, in) transposed."""
    flat, n = _flat(x), 2 * packed.shape[0]
    out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _awq_kernel[grid](flat, packed, scale, out, flat.shape[0], n, flat.shape[1], group_size,
                      flat.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=AWQ_BLOCK_K, PRECISION=_precision(x.dtype))
    return out.reshape(*x.shape[:-1], n)
