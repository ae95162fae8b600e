"""INT4 KV storage, KIVI-style: 4-bit codes with fp16 scales and zeros, each sequence's newest tokens in fp16.

Keys vary most across channels, so each key channel of a block of tokens is one
group (scale and zero per block, KV head and channel). Values vary most across
tokens, so each token's head is split into groups of VALUE_GROUP channels (scale
and zero per token, KV head and group). Quantize ``q = round((x - zero) / scale)``
in 0..15 with ``zero = min``, ``scale = (max - min) / 15``; dequantize
``q * scale + zero``. Codes are packed two per byte; scales and zeros are fp16.

A block keeps an fp16 copy of its K/V while it holds one of the newest
``window`` tokens of a sequence that uses it, or while it is only partly
written; after that it is quantized and its fp16 buffer goes back to a free
list. Attention therefore sees at least the newest ``window`` tokens at full
precision, as KIVI's residual does, and older tokens at 4 bits. Blocks written
whole outside every window (a long prefill) are quantized directly. A block
shared by several sequences (prefix reuse) stays fp16 while any of them still
has it in its window.

One sequence needs at most ``buffers_per_sequence`` fp16 buffers; that many
are reserved up front, more are added when several sequences are live.
Reads dequantize through the native kernel of cabinllm.runtime.kernels.bindings where it
can be built, else with the torch functions below.
"""
from __future__ import annotations

import torch

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kernels.bindings import StoredKV, int4_dequantize, native_kernels_enabled
from cabinllm.runtime.kv.blocks import Sequence, cdiv
from cabinllm.runtime.kv.memory import committed_zeros
from cabinllm.runtime.kv.storage import Fp16KV, KVLayout, KVStorage

INT4_LEVELS = 15
VALUE_GROUP = 32
INT4_WINDOW = 128  # newest tokens kept in fp16, as KIVI's residual length
_MIN_SCALE = 1e-6
_META_BYTES = 4  # fp16 scale + fp16 zero per group


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 with an even last dimension -> bytes holding two codes each."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantize_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed codes (..., tokens, heads, d/2), scale and zero (..., heads, d): one group per channel over tokens."""
    lo, hi = x.amin(dim=-3), x.amax(dim=-3)
    scale = ((hi - lo) / INT4_LEVELS).clamp_min(_MIN_SCALE).half()
    zero = lo.half()
    q = torch.round((x - zero.float().unsqueeze(-3)) / scale.float().unsqueeze(-3))
    return pack_nibbles(q.clamp(0, INT4_LEVELS).to(torch.uint8)), scale, zero


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 keys from quantize_keys' output."""
    return unpack_nibbles(packed).float() * scale.float().unsqueeze(-3) + zero.float().unsqueeze(-3)


