"""INT4 block storage of the paged KV cache, with each sequence's newest tokens kept in fp16.

A block keeps an fp16 copy of its K/V while it holds one of the newest
``window`` tokens of a sequence that uses it, or while it is only partly
written; after that it is quantized (runtime.kv_int4) and its fp16 buffer goes
back to a free list. Attention therefore sees at least the newest ``window``
tokens at full precision, as KIVI's residual does, and older tokens at 4 bits.
Blocks written whole outside every window (a long prefill) are quantized
directly. A block shared by several sequences (prefix reuse) stays fp16 while
any of them still has it in its window.

One sequence needs at most ``buffers_per_sequence`` fp16 buffers; that many
are reserved up front, more are added when several sequences are live.
Reads dequantize through the native kernel of runtime.native_kernels where it
can be built, else with runtime.kv_int4's torch functions.
"""
from __future__ import annotations

import torch

from runtime.committed import committed_zeros
from runtime.kv_int4 import VALUE_GROUP, dequantize_keys, dequantize_values, quantize_keys, quantize_values
from runtime.native_kernels import int4_dequantize, native_kernels_enabled

INT4_WINDOW = 128  # newest tokens kept in fp16, as KIVI's residual length


def buffers_per_sequence(tokens_per_block: int, window: int) -> int:
    """fp16 block buffers one sequence can hold: the blocks its window touches plus a partial one."""
    return -(-window // tokens_per_block) + 1


class Int4Pool:
    """4-bit K/V codes with fp16 scales and zeros per block, plus fp16 buffers for window blocks."""

    def __init__(self, layers: int, num_blocks: int, tokens_per_block: int, kv_heads: int, head_size: int,
                 window: int = INT4_WINDOW) -> None:
        if window < 0:
            raise ValueError(f"int4 window must be >= 0 tokens, got {window}")
        tpb, d = tokens_per_block, head_size
        self.tokens_per_block, self.window = tpb, window
        self.k_codes = committed_zeros(layers, num_blocks, tpb, kv_heads, d // 2, dtype=torch.uint8)
        self.v_codes = committed_zeros(layers, num_blocks, tpb, kv_heads, d // 2, dtype=torch.uint8)
        self.k_scale = committed_zeros(layers, num_blocks, kv_heads, d, dtype=torch.float16)
        self.k_zero = committed_zeros(layers, num_blocks, kv_heads, d, dtype=torch.float16)
        self.v_scale = committed_zeros(layers, num_blocks, tpb, kv_heads, d // VALUE_GROUP, dtype=torch.float16)
        self.v_zero = committed_zeros(layers, num_blocks, tpb, kv_heads, d // VALUE_GROUP, dtype=torch.float16)
        self._buffer_shape = (layers, tpb, kv_heads, d)
        self._free_buffers = [self._new_buffer() for _ in range(buffers_per_sequence(tpb, window))]
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> fp16 (K, V)
        self._in_fp16 = torch.zeros(layers, num_blocks, dtype=torch.bool)  # (layer, block) read from its buffer
        self._windows: dict[int, set[int]] = {}  # sequence -> blocks holding its newest tokens
        self._kept: set[int] = set()  # the union of the windows, updated when one changes
        self._native = int4_dequantize(d, VALUE_GROUP) if native_kernels_enabled() else None

    def _new_buffer(self) -> tuple[torch.Tensor, torch.Tensor]:
        return committed_zeros(*self._buffer_shape, dtype=torch.float16), \
            committed_zeros(*self._buffer_shape, dtype=torch.float16)

    # -- sequences -----------------------------------------------------------------
    def follow(self, seq_id: int, block_table: list[int], written: int, total: int) -> None:
        """Move a sequence's window to its newest tokens after it grew from ``written`` to ``total`` tokens.

        Blocks that leave the window are quantized now if all their tokens are written, else when their
        last token is.
        """
        first = max(0, total - self.window) // self.tokens_per_block
        before = self._windows.get(seq_id, set())
        self._windows[seq_id] = set(block_table[first:])
        self._kept = set().union(*self._windows.values())
        for index, block in enumerate(block_table[:first]):
            if block in before and block not in self._kept and (index + 1) * self.tokens_per_block <= written:
                self._flush(block)

    def drop(self, seq_id: int, block_table: list[int], num_tokens: int) -> None:
        """Forget a sequence: its full window blocks are quantized (they stay cached), a partial one is discarded."""
        window = self._windows.pop(seq_id, set())
        self._kept = set().union(*self._windows.values())
        for index, block in enumerate(block_table):
            if block in window and block not in self._kept:
                if (index + 1) * self.tokens_per_block <= num_tokens:
                    self._flush(block)
                else:
                    self._release(block)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy a block's codes, scales and fp16 buffer (copy-on-write)."""
        for t in (self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero, self._in_fp16):
            t[:, dst] = t[:, src]
        if src in self._buffers:
            for src_t, dst_t in zip(self._buffers[src], self._take(dst)):
                dst_t.copy_(src_t)

    # -- data ----------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V (tokens, kv_heads, head_size) of one layer into flat slots."""
        tpb = self.tokens_per_block
        blocks, offsets = slots // tpb, slots % tpb
        unique, counts = blocks.unique(return_counts=True)
        direct = torch.tensor([int(b) not in self._kept for b in unique], dtype=torch.bool) & (counts == tpb)
        if direct.any():
            self._quantize_whole(layer, unique[direct], blocks, offsets, k, v)
        for block in unique[~direct].tolist():
            chosen = blocks == block
            block_offsets = offsets[chosen]
            wk, wv = self._take(block)
            if not self._in_fp16[layer, block] and int(block_offsets.min()) > 0:
                # earlier tokens of the block were quantized (the sequence was truncated): start from them
                old_k, old_v = self._dequantize(layer, torch.tensor([block]))
                wk[layer], wv[layer] = old_k[0].half(), old_v[0].half()
            self._in_fp16[layer, block] = True
            wk[layer, block_offsets] = k[chosen].half()
            wv[layer, block_offsets] = v[chosen].half()
            if block not in self._kept and bool((block_offsets == tpb - 1).any()):
                self._quantize_layer(layer, block)

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V (tokens, kv_heads, head_size) of a sequence's first num_tokens tokens."""
        k, v = self._dequantize(layer, block_table)
        for index in self._in_fp16[layer, block_table].nonzero().flatten().tolist():
            wk, wv = self._buffers[int(block_table[index])]
            k[index], v[index] = wk[layer].float(), wv[layer].float()
        return k.flatten(0, 1)[:num_tokens], v.flatten(0, 1)[:num_tokens]

    # -- accounting ----------------------------------------------------------------
    def buffer_bytes(self) -> tuple[int, int]:
        """Bytes of fp16 buffers (reserved, in use)."""
        one = 2 * torch.Size(self._buffer_shape).numel() * 2
        used = len(self._buffers)
        return (used + len(self._free_buffers)) * one, used * one

    # -- internals -----------------------------------------------------------------
    def _take(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if block not in self._buffers:
            self._buffers[block] = self._free_buffers.pop() if self._free_buffers else self._new_buffer()
        return self._buffers[block]

    def _release(self, block: int) -> None:
        if block in self._buffers:
            self._free_buffers.append(self._buffers.pop(block))
        self._in_fp16[:, block] = False

    def _flush(self, block: int) -> None:
        for layer in self._in_fp16[:, block].nonzero().flatten().tolist():
            self._quantize_layer(layer, block)

    def _quantize_layer(self, layer: int, block: int) -> None:
        wk, wv = self._buffers[block]
        self.k_codes[layer, block], self.k_scale[layer, block], self.k_zero[layer, block] = \
            quantize_keys(wk[layer].float())
        self.v_codes[layer, block], self.v_scale[layer, block], self.v_zero[layer, block] = \
            quantize_values(wv[layer].float())
        self._leave_fp16(layer, block)

    def _leave_fp16(self, layer: int, block: int) -> None:
        self._in_fp16[layer, block] = False
        if not self._in_fp16[:, block].any():
            self._release(block)

    def _quantize_whole(self, layer: int, whole: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor) -> None:
        chosen = torch.isin(blocks, whole)
        rows = torch.searchsorted(whole, blocks[chosen])
        k_blocks = torch.empty(len(whole), self.tokens_per_block, *k.shape[1:])
        v_blocks = torch.empty_like(k_blocks)
        k_blocks[rows, offsets[chosen]] = k[chosen].float()
        v_blocks[rows, offsets[chosen]] = v[chosen].float()
        self.k_codes[layer, whole], self.k_scale[layer, whole], self.k_zero[layer, whole] = quantize_keys(k_blocks)
        self.v_codes[layer, whole], self.v_scale[layer, whole], self.v_zero[layer, whole] = quantize_values(v_blocks)
        for block in whole.tolist():
            if self._in_fp16[layer, block]:
                self._leave_fp16(layer, block)

    def _dequantize(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._native is not None:
            return self._native((self.k_codes[layer], self.k_scale[layer], self.k_zero[layer]),
                                (self.v_codes[layer], self.v_scale[layer], self.v_zero[layer]), block_table)
        k = dequantize_keys(self.k_codes[layer, block_table], self.k_scale[layer, block_table],
                            self.k_zero[layer, block_table])
        v = dequantize_values(self.v_codes[layer, block_table], self.v_scale[layer, block_table],
                              self.v_zero[layer, block_table])
        return k, v
