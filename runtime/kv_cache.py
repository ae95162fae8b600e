"""The paged KV cache: a block pool preallocated from a byte budget, in one storage mode.

Storage modes:
- ``fp32``: exact reference; ``fp16``: half precision;
- ``int8``: one static scale per layer shared by K and V (TensorRT-LLM's format);
- ``int8-separate``: static per-layer scales, one for K and one for V;
- ``int8-dynamic``: one fp16 scale per token and KV head, stored beside the block;
- ``int4``: KIVI-style 4-bit (runtime.kv_int4): keys per channel over the tokens
  of a block, values per token in groups of 32 channels, fp16 scales and zeros;
  each sequence's newest ``int4_window`` tokens stay in fp16 block buffers
  (runtime.kv_int4_pool). One sequence's buffers are reserved from the budget;
  more are added, and counted in ``stats()``, when several sequences are live.

Tensors are laid out ``(layers, blocks, tokens_per_block, kv_heads, head_size)``;
the block manager decides which block each token goes to. Writes of a sequence
come in position order, layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.block_manager import BlockManager
from runtime.committed import committed_zeros
from runtime.kv_int4 import VALUE_GROUP
from runtime.kv_int4_pool import INT4_WINDOW, Int4Pool, buffers_per_sequence
from runtime.kv_quant import dequantize_per_token, quantize_per_token, quantize_static
from runtime.native_kernels import StoredKV

KV_MODES = ("fp32", "fp16", "int8", "int8-separate", "int8-dynamic", "int4")
STATIC_INT8_MODES = ("int8", "int8-separate")
_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "int8": 1, "int8-separate": 1, "int8-dynamic": 1}
_SCALE_BYTES = 2  # fp16 scale per token and KV head, for K and for V, in int8-dynamic
_INT4_META_BYTES = 4  # fp16 scale + fp16 zero per group


@dataclass
class KVScales:
    """Static INT8 scales (amax / 127), one per layer for K and one for V."""

    k: list[float]
    v: list[float]

    def shared(self) -> list[float]:
        """One scale per layer for K and V together, as TensorRT-LLM stores it."""
        return [max(k, v) for k, v in zip(self.k, self.v)]


@dataclass
class KVLayout:
    """Shape of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_size: int

    def bytes_per_token(self, mode: str, tokens_per_block: int = 32) -> int:
        """Bytes one token takes in the cache, all layers, K and V, scales included.

        For ``int4`` the per-block key scales are spread over the block's tokens
        (rounded up); the fp16 window of each sequence is not included
        (see ``int4_window_bytes``).
        """
        if mode not in KV_MODES:
            raise ValueError(f"unknown KV cache mode {mode!r}; choose one of {', '.join(KV_MODES)}")
        channels = self.num_kv_heads * self.head_size
        if mode == "int4":
            self.check_int4()
            block_bytes = (tokens_per_block * channels  # K and V codes, half a byte each
                           + channels * _INT4_META_BYTES  # key groups: one per channel per block
                           + tokens_per_block * channels // VALUE_GROUP * _INT4_META_BYTES)  # value groups
            return -(-block_bytes * self.num_layers // tokens_per_block)
        per_layer = 2 * channels * _ELEMENT_BYTES[mode]
        if mode == "int8-dynamic":
            per_layer += 2 * self.num_kv_heads * _SCALE_BYTES
        return per_layer * self.num_layers

    def int4_window_bytes(self, tokens_per_block: int, window: int = INT4_WINDOW) -> int:
        """Bytes of the fp16 block buffers one sequence's newest ``window`` tokens need in the int4 mode."""
        return self.bytes_per_token("fp16") * tokens_per_block * buffers_per_sequence(tokens_per_block, window)

    def check_int4(self) -> None:
        """Raise ValueError if the head size does not split into int4 value groups."""
        if self.head_size % VALUE_GROUP:
            raise ValueError(f"int4 KV needs a head size divisible by {VALUE_GROUP}, this model has "
                             f"{self.head_size}; use int8 or int8-dynamic")


@dataclass
class CacheStats:
    """Memory and block counters of the cache."""

    mode: str
    bytes_per_token: int
    bytes_reserved: int
    bytes_used: int
    tokens_capacity: int
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_in_use: int
    reuse_hits: int
    window_bytes: int = 0  # int4: fp16 buffers holding the newest tokens of each sequence


class PagedKVCache:
    """Block pool plus block tables; writes and reads K/V of one sequence at a time."""

    def __init__(self, layout: KVLayout, mode: str, max_bytes: int, tokens_per_block: int = 32,
                 scales: KVScales | None = None, int4_window: int = INT4_WINDOW) -> None:
        self.layout, self.mode, self.tokens_per_block = layout, mode, tokens_per_block
        bytes_per_block = layout.bytes_per_token(mode, tokens_per_block) * tokens_per_block
        reserved = layout.int4_window_bytes(tokens_per_block, int4_window) if mode == "int4" else 0
        num_blocks = (max_bytes - reserved) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV budget of {max_bytes} bytes holds no block of {tokens_per_block} tokens "
                f"({bytes_per_block} bytes in {mode}, plus {reserved} for the fp16 window); "
                f"raise the budget to at least {bytes_per_block + reserved} bytes"
            )
        if mode in STATIC_INT8_MODES:
            if scales is None or len(scales.k) != layout.num_layers:
                raise ValueError(f"KV mode {mode} needs static scales for all {layout.num_layers} layers")
            k, v = (scales.shared(), scales.shared()) if mode == "int8" else (scales.k, scales.v)
            # float32 values, kept as Python floats: read every step without a tensor lookup
            self.k_scale, self.v_scale = torch.tensor(k).tolist(), torch.tensor(v).tolist()
        self.blocks = BlockManager(num_blocks, tokens_per_block)
        self.bytes_per_block = bytes_per_block
        if mode == "int4":
            self._int4 = Int4Pool(layout.num_layers, num_blocks, tokens_per_block, layout.num_kv_heads,
                                  layout.head_size, int4_window)
            return
        shape = (layout.num_layers, num_blocks, tokens_per_block, layout.num_kv_heads, layout.head_size)
        dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(mode, torch.int8)
        self.k_data = committed_zeros(*shape, dtype=dtype)
        self.v_data = committed_zeros(*shape, dtype=dtype)
        if mode == "int8-dynamic":
            self.k_sdata = committed_zeros(*shape[:-1], dtype=torch.float16)
            self.v_sdata = committed_zeros(*shape[:-1], dtype=torch.float16)

    # -- sequences -----------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: list[int]) -> int:
        """Start a sequence; returns how many leading tokens are already cached (reused)."""
        reused = self.blocks.allocate(seq_id, token_ids)
        if self.mode == "int4":
            self._int4.follow(seq_id, self.blocks.block_table(seq_id), reused, len(token_ids))
        return reused

    def append(self, seq_id: int, token_ids: list[int]) -> None:
        """Extend a sequence, copying shared blocks before they are written."""
        written = self.blocks.num_tokens(seq_id)
        for src, dst in self.blocks.append(seq_id, token_ids):
            self._copy_block(src, dst)
        if self.mode == "int4":
            self._int4.follow(seq_id, self.blocks.block_table(seq_id), written, written + len(token_ids))

    def free(self, seq_id: int) -> None:
        """Release a sequence; its full blocks stay cached for reuse until evicted."""
        if self.mode == "int4":
            self._int4.drop(seq_id, self.blocks.block_table(seq_id), self.blocks.num_tokens(seq_id))
        self.blocks.free(seq_id)

    def _copy_block(self, src: int, dst: int) -> None:
        if self.mode == "int4":
            self._int4.copy_block(src, dst)
            return
        tensors = [self.k_data, self.v_data]
        if self.mode == "int8-dynamic":
            tensors += [self.k_sdata, self.v_sdata]
        for t in tensors:
            t[:, dst] = t[:, src]

    # -- data ----------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of shape (tokens, kv_heads, head_size) into flat slots of one layer."""
        if self.mode == "int4":
            self._int4.write(layer, slots, k, v)
            return
        k_flat = self.k_data[layer].view(-1, *self.k_data.shape[3:])
        v_flat = self.v_data[layer].view(-1, *self.v_data.shape[3:])
        if self.mode in ("fp32", "fp16"):
            k_flat[slots], v_flat[slots] = k.to(k_flat.dtype), v.to(v_flat.dtype)
        elif self.mode in STATIC_INT8_MODES:
            k_flat[slots] = quantize_static(k, self.k_scale[layer])
            v_flat[slots] = quantize_static(v, self.v_scale[layer])
        else:
            (k_flat[slots], self.k_sdata[layer].view(-1, k.shape[1])[slots]) = quantize_per_token(k)
            (v_flat[slots], self.v_sdata[layer].view(-1, v.shape[1])[slots]) = quantize_per_token(v)

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V of a sequence's first num_tokens tokens, shape (tokens, kv_heads, head_size)."""
        if self.mode == "int4":
            return self._int4.read(layer, block_table, num_tokens)
        if self.mode in STATIC_INT8_MODES:
            k, v, k_scale, v_scale = self.read_unscaled(layer, block_table, num_tokens)
            return k * k_scale, v * v_scale
        k = _gather(self.k_data[layer], block_table, num_tokens)
        v = _gather(self.v_data[layer], block_table, num_tokens)
        if self.mode in ("fp32", "fp16"):
            return k.float(), v.float()
        k_s = _gather(self.k_sdata[layer], block_table, num_tokens)
        v_s = _gather(self.v_sdata[layer], block_table, num_tokens)
        return dequantize_per_token(k, k_s), dequantize_per_token(v, v_s)

    def read_unscaled(self, layer: int, block_table: torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Like ``read``, but static INT8 codes come back unscaled with their K and V scales.

        Attention is linear in V and in K for a fixed q, so the caller can scale q by the K scale
        and the output by the V scale instead of scaling the whole history at every step.
        Other modes return dequantized K/V and scales of 1.
        """
        if self.mode not in STATIC_INT8_MODES:
            return (*self.read(layer, block_table, num_tokens), 1.0, 1.0)
        k = _gather(self.k_data[layer], block_table, num_tokens).float()
        v = _gather(self.v_data[layer], block_table, num_tokens).float()
        return k, v, self.k_scale[layer], self.v_scale[layer]

    def stored_kv(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> StoredKV:
        """One layer's K and V as stored, for the native decode attention to read in place.

        int4 comes back dequantized, as one block of the sequence's num_tokens tokens.
        """
        if self.mode == "int4":
            k, v = self._int4.read(layer, block_table, num_tokens)
            return StoredKV(k[None], v[None], torch.zeros(1, dtype=torch.long))
        stored = StoredKV(self.k_data[layer], self.v_data[layer], block_table)
        if self.mode in STATIC_INT8_MODES:
            stored.k_scale, stored.v_scale = self.k_scale[layer], self.v_scale[layer]
        elif self.mode == "int8-dynamic":
            stored.k_token_scales, stored.v_token_scales = self.k_sdata[layer], self.v_sdata[layer]
        return stored

    def block_table(self, seq_id: int) -> torch.Tensor:
        """The sequence's block ids as a tensor."""
        return torch.tensor(self.blocks.block_table(seq_id), dtype=torch.long)

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions [start, end) of a sequence."""
        return torch.tensor(self.blocks.slots(seq_id, start, end), dtype=torch.long)

    # -- accounting ----------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this cache, scales included (int4: fp16 window buffers not included)."""
        return self.layout.bytes_per_token(self.mode, self.tokens_per_block)

    def stats(self) -> CacheStats:
        """Bytes reserved and used, block counters, reuse hits."""
        b = self.blocks.stats()
        window_reserved, window_used = self._int4.buffer_bytes() if self.mode == "int4" else (0, 0)
        return CacheStats(
            mode=self.mode,
            bytes_per_token=self.bytes_per_token(),
            bytes_reserved=b.num_blocks * self.bytes_per_block + window_reserved,
            bytes_used=b.in_use * self.bytes_per_block + window_used,
            tokens_capacity=b.num_blocks * self.tokens_per_block,
            blocks_total=b.num_blocks,
            blocks_free=b.free,
            blocks_cached=b.cached,
            blocks_in_use=b.in_use,
            reuse_hits=b.reuse_hits,
            window_bytes=window_reserved,
        )


def _gather(pool: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens token rows of the blocks in block_table, from one layer's (blocks, tpb, ...) pool.

    ``index_select`` on one layer is far faster than indexing (layer, block_table) together.
    """
    return pool.index_select(0, block_table).flatten(0, 1)[:num_tokens]

