"""Triton kernels over the paged KV cache: the KV write, split-KV decode attention and prefill over a cached prefix.

Layout (``cabinllm.runtime.kv.storage``): one layer's K and V pools are (blocks, tokens_per_block, kv_heads,
head_size) of int8 codes, e4m3, fp16, bf16 or fp32; position ``p`` of a sequence lives in block ``table[p // tpb]``
at row ``p % tpb``; a flat slot is ``block * tpb + row``. int8 with static scales (TensorRT-LLM's one scale per
layer, or K's and V's) stores ``round(x / scale)``, fp8 (one scale per layer) ``x / scale`` rounded to e4m3;
int8-dynamic stores a fp16 scale per token and KV head beside the codes in (blocks, tokens_per_block, kv_heads)
pools. Attention folds the scales into the dot products: ``q . codes`` times the K scale (and each key's token
scale), the probabilities times each value's token scale, the output times the V scale.

Positions here are the block table's own: a table that starts at a later block (a sliding-window layer's) counts from
its first row. A query at table position ``p`` attends to keys ``(p - window, p]`` (no window: all of ``[0, p]``; the
kernels take NO_WINDOW then). Rows of the GQA group are rows of one tile, so each K/V block is read once per KV head.

Tiles are at least 16 on every side of a ``tl.dot`` (what the GPU's matrix instructions take); masks cut them to the
real group, head size and tokens. Where the operands are fp32 the dots ask for IEEE precision (no TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from cabinllm.runtime.kernels.bindings import StoredKV
from cabinllm.runtime.kernels.triton.pools import quant, scale_pools, scale_strides, strides

MIN_TILE = 16  # the smallest side of a tl.dot operand on the GPU
DECODE_TOKENS_PER_TILE = 32
PREFILL_ROWS = 64  # query rows (tokens x heads of a group) of one prefill tile
PREFILL_TOKENS_PER_TILE = 32
SPLIT_TOKENS = 256  # decode: about this many keys per split before another split is worth it
MAX_SPLITS = 16
NO_WINDOW = 1 << 30  # the window of a layer without one: longer than any context


def tile(n: int) -> int:
    """The power of two >= n (and >= MIN_TILE) a tile side takes."""
    return max(MIN_TILE, triton.next_power_of_2(n))


def decode_splits(max_tokens: int) -> int:
    """Splits of a decode step's keys: one per SPLIT_TOKENS of the longest sequence, a power of two, at most
    MAX_SPLITS (the result is the same for any count; more splits keep the GPU busy on few long sequences)."""
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, -(-max_tokens // SPLIT_TOKENS))))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------------------------
# KV write
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _round_half_even(y):
    """torch.round's rounding: halves to the even neighbour."""
    f = tl.floor(y)
    diff = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((diff > 0.5) | ((diff == 0.5) & odd), f + 1.0, f)


@triton.jit
def _round_to_e4m3(y):
    """y (within +-448) rounded to the nearest e4m3 value, halves to even, in fp32: the spacing of y's binade
    (2^(exponent - 3); 2^-9 below e4m3's smallest normal, 2^-6), so the cast to e4m3 after it is exact on every
    backend (the interpreter's own cast does not round to nearest)."""
    exponent = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(y / step) * step


@triton.jit
def _store_row(x, Pool, Scales, dst, scale_dst, scale, dmask, QUANT: tl.constexpr):
    """Store one token's row of one KV head (fp32 ``x``) the way the pool holds it."""
    if QUANT == 0:
        tl.store(Pool + dst, x.to(Pool.dtype.element_ty), mask=dmask)
    elif QUANT == 1:
        codes = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(x, scale)), -127.0), 127.0)
        tl.store(Pool + dst, codes.to(tl.int8), mask=dmask)
    elif QUANT == 3:
        values = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0))
        tl.store(Pool + dst, values.to(Pool.dtype.element_ty), mask=dmask)
    else:
        amax = tl.max(tl.where(dmask, tl.abs(x), 0.0), 0)
        token_scale = tl.maximum(tl.div_rn(amax, 127.0), 1e-8).to(tl.float16)  # IEEE, as torch divides
        codes = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(x, token_scale.to(tl.float32))), -127.0), 127.0)
        tl.store(Pool + dst, codes.to(tl.int8), mask=dmask)
        tl.store(Scales + scale_dst, token_scale)


