"""The paged KV cache: a block pool preallocated from a byte budget, in one storage mode.

``KvCacheConfig`` says which mode, how many bytes and how the pool is paged; the
block manager (``cabinllm.runtime.kv.blocks``) decides which block each token of a
``Sequence`` goes to; the mode's storage class (``cabinllm.runtime.kv.modes``) holds the
blocks' contents. Writes of a sequence come in position order, layer by layer. Whoever plans what fits (a
session, the server's admission) asks the cache's capacity queries, never the block manager.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kv.blocks import BlockManager, MediaSpan, Sequence, cdiv
from cabinllm.runtime.kv.modes import KVMode, kv_mode
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.kv.window import WindowedStorage, WindowPlan

DEFAULT_TOKENS_PER_BLOCK = 32  # the reference engine's default; a target's profile has its own
DEFAULT_KV_BYTES = 64 << 20  # the KV budget of a run that names none


@dataclass(frozen=True)
class KvCacheConfig:
    """The KV cache of one run; fields named as TensorRT-LLM's ``KvCacheConfig`` names them where it has them, each
    with the description the commands' flags show. ``kv_mode`` and ``tokens_per_block`` left None are the engine's
    (``Engine.kv_cache_config`` fills them in); a cache needs them set."""

    kv_mode: str | None = field(default=None, metadata={  # a former name is read as the registry's (kv.modes)
        "help": "KV storage; the static-scale modes (int8, int8-separate, fp8) use the engine's kv_scales.json"})
    max_bytes: int = field(default=DEFAULT_KV_BYTES, metadata={  # TensorRT-LLM sizes its pool in max_tokens instead
        "help": "KV cache budget"})
    tokens_per_block: int | None = field(default=None, metadata={
        "help": "tokens per KV block, the unit of prefix reuse"})
    enable_block_reuse: bool = field(default=True, metadata={
        "help": "find blocks of a prefix computed before by their hash and share them"})
    sink_token_length: int = field(default=4, metadata={
        "help": "tokens after the system prompt the sink window always keeps"})

    def __post_init__(self) -> None:
        if self.kv_mode is not None:
            object.__setattr__(self, "kv_mode", kv_mode(self.kv_mode).name)
        tpb = self.tokens_per_block
        if (tpb is not None and tpb < 1) or self.max_bytes < 1 or self.sink_token_length < 0:
            raise ConfigError(f"need tokens_per_block >= 1, max_bytes >= 1 and sink_token_length >= 0, got "
                              f"{self.tokens_per_block}, {self.max_bytes} and {self.sink_token_length}")

    @property
    def mode(self) -> KVMode:
        """The storage class of ``kv_mode``."""
        if self.kv_mode is None or self.tokens_per_block is None:
            raise ConfigError("this KV cache config leaves its mode or block size to the engine; fill them in with "
                              "Engine.kv_cache_config before sizing a cache")
        return kv_mode(self.kv_mode)

    def bytes_per_token(self, layout: KVLayout) -> int:
        """Bytes one token takes in the blocks (the global layers' where some layers have a window)."""
        return pool_bytes(self.mode, layout, self.tokens_per_block)[0]

    def reserved_bytes(self, layout: KVLayout, max_sequences: int = 1) -> int:
        """Bytes held outside the blocks: int4's fp16 window, the sliding-window layers' pool for
        ``max_sequences`` sequences."""
        return pool_bytes(self.mode, layout, self.tokens_per_block, max_sequences)[1]

    def max_tokens(self, layout: KVLayout, max_sequences: int = 1) -> int:
        """Tokens the budget holds (TensorRT-LLM's ``max_tokens``)."""
        return max(0, self.max_bytes - self.reserved_bytes(layout, max_sequences)) // self.bytes_per_token(layout)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def pool_bytes(mode: KVMode, layout: KVLayout, tokens_per_block: int, max_sequences: int = 1,
               **storage_options) -> tuple[int, int]:
    """(bytes one token takes in the blocks, bytes held outside them) of ``mode``: where some layers have a window,
    the blocks hold the other layers and the window pool of ``max_sequences`` sequences is held outside."""
    tpb = tokens_per_block
    plan = WindowPlan.of(layout, tpb)
    if plan is None:
        return mode.bytes_per_token(layout, tpb), mode.reserved_bytes(layout, tpb, **storage_options)
    return (mode.bytes_per_token(plan.layout(layout, plan.global_layers), tpb),
            WindowedStorage.pool_bytes(mode, layout, plan, max_sequences))