def quantize_values(x: torch.Tensor, group: int = VALUE_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed codes (..., heads, d/2), scale and zero (..., heads, d/group): groups of channels per token."""
    grouped = x.unflatten(-1, (-1, group))
    lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = ((hi - lo) / INT4_LEVELS).clamp_min(_MIN_SCALE).half()
    zero = lo.half()
    q = torch.round((grouped - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1))
    return pack_nibbles(q.clamp(0, INT4_LEVELS).to(torch.uint8).flatten(-2)), scale, zero


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                      group: int = VALUE_GROUP) -> torch.Tensor:
    """fp32 values from quantize_values' output."""
    codes = unpack_nibbles(packed).float().unflatten(-1, (-1, group))
    return (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


def check_head_size(layout: KVLayout) -> None:
    """Raise ValueError if the head size does not split into int4 value groups."""
    if layout.head_size % VALUE_GROUP:
        raise ConfigError(f"int4 KV needs a head size divisible by {VALUE_GROUP}, this model has "
                         f"{layout.head_size}; use int8 or int8-dynamic")


def buffers_per_sequence(tokens_per_block: int, window: int) -> int:
    """fp16 block buffers one sequence can hold: the blocks its window touches plus a partial one."""
    return cdiv(window, tokens_per_block) + 1


class Int4KV(KVStorage):
    """4-bit K/V codes with fp16 scales and zeros per block, plus fp16 buffers for window blocks."""

    name = "int4"
    label = ("int4 KIVI-style (K per channel, V per token, groups of 32) + fp16 blocks holding the newest "
             f"{INT4_WINDOW} tokens")
    per_token = False  # keys share scales over a block
    recent_window = True

    def __init__(self, layout: KVLayout, num_blocks: int, tokens_per_block: int, scales: KVScales | None = None,
                 window: int = INT4_WINDOW) -> None:
        check_head_size(layout)
        if window < 0:
            raise ConfigError(f"int4 window must be >= 0 tokens, got {window}")
        super().__init__(layout, num_blocks, tokens_per_block, scales)
        layers, kv_heads, d, tpb = layout.num_layers, layout.num_kv_heads, layout.head_size, tokens_per_block
        self.window = window
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
        self._windows: dict[Sequence, set[int]] = {}  # sequence -> blocks holding its newest tokens
        self._kept: set[int] = set()  # the union of the windows, updated when one changes
        self._native = int4_dequantize(d, VALUE_GROUP) if native_kernels_enabled() else None

    @classmethod
    def bytes_per_token(cls, layout: KVLayout, tokens_per_block: int) -> int:
        """Codes plus the block's key groups and each token's value groups, spread over the block's tokens
        (rounded up); the fp16 window is counted in ``reserved_bytes``."""
        check_head_size(layout)
        channels = layout.channels
        block_bytes = (tokens_per_block * channels  # K and V codes, half a byte each
                       + channels * _META_BYTES  # key groups: one per channel per block
                       + tokens_per_block * channels // VALUE_GROUP * _META_BYTES)  # value groups
        return cdiv(block_bytes * layout.num_layers, tokens_per_block)

    @classmethod
    def reserved_bytes(cls, layout: KVLayout, tokens_per_block: int, window: int = INT4_WINDOW) -> int:
        """The fp16 block buffers one sequence's newest ``window`` tokens need."""
        return Fp16KV.bytes_per_token(layout, tokens_per_block) * tokens_per_block * \
            buffers_per_sequence(tokens_per_block, window)

    def _new_buffer(self) -> tuple[torch.Tensor, torch.Tensor]:
        return committed_zeros(*self._buffer_shape, dtype=torch.float16), \
            committed_zeros(*self._buffer_shape, dtype=torch.float16)

    # -- sequences -----------------------------------------------------------------
    def follow(self, seq: Sequence, written: int) -> None:
        """Move a sequence's window to its newest tokens after it grew from ``written`` tokens.

        Blocks that leave the window are quantized now if all their tokens are written, else when their
        last token is.
        """
        block_table = seq.block_table
        first = max(0, len(seq) - self.window) // self.tokens_per_block
        before = self._windows.get(seq, set())
        self._windows[seq] = set(block_table[first:])
        self._kept = set().union(*self._windows.values())
        for index, block in enumerate(block_table[:first]):
            if block in before and block not in self._kept and (index + 1) * self.tokens_per_block <= written:
                self._flush(block)

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence: its full window blocks are quantized (they stay cached), a partial one is discarded."""
        window = self._windows.pop(seq, set())
        self._kept = set().union(*self._windows.values())
        for index, block in enumerate(seq.block_table):
            if block in window and block not in self._kept:
                if (index + 1) * self.tokens_per_block <= len(seq):
                    self._flush(block)
                else:
                    self._release(block)

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
            self._in_fp16[layer, block] = True
            wk[layer, block_offsets] = k[chosen].half()
            wv[layer, block_offsets] = v[chosen].half()
            if block not in self._kept and bool((block_offsets == tpb - 1).any()):
                self._quantize_layer(layer, block)

    def copy_block(self, source: int, copy: int) -> None:
        """Codes, scales and zeros of every layer, and the fp16 buffer where the source has one."""
        for pool in (self.k_codes, self.v_codes, self.k_scale, self.k_zero, self.v_scale, self.v_zero):
            pool[:, copy] = pool[:, source]
        self._in_fp16[:, copy] = self._in_fp16[:, source]
        if source in self._buffers:
            for mine, theirs in zip(self._take(copy), self._buffers[source]):
                mine.copy_(theirs)

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V (tokens, kv_heads, head_size) of a sequence's first num_tokens tokens."""
        k, v = self._dequantize(layer, block_table)
        for index in self._in_fp16[layer, block_table].nonzero().flatten().tolist():
            wk, wv = self._buffers[int(block_table[index])]
            k[index], v[index] = wk[layer].float(), wv[layer].float()
        return k.flatten(0, 1)[:num_tokens], v.flatten(0, 1)[:num_tokens]

    def stored_kv(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> StoredKV:
        """The sequence's K and V dequantized, as one block of num_tokens tokens."""
        k, v = self.read(layer, block_table, num_tokens)
        return StoredKV(k[None], v[None], torch.zeros(1, dtype=torch.long))

    # -- accounting ----------------------------------------------------------------
    def window_bytes(self) -> tuple[int, int]:
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