@triton.jit
def _write_kv_kernel(K, V, Slots, KPool, VPool, KScales, VScales, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                     TPB: tl.constexpr, HEAD: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(Slots + token)
    if slot >= 0:  # a negative slot: a padded row of a fixed-size step, stored nowhere
        block = slot // TPB
        row = slot % TPB
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD
        dst = block * stride_pb + row * stride_pt + head * stride_ph + d
        scale_dst = block * stride_sb + row * stride_st + head * stride_sh
        k = tl.load(K + token * stride_kt + head * stride_kh + d, mask=dmask, other=0.0).to(tl.float32)
        v = tl.load(V + token * stride_vt + head * stride_vh + d, mask=dmask, other=0.0).to(tl.float32)
        _store_row(k, KPool, KScales, dst, scale_dst, k_scale, dmask, QUANT)
        _store_row(v, VPool, VScales, dst, scale_dst, v_scale, dmask, QUANT)


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pools: StoredKV) -> None:
    """Store K/V rows (tokens, kv_heads, head_size) into flat ``slots`` (tokens,) of one layer's pools, quantized as
    the pools hold them; a negative slot stores nothing."""
    tokens, kv_heads, head = k.shape
    if tokens == 0:
        return
    k_scales, v_scales = scale_pools(pools)
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, slots, pools.k, pools.v, k_scales, v_scales, float(pools.k_scale), float(pools.v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides(pools), *scale_strides(pools),
        TPB=pools.k.shape[1], HEAD=head, BLOCK_D=triton.next_power_of_2(head), QUANT=quant(pools))