def sized_config(layout: KVLayout, kv_mode_name: str, tokens: int,
                 tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK) -> KvCacheConfig:
    """A config whose budget holds one sequence of ``tokens`` tokens, and nothing more."""
    config = KvCacheConfig(kv_mode_name, 1, tokens_per_block)
    blocks = cdiv(tokens, tokens_per_block)
    budget = config.bytes_per_token(layout) * tokens_per_block * blocks
    return replace(config, max_bytes=budget + config.reserved_bytes(layout))


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

    def __init__(self, layout: KVLayout, config: KvCacheConfig, scales: KVScales | None = None,
                 storage_class: KVMode | None = None, max_sequences: int = 1, device: torch.device | str = "cpu",
                 **storage_options) -> None:
        """``storage_class`` replaces the config's mode by a variant of it (an experiment's); ``max_sequences``:
        the sequences whose windows a model with sliding-window layers holds at once; ``device``: where the pools
        live (a GPU's memory for the CUDA runner; block tables and slots stay on the host); ``storage_options`` go
        to the storage class (int4: ``window``)."""
        self.layout, self.config, self.scales, self.device = layout, config, scales, torch.device(device)
        mode, tpb = storage_class or config.mode, config.tokens_per_block
        plan, self._mode, self.max_sequences = WindowPlan.of(layout, tpb), mode, max_sequences
        if max_sequences < 1:
            raise ConfigError(f"max_sequences must be >= 1, got {max_sequences}")
        per_token, reserved = pool_bytes(mode, layout, tpb, max_sequences, **storage_options)
        self.bytes_per_block = per_token * tpb
        num_blocks = (config.max_bytes - reserved) // self.bytes_per_block
        if num_blocks < 1:
            held = "the fp16 window" if mode.recent_window else "the sliding-window layers' pool"
            raise ConfigError(
                f"KV budget of {config.max_bytes} bytes holds no block of {tpb} tokens "
                f"({self.bytes_per_block} bytes in {mode.name}"
                + (f", plus {reserved} reserved for {held}" if reserved else "")
                + f"); raise the budget to at least {self.bytes_per_block + reserved} bytes")
        self.blocks = BlockManager(num_blocks, tpb, config.enable_block_reuse)
        with self.device:  # the storage's tensors (its pools) are made where torch's default device says
            self.storage = (mode(layout, num_blocks, tpb, scales, **storage_options) if plan is None else
                            WindowedStorage(mode, layout, num_blocks, plan, max_sequences, scales))

    def renewed(self) -> "PagedKVCache":
        """An empty cache like this one (its layout, config, scales, sequences and device)."""
        return PagedKVCache(self.layout, self.config, self.scales, max_sequences=self.max_sequences, device=self.device)

    @property
    def mode(self) -> KVMode:
        """The storage class of this cache (of its blocks' layers, where some layers have a window)."""
        return self._mode

    @property
    def tokens_per_block(self) -> int:
        """Tokens per KV block."""
        return self.config.tokens_per_block

    # -- sequences -----------------------------------------------------------------
    def allocate(self, seq: Sequence, token_ids: list[int], media: list[MediaSpan] = ()) -> int:
        """Fill an empty sequence (``media``: the images among its tokens); returns how many leading tokens are
        already cached (reused)."""
        self.storage.check_room(self.blocks.num_sequences)
        reused = self.blocks.allocate(seq, token_ids, self.storage.reusable_blocks, media)
        self.storage.follow(seq, reused)
        return reused

    def append(self, seq: Sequence, token_ids: list[int], media: list[MediaSpan] = ()) -> None:
        """Extend a sequence (``media``: images among the new tokens; a partial last block it shares with a fork is
        copied first)."""
        written = len(seq)
        for source, copy in self.blocks.append(seq, token_ids, media):
            self.storage.copy_block(source, copy)
        self.storage.follow(seq, written)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make the empty ``child`` a continuation of ``parent`` on the same blocks (copy-on-write)."""
        self.storage.check_room(self.blocks.num_sequences)
        self.blocks.fork(parent, child)
        self.storage.follow(child, len(child))

    def free(self, seq: Sequence) -> None:
        """Release a sequence; its full blocks stay cached for reuse until evicted."""
        self.storage.drop(seq)
        self.blocks.free(seq)

    def discard(self, seq: Sequence, written: int) -> None:
        """Release a sequence whose K/V was written only before position ``written``; no prefix reuses the rest."""
        self.storage.drop(seq)
        self.blocks.discard(seq, written)

    def block_table(self, seq: Sequence) -> torch.Tensor:
        """The sequence's block ids as a tensor."""
        return torch.tensor(seq.block_table, dtype=torch.long)

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions [start, end) of a sequence."""
        return torch.tensor(self.blocks.slots(seq, start, end), dtype=torch.long)

    def read(self, layer: int, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V of every token of a sequence in one layer, shape (tokens, kv_heads, head_size)."""
        return self.storage.read(layer, self.block_table(seq), len(seq))

    # -- capacity ------------------------------------------------------------------
    @property
    def pool_tokens(self) -> int:
        """Tokens the whole pool holds, every block."""
        return self.blocks.num_blocks * self.tokens_per_block

    def available_blocks(self) -> int:
        """Blocks new tokens can take now: free plus evictable cached ones."""
        return self.blocks.num_free_blocks()

    def blocks_needed(self, seq: Sequence, new_tokens: int) -> int:
        """New blocks a sequence (empty: a new one, prefix reuse ignored) takes to grow by ``new_tokens``."""
        return self.blocks.blocks_needed(seq, new_tokens)

    def blocks_to_admit(self, token_ids: list[int], reserve_tokens: int,
                        media: list[MediaSpan] = ()) -> tuple[int, int]:
        """For a new sequence of ``token_ids`` (``media`` among them) that may grow by ``reserve_tokens``: the
        available blocks it would take (its cached prefix counted where it leaves the evictable ones) and the tokens
        it reuses."""
        return self.blocks.blocks_to_admit(token_ids, reserve_tokens, self.storage.reusable_blocks, media)

    def capacity(self, seq: Sequence) -> int:
        """Tokens a sequence could hold: its own blocks plus every free or evictable one."""
        return (len(seq.block_table) + self.available_blocks()) * self.tokens_per_block

    def fits(self, seq: Sequence, new_tokens: int) -> bool:
        """Whether ``new_tokens`` fit after the sequence's tokens in blocks free or evictable now."""
        return self.blocks_needed(seq, new_tokens) <= self.available_blocks()

    # -- accounting ----------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Bytes one token takes in this cache's blocks, scales included (int4's fp16 window buffers and the
        sliding-window layers' pool not included)."""
        return self.bytes_per_block // self.tokens_per_block

    def stats(self) -> CacheStats:
        """Bytes reserved and used, block counters, reuse hits."""
        b = self.blocks.stats()
        window_reserved, window_used = self.storage.window_bytes()
        return CacheStats(
            mode=self.mode.name,
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
