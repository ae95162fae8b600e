"""KV storage modes: one class per way of storing K/V in the paged cache's blocks.

Each class states what its mode is (name, label, capabilities as class attributes),
how many bytes a token takes, how K/V are written into and read from the block
pools, what a session file saves of it and what the native decode attention reads.
Pools are laid out ``(layers, blocks, tokens_per_block, kv_heads, head_size)``;
the block manager decides which block each token goes to. ``cabinllm.runtime.kv.modes``
is the one registry that chooses a class by name; int4 lives in ``cabinllm.runtime.kv.int4``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import ClassVar

import torch

from cabinllm.runtime.errors import ConfigError, Fix, Hint
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kernels.bindings import StaticPools, StoredKV
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.memory import committed_zeros
from cabinllm.runtime.kv.quant import (dequantize_per_token, fp8_scale, quantize_fp8, quantize_per_token,
                                      quantize_static)

_SCALE_BYTES = 2  # one fp16 scale per token and KV head, for K and for V, in int8-dynamic


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache of one model."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    windows: tuple[int | None, ...] = ()  # each layer's attention window where some layer has one (None: all)

    @property
    def channels(self) -> int:
        """K (or V) channels of one token in one layer."""
        return self.num_kv_heads * self.head_size

    @classmethod
    def of(cls, config: ModelConfig) -> "KVLayout":
        """The KV cache shape of a model config."""
        windows = tuple(config.layer_window(i) for i in range(config.num_hidden_layers))
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_size,
                   windows if any(w is not None for w in windows) else ())


class KVStorage:
    """The block pools of one storage mode and how K/V go in and out of them."""

    name: ClassVar[str]
    label: ClassVar[str]  # what the mode stores, for reports
    reference: ClassVar[bool] = True  # the reference engine can store it
    static_scales: ClassVar[bool] = False  # needs calibrated static INT8 scales (kv_scales.json)
    shared_scale: ClassVar[bool] = False  # one static scale per layer for K and V (TensorRT-LLM's format)
    per_token: ClassVar[bool] = True  # each token's K/V in rows of their own: a session file can hold them
    recent_window: ClassVar[bool] = False  # keeps each sequence's newest tokens at higher precision
    trtllm_quant_algo: ClassVar[str | None] = None  # kv_cache_quant_algo in a TensorRT-LLM checkpoint
    trtllm_paged_context_fmha: ClassVar[bool] = True  # TensorRT-LLM can use paged context FMHA (block reuse)
    onnx_graph: ClassVar[bool] = False  # cabin-export can build ONNX graphs that take and give K/V in this form
    step_tokens: int | None = None  # the most new tokens of one sequence a model step may write (None: any)

    def __init__(self, layout: KVLayout, num_blocks: int, tokens_per_block: int,
                 scales: KVScales | None = None) -> None:
        self.layout, self.num_blocks, self.tokens_per_block = layout, num_blocks, tokens_per_block

    @classmethod
    def bytes_per_token(cls, layout: KVLayout, tokens_per_block: int) -> int:
        """Bytes one token takes in the blocks, all layers, K and V, scales included."""
        raise NotImplementedError

    @classmethod
    def reserved_bytes(cls, layout: KVLayout, tokens_per_block: int, **options) -> int:
        """Bytes reserved outside the blocks for one sequence (int4's fp16 window)."""
        return 0

    # -- sequences: hooks for modes that follow each sequence --------------------------------
    def follow(self, seq: Sequence, written: int) -> None:
        """The sequence grew from ``written`` tokens to ``len(seq)``."""

    def drop(self, seq: Sequence) -> None:
        """The sequence is about to be freed."""

    def check_room(self, live: int) -> None:
        """OutOfBlocks unless a sequence more than ``live`` fits beside them (a pool sized per sequence)."""

    def reusable_blocks(self, block_ids: list[int]) -> int:
        """How many of a prefix's cached blocks a new sequence can reuse (all of them here)."""
        return len(block_ids)

    def prepare(self, seq: Sequence, start: int, end: int) -> None:
        """Positions [start, end) of the sequence are computed next (at most ``step_tokens`` of them)."""

    def kept_from(self, layer: int, num_tokens: int) -> int:
        """The first position whose K/V a layer still holds for a sequence of ``num_tokens`` (all: 0)."""
        return 0

    # -- data --------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of shape (tokens, kv_heads, head_size) into flat slots of one layer."""
        raise NotImplementedError

    def copy_block(self, source: int, copy: int) -> None:
        """Give block ``copy`` the contents of block ``source`` in every layer (copy-on-write of a fork)."""
        for pool in self.token_tensors().values():
            pool[:, copy] = pool[:, source]

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V of a sequence's first num_tokens tokens, shape (tokens, kv_heads, head_size)."""
        raise NotImplementedError

    def read_unscaled(self, layer: int, block_table: torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Like ``read``, with one static K and V scale left for the caller to apply (1 here).

        Attention is linear in V and in K for a fixed q, so the caller can scale q by the K scale
        and the output by the V scale instead of scaling the whole history at every step.
        """
        return (*self.read(layer, block_table, num_tokens), 1.0, 1.0)

    def stored_kv(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> StoredKV:
        """One layer's K and V as stored, for the native decode attention to read in place."""
        raise NotImplementedError

    def layer_slots(self, layer: int, slots: torch.Tensor) -> tuple[StoredKV, torch.Tensor]:
        """One layer's pools (``stored_kv`` with an empty block table) and where flat ``slots`` of the blocks are in
        them: what a kernel that stores K/V in place writes to."""
        return self.stored_kv(layer, torch.zeros(0, dtype=torch.long), 0), slots

    def static_pools(self) -> StaticPools | None:
        """All layers' pools, where each layer's elements convert with one static scale (the fused decode
        step's form); None otherwise."""
        return None

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """The per-token pools a session file saves, each (layers, blocks, tokens_per_block, ...)."""
        raise ConfigError(f"saving a session needs per-token KV storage; {self.name} stores whole blocks",
                          (Hint(Fix.PER_TOKEN_KV_MODE),))

    def session_rows(self, seq: Sequence) -> dict[str, torch.Tensor]:
        """What a session file saves of a sequence: each per-token pool's rows of its tokens, in order (on the host)."""
        slots = sequence_slots(seq, 0, len(seq), self.tokens_per_block)
        return {name: t.flatten(1, 2)[:, slots].cpu().contiguous() for name, t in self.token_tensors().items()}

    def restore_rows(self, seq: Sequence, rows: dict[str, torch.Tensor], start: int) -> None:
        """Put a session file's rows (``session_rows``) of positions [start, len(seq)) back into the pools."""
        slots = sequence_slots(seq, start, len(seq), self.tokens_per_block)
        for name, t in self.token_tensors().items():
            t.flatten(1, 2)[:, slots] = rows[name][:, start:].to(t.device)

    def window_bytes(self) -> tuple[int, int]:
        """Bytes held outside the blocks (reserved, in use)."""
        return 0, 0

    def scales_fingerprint(self) -> str:
        """Hash of the static scales this storage quantizes with ('none' without them)."""
        return "none"


class _PooledKV(KVStorage):
    """K and V pools of one element type, one row per token."""

    element: ClassVar[torch.dtype]

    def __init__(self, layout: KVLayout, num_blocks: int, tokens_per_block: int,
                 scales: KVScales | None = None) -> None:
        super().__init__(layout, num_blocks, tokens_per_block, scales)
        shape = (layout.num_layers, num_blocks, tokens_per_block, layout.num_kv_heads, layout.head_size)
        self.k_data = committed_zeros(*shape, dtype=self.element)
        self.v_data = committed_zeros(*shape, dtype=self.element)

    @classmethod
    def bytes_per_token(cls, layout: KVLayout, tokens_per_block: int) -> int:
        """Bytes one token takes in the blocks, all layers, K and V, scales included."""
        return 2 * layout.channels * cls.element.itemsize * layout.num_layers

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """The K and V pools."""
        return {"k_data": self.k_data, "v_data": self.v_data}

    def _flat(self, pool: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer's pool as (slots, ...)."""
        return pool[layer].flatten(0, 1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V converted to the element type."""
        self._flat(self.k_data, layer)[slots] = k.to(self.element)
        self._flat(self.v_data, layer)[slots] = v.to(self.element)

    def write_stored(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V already in the element type (int8: codes), as a graph that quantized them hands them back."""
        self._flat(self.k_data, layer)[slots] = k
        self._flat(self.v_data, layer)[slots] = v

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V of a sequence's first num_tokens tokens."""
        return (gather(self.k_data[layer], block_table, num_tokens).float(),
                gather(self.v_data[layer], block_table, num_tokens).float())

    def stored_kv(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> StoredKV:
        """The layer's pools and the sequence's block table."""
        return StoredKV(self.k_data[layer], self.v_data[layer], block_table)

    def static_pools(self) -> StaticPools | None:
        """The pools, converted with scale 1."""
        ones = torch.ones(self.layout.num_layers)
        return StaticPools(self.k_data, self.v_data, ones, ones)


class Fp32KV(_PooledKV):
    """float32: the exact reference."""

    name, label, element, onnx_graph = "fp32", "fp32", torch.float32, True


class Fp16KV(_PooledKV):
    """float16."""

    name, label, element, onnx_graph = "fp16", "fp16", torch.float16, True


class Int8KV(_PooledKV):
    """int8 with one static scale per layer shared by K and V (TensorRT-LLM's format)."""

    name, label, element = "int8", "int8, one static scale per layer shared by K and V", torch.int8
    static_scales, shared_scale, onnx_graph = True, True, True
    trtllm_quant_algo, trtllm_paged_context_fmha = "INT8", False

    def __init__(self, layout: KVLayout, num_blocks: int, tokens_per_block: int,
                 scales: KVScales | None = None) -> None:
        if scales is None or len(scales.k) != layout.num_layers:
            raise ConfigError(f"KV mode {self.name} needs static scales for all {layout.num_layers} layers")
        super().__init__(layout, num_blocks, tokens_per_block, scales)
        k, v = self._scales(scales)
        # float32 values, kept as Python floats: read every step without a tensor lookup
        self.k_scale, self.v_scale = torch.tensor(k).tolist(), torch.tensor(v).tolist()

    @staticmethod
    def _scales(scales: KVScales) -> tuple[list[float], list[float]]:
        return scales.shared(), scales.shared()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rounded with the layer's static scales."""
        self._flat(self.k_data, layer)[slots] = quantize_static(k, self.k_scale[layer])
        self._flat(self.v_data, layer)[slots] = quantize_static(v, self.v_scale[layer])

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V, dequantized."""
        k, v, k_scale, v_scale = self.read_unscaled(layer, block_table, num_tokens)
        return k * k_scale, v * v_scale

    def read_unscaled(self, layer: int, block_table: torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """The int8 codes as fp32 with the layer's K and V scales."""
        k, v = super().read(layer, block_table, num_tokens)
        return k, v, self.k_scale[layer], self.v_scale[layer]

    def stored_kv(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> StoredKV:
        """The int8 pools with the layer's scales."""
        stored = super().stored_kv(layer, block_table, num_tokens)
        stored.k_scale, stored.v_scale = self.k_scale[layer], self.v_scale[layer]
        return stored

    def static_pools(self) -> StaticPools | None:
        """The pools with each layer's K and V scales."""
        return StaticPools(self.k_data, self.v_data, torch.tensor(self.k_scale), torch.tensor(self.v_scale))

    def scales_fingerprint(self) -> str:
        """Hash of the K and V scales."""
        return hashlib.sha256(json.dumps([self.k_scale, self.v_scale]).encode()).hexdigest()[:16]


class Int8SeparateKV(Int8KV):
    """int8 with static per-layer scales, one for K and one for V."""

    name, label, shared_scale = "int8-separate", "int8, static per-layer K and V scales", False
    onnx_graph = False

    @staticmethod
    def _scales(scales: KVScales) -> tuple[list[float], list[float]]:
        return scales.k, scales.v


class Int8DynamicKV(_PooledKV):
    """int8 with one fp16 scale per token and KV head, stored beside the block."""

    name, label, element = "int8-dynamic", "int8 + fp16 scale per token and KV head", torch.int8
    trtllm_paged_context_fmha = False

    def __init__(self, layout: KVLayout, num_blocks: int, tokens_per_block: int,
                 scales: KVScales | None = None) -> None:
        super().__init__(layout, num_blocks, tokens_per_block, scales)
        self.k_sdata = committed_zeros(*self.k_data.shape[:-1], dtype=torch.float16)
        self.v_sdata = committed_zeros(*self.v_data.shape[:-1], dtype=torch.float16)

    @classmethod
    def bytes_per_token(cls, layout: KVLayout, tokens_per_block: int) -> int:
        """int8 elements plus the fp16 scales of K and V per KV head."""
        return super().bytes_per_token(layout, tokens_per_block) + \
            2 * layout.num_kv_heads * _SCALE_BYTES * layout.num_layers

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """K and V pools and their per-token scales."""
        return {**super().token_tensors(), "k_sdata": self.k_sdata, "v_sdata": self.v_sdata}

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V with a scale per token and head."""
        for x, codes, scales in ((k, self.k_data, self.k_sdata), (v, self.v_data, self.v_sdata)):
            self._flat(codes, layer)[slots], self._flat(scales, layer)[slots] = quantize_per_token(x)

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V, dequantized per token."""
        return tuple(dequantize_per_token(gather(codes[layer], block_table, num_tokens),
                                          gather(scales[layer], block_table, num_tokens))
                     for codes, scales in ((self.k_data, self.k_sdata), (self.v_data, self.v_sdata)))

    def static_pools(self) -> StaticPools | None:
        """None: each token has scales of its own."""
        return None

    def stored_kv(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> StoredKV:
        """The int8 pools with their per-token scales."""
        stored = super().stored_kv(layer, block_table, num_tokens)
        stored.k_token_scales, stored.v_token_scales = self.k_sdata[layer], self.v_sdata[layer]
        return stored


class Fp8KV(Int8KV):
    """FP8 (e4m3) with one static scale per layer shared by K and V (TensorRT-LLM's FP8 KV): amax / 448."""

    name, label, element = "fp8", "fp8 e4m3, one static scale per layer shared by K and V", torch.float8_e4m3fn
    onnx_graph, trtllm_quant_algo, trtllm_paged_context_fmha = False, "FP8", True

    @staticmethod
    def _scales(scales: KVScales) -> tuple[list[float], list[float]]:
        shared = [fp8_scale(s) for s in scales.shared()]
        return shared, shared

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V as e4m3 values of x / scale."""
        self._flat(self.k_data, layer)[slots] = quantize_fp8(k, self.k_scale[layer])
        self._flat(self.v_data, layer)[slots] = quantize_fp8(v, self.v_scale[layer])


def sequence_slots(seq: Sequence, start: int, end: int, tokens_per_block: int) -> torch.Tensor:
    """Flat slots (``block * tokens_per_block + offset``) of a sequence's positions [start, end)."""
    positions = torch.arange(start, end)
    table = torch.tensor(seq.block_table, dtype=torch.long)
    return table[positions // tokens_per_block] * tokens_per_block + positions % tokens_per_block


def gather(pool: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens token rows of the blocks in block_table, from one layer's (blocks, tpb, ...) pool.

    ``index_select`` on one layer is far faster than indexing (layer, block_table) together.
    """
    return pool.index_select(0, block_table).flatten(0, 1)[:num_tokens]