# ---------------------------------------------------------------------------------------------------------------
# attention, shared by decode and prefill
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _attend_tile(q, acc, m, l, KPool, VPool, KScales, VScales, table_row, n, nmask, allowed, kv_head, d, dmask,
                 score_scale, stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                 TPB: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys ``n`` (their table positions) folded into the online softmax of the rows of ``q``;
    ``allowed`` (rows, keys) says which keys each row attends to."""
    block = tl.load(table_row + n // TPB, mask=nmask, other=0).to(tl.int64)
    row = n % TPB
    at = block * stride_pb + row * stride_pt + kv_head * stride_ph
    k = tl.load(KPool + at[None, :] + d[:, None], mask=dmask[:, None] & nmask[None, :], other=0.0)
    s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * score_scale
    if QUANT == 2:
        scale_at = block * stride_sb + row * stride_st + kv_head * stride_sh
        s = s * tl.load(KScales + scale_at, mask=nmask, other=0.0).to(tl.float32)[None, :]
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to scale
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m - m_use)
    l = l * alpha + tl.sum(p, 1)
    if QUANT == 2:
        p = p * tl.load(VScales + scale_at, mask=nmask, other=0.0).to(tl.float32)[None, :]
    v = tl.load(VPool + at[:, None] + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l


@triton.jit
def _decode_split_kernel(Q, KPool, VPool, KScales, VScales, Tables, SeqLens, MidOut, MidLse,
                         k_scale, v_scale, sm_scale, window,
                         stride_qb, stride_qh, stride_tb,
                         stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                         stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD: tl.constexpr, TPB: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, QUANT: tl.constexpr,
                         PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(seq_len - lo, SPLITS)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    g = tl.arange(0, BLOCK_H)
    gmask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = Tables + seq * stride_tb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        acc, m, l = _attend_tile(q, acc, m, l, KPool, VPool, KScales, VScales, table_row, n, nmask,
                                 gmask[:, None] & nmask[None, :], kv_head, d, dmask, k_scale * sm_scale,
                                 stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                                 TPB, QUANT, PRECISION)
    has = l > 0.0
    out = acc * v_scale / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(MidOut + seq * stride_mb + heads[:, None] * stride_mh + split * stride_ms + d[None, :], out,
             mask=gmask[:, None] & dmask[None, :])
    tl.store(MidLse + seq * stride_lb + heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(MidOut, MidLse, Out, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                          stride_ob, stride_oh, HEAD: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD
    lse = tl.load(MidLse + seq * stride_lb + head * stride_lh + s)
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padded row with no keys: zeros out
    w = tl.exp(lse - top)
    parts = tl.load(MidOut + seq * stride_mb + head * stride_mh + s[:, None] * stride_ms + d[None, :],
                    mask=dmask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + seq * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=dmask)


def decode_attention(q: torch.Tensor, pools: StoredKV, tables: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, window: int = 0, splits: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence (q: (seqs, heads, head_size)) over its first ``seq_lens`` keys in the
    blocks of its row of ``tables`` (seqs, max_blocks) int32; each query at the last of them, over the last
    ``window`` keys only when given. Keys are split ``splits`` ways (default ``decode_splits`` of the longest
    sequence, which reads the lengths to the host) and the splits reduced by a second kernel. Returns (seqs, heads,
    head_size) in q's dtype (``out`` when given). A sequence of length 0 (a padded row) gives zeros."""
    seqs, heads, head = q.shape
    kv_heads = pools.k.shape[2]
    group = heads // kv_heads
    splits = splits or decode_splits(int(seq_lens.max()) if seqs else 1)
    mid = torch.empty(seqs, heads, splits, head, dtype=torch.float32, device=q.device)
    lse = torch.empty(seqs, heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    k_scales, v_scales = scale_pools(pools)
    block_d = tile(head)
    _decode_split_kernel[(seqs, kv_heads, splits)](
        q, pools.k, pools.v, k_scales, v_scales, tables, seq_lens, mid, lse,
        float(pools.k_scale), float(pools.v_scale), float(sm_scale), window or NO_WINDOW,
        q.stride(0), q.stride(1), tables.stride(0), *strides(pools), *scale_strides(pools),
        mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, HEAD=head, TPB=pools.k.shape[1], BLOCK_H=tile(group), BLOCK_D=block_d,
        BLOCK_N=DECODE_TOKENS_PER_TILE, SPLITS=splits, QUANT=quant(pools), PRECISION=_precision(q.dtype))
    _decode_reduce_kernel[(seqs, heads)](
        mid, lse, out, mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD=head, BLOCK_D=block_d, SPLITS=splits)
    return out


@triton.jit
def _prefill_kernel(Q, KPool, VPool, KScales, VScales, Tables, QStarts, QLens, CtxLens, TileSeq, TileFirst, Out,
                    k_scale, v_scale, sm_scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
                    stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                    GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, HEAD: tl.constexpr, TPB: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                    PRECISION: tl.constexpr):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(TileSeq + t)
    first = tl.load(TileFirst + t)
    q_start = tl.load(QStarts + seq)
    q_len = tl.load(QLens + seq)
    ctx = tl.load(CtxLens + seq)
    r = tl.arange(0, BLOCK_Q * GROUP_TILE)
    qi = first + r // GROUP_TILE
    g = r % GROUP_TILE
    rmask = (qi < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    qpos = ctx - q_len + qi  # each row's query position in the table
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD
    q = tl.load(Q + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    first_pos = ctx - q_len + first
    hi = tl.minimum(first_pos + BLOCK_Q, ctx)
    lo = tl.maximum(first_pos - window + 1, 0)
    m = tl.full([BLOCK_Q * GROUP_TILE], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_TILE], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_TILE, BLOCK_D], tl.float32)
    table_row = Tables + seq * stride_tb
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < hi
        allowed = rmask[:, None] & nmask[None, :] & (n[None, :] <= qpos[:, None])
        allowed = allowed & (n[None, :] > qpos[:, None] - window)
        acc, m, l = _attend_tile(q, acc, m, l, KPool, VPool, KScales, VScales, table_row, n, nmask, allowed,
                                 kv_head, d, dmask, k_scale * sm_scale,
                                 stride_pb, stride_pt, stride_ph, stride_sb, stride_st, stride_sh,
                                 TPB, QUANT, PRECISION)
    out = acc * v_scale / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(Out + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_attention(q: torch.Tensor, pools: StoredKV, tables: torch.Tensor, q_lens: list[int],
                      ctx_lens: list[int], sm_scale: float, window: int = 0, rows: int = PREFILL_ROWS,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each sequence's new queries over its blocks, whose K/V (the new tokens' included) are written.

    q: (tokens, heads, head_size), sequence i's ``q_lens[i]`` queries in turn; sequence i's table row holds
    ``ctx_lens[i]`` keys, its queries the last ``q_lens[i]`` positions of them (each over the keys up to itself, the
    last ``window`` only when given). ``rows``: query rows (tokens x heads of a group) per tile. Returns (tokens,
    heads, head_size) in q's dtype."""
    tokens, heads, head = q.shape
    kv_heads = pools.k.shape[2]
    group = heads // kv_heads
    group_tile = triton.next_power_of_2(group)
    block_q = max(1, rows // group_tile, MIN_TILE // group_tile)
    tile_seq, tile_first = [], []
    for i, n in enumerate(q_lens):
        for first in range(0, n, block_q):
            tile_seq.append(i)
            tile_first.append(first)
    out = torch.empty_like(q) if out is None else out
    if not tile_seq:
        return out
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    device = q.device
    ints = {name: torch.tensor(values, dtype=torch.int32, device=device) for name, values in (
        ("starts", starts), ("lens", q_lens), ("ctx", ctx_lens), ("seq", tile_seq), ("first", tile_first))}
    k_scales, v_scales = scale_pools(pools)
    _prefill_kernel[(len(tile_seq), kv_heads)](
        q, pools.k, pools.v, k_scales, v_scales, tables, ints["starts"], ints["lens"], ints["ctx"], ints["seq"],
        ints["first"], out, float(pools.k_scale), float(pools.v_scale), float(sm_scale), window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0), *strides(pools),
        *scale_strides(pools), GROUP=group, GROUP_TILE=group_tile, HEAD=head, TPB=pools.k.shape[1],
        BLOCK_Q=block_q, BLOCK_D=tile(head), BLOCK_N=PREFILL_TOKENS_PER_TILE, QUANT=quant(pools),
        PRECISION=_precision(q.dtype))
    return out


def block_tables(tables: list[list[int]], device: torch.device | str, width: int | None = None) -> torch.Tensor:
    """Block tables as one (seqs, width) int32 tensor on ``device``, short rows padded with block 0 (never read:
    every read is below its sequence's length)."""
    width = max([len(t) for t in tables] + [1]) if width is None else width
    padded = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        padded[i, :len(table)] = torch.as_tensor(table, dtype=torch.int32)
    return padded.to(device)
