"""Sliding-window layers in the paged cache (Gemma 3's local layers attend over the last ``window`` positions).

A model's global layers keep every token in the paged blocks as any model does. Its local layers need only each
sequence's window, so their K/V live in a smaller pool of their own: a global block id maps to a local block
while some sequence's window covers it (pinned), and stays mapped afterwards (cached, least recently used
evicted first) so that a later sequence with the same prefix finds its window there. A reused prefix needs only
the local blocks of its first new query's window; the ones before it are never read again.

The pool holds the windows of ``max_sequences`` sequences at once: each pins at most ``blocks_per_sequence``
local blocks, its window plus the ``step_tokens`` new tokens a step may compute (the model splits longer spans).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from cabinllm.runtime.errors import ConfigError, Fix, Hint, OutOfBlocks
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kernels.bindings import StoredKV
from cabinllm.runtime.kv.blocks import Sequence, cdiv
from cabinllm.runtime.kv.storage import KVLayout, KVStorage, sequence_slots

WINDOW = "window."  # the window pool's tensors in a session file


@dataclass(frozen=True)
class WindowPlan:
    """How a layout with sliding-window layers splits into the blocks' layers and the window pool's."""

    window: int
    global_layers: tuple[int, ...]
    local_layers: tuple[int, ...]
    tokens_per_block: int

    @classmethod
    def of(cls, layout: KVLayout, tokens_per_block: int) -> "WindowPlan | None":
        """The plan of a layout, or None when no layer has a window."""
        windows = {w for w in layout.windows if w is not None}
        if not windows:
            return None
        if len(windows) > 1:
            raise ConfigError(f"layers with different attention windows {sorted(windows)} are not supported")
        local = tuple(i for i, w in enumerate(layout.windows) if w is not None)
        return cls(windows.pop(), tuple(i for i in range(layout.num_layers) if i not in local), local,
                   tokens_per_block)

    @property
    def step_tokens(self) -> int:
        """The most new tokens of one sequence a step computes: a quarter window, whole blocks, at least one."""
        tpb = self.tokens_per_block
        return max(tpb, self.window // 4 // tpb * tpb)

    @property
    def blocks_per_sequence(self) -> int:
        """Local blocks one sequence holds at most: its window and a step's new tokens, one more for alignment and
        one for the copy a fork's first write makes of a shared last block while the shared one is still pinned."""
        return cdiv(self.window - 1 + self.step_tokens, self.tokens_per_block) + 2

    def first_block(self, position: int) -> int:
        """The first block a query at ``position`` reads in a local layer."""
        return max(0, position - self.window + 1) // self.tokens_per_block

    def layout(self, layout: KVLayout, layers: tuple[int, ...]) -> KVLayout:
        """The layout of some of the layers, without windows."""
        return KVLayout(len(layers), layout.num_kv_heads, layout.head_size)


def _scales(scales: KVScales | None, layers: tuple[int, ...]) -> KVScales | None:
    return None if scales is None else KVScales([scales.k[i] for i in layers], [scales.v[i] for i in layers])


class WindowedStorage(KVStorage):
    """The storage of a model with sliding-window layers: its global layers in the paged blocks, its local layers
    in the window pool (both in one KV mode); layer indices are the model's."""

    def __init__(self, mode: type[KVStorage], layout: KVLayout, num_blocks: int, plan: WindowPlan,
                 max_sequences: int, scales: KVScales | None = None) -> None:
        if mode.recent_window or not mode.per_token:
            raise ConfigError(f"KV mode {mode.name} cannot hold sliding-window layers; choose int8, fp16 or fp32")
        super().__init__(layout, num_blocks, plan.tokens_per_block)
        self.plan, self.max_sequences, self.step_tokens = plan, max_sequences, plan.step_tokens
        self.name, self.label = mode.name, mode.label
        self._fingerprint = mode(layout, 1, plan.tokens_per_block, scales).scales_fingerprint()
        self.local_blocks = max_sequences * plan.blocks_per_sequence
        self.blocks = mode(plan.layout(layout, plan.global_layers), num_blocks, plan.tokens_per_block,
                           _scales(scales, plan.global_layers))
        self.window = mode(plan.layout(layout, plan.local_layers), self.local_blocks, plan.tokens_per_block,
                           _scales(scales, plan.local_layers))
        self._route = {layer: (self.blocks, i) for i, layer in enumerate(plan.global_layers)}
        self._route |= {layer: (self.window, i) for i, layer in enumerate(plan.local_layers)}
        # global block -> local block, -1: none; host bookkeeping, wherever the pools live
        self._local = torch.full((num_blocks,), -1, dtype=torch.long, device="cpu")
        self._cached: OrderedDict[int, None] = OrderedDict()  # mapped global blocks no sequence pins, oldest first
        self._free = list(range(self.local_blocks))
        self._pins: dict[int, int] = {}  # global block -> sequences pinning it
        self._pinned: dict[Sequence, list[int]] = {}  # sequence -> global blocks it pins, in order

    @classmethod
    def pool_bytes(cls, mode: type[KVStorage], layout: KVLayout, plan: WindowPlan, max_sequences: int) -> int:
        """Bytes of the window pool."""
        local = plan.layout(layout, plan.local_layers)
        return max_sequences * plan.blocks_per_sequence * plan.tokens_per_block * mode.bytes_per_token(
            local, plan.tokens_per_block)

    # -- sequences ---------------------------------------------------------------------------
    def check_room(self, live: int) -> None:
        """OutOfBlocks unless a sequence more than ``live`` can pin its window."""
        if live >= self.max_sequences:
            raise OutOfBlocks(f"the sliding-window layers' pool holds the windows of {self.max_sequences} "
                              f"sequences and {live} are live; raise max_sequences (the window pool)")

    def reusable_blocks(self, block_ids: list[int]) -> int:
        """Of a prefix's cached blocks, how many a new sequence can reuse: the most whose first new query's window
        is still mapped in the window pool."""
        tpb = self.plan.tokens_per_block
        for count in range(len(block_ids), 0, -1):
            window = block_ids[self.plan.first_block(count * tpb):count]
            if bool((self._local[window] >= 0).all()):
                return count
        return 0

    def follow(self, seq: Sequence, written: int) -> None:
        """Pin what the sequence's next query reads of the ``written`` positions that hold K/V (a reused prefix,
        a parent's tokens after a fork, the history before an append); blocks of new tokens wait for ``prepare``."""
        self._pin(seq, self.plan.first_block(written), cdiv(written, self.plan.tokens_per_block))

    def prepare(self, seq: Sequence, start: int, end: int) -> None:
        """Positions [start, end) are computed next: pin the blocks their queries read and write, let go of the
        ones no query reads any more."""
        if end - start > self.plan.step_tokens:
            raise ConfigError(f"a step of {end - start} new tokens of one sequence is more than the "
                              f"{self.plan.step_tokens} the sliding-window layers' pool holds per step; run prompts "
                              f"in pieces of at most {self.plan.step_tokens}",
                              (Hint(Fix.EXPORT_CHUNK, str(self.plan.step_tokens)),))
        self._pin(seq, self.plan.first_block(start), cdiv(end, self.plan.tokens_per_block))

    def kept_from(self, layer: int, num_tokens: int) -> int:
        """0 for a global layer; for a local one, the first position of the block its next query's window
        starts in."""
        local = self._route[layer][0] is self.window
        return self.plan.first_block(num_tokens) * self.plan.tokens_per_block if local else 0

    def drop(self, seq: Sequence) -> None:
        """Unpin the sequence's window."""
        for block in self._pinned.pop(seq, []):
            self._unpin(block)

    def _pin(self, seq: Sequence, first: int, stop: int) -> None:
        wanted = seq.block_table[first:stop]
        held = self._pinned.get(seq, [])
        for block in set(held) - set(wanted):
            self._unpin(block)
        for block in set(wanted) - set(held):
            self._map(block)
            self._pins[block] = self._pins.get(block, 0) + 1
            self._cached.pop(block, None)
        self._pinned[seq] = wanted

    def _unpin(self, block: int) -> None:
        self._pins[block] -= 1
        if not self._pins[block]:
            del self._pins[block]
            self._cached[block] = None

    def _map(self, block: int) -> None:
        """Give a global block a local one (a free one, else the least recently used unpinned one's)."""
        if self._local[block] >= 0:
            return
        if self._free:
            local = self._free.pop()
        elif self._cached:
            evicted, _ = self._cached.popitem(last=False)
            local = int(self._local[evicted])
            self._local[evicted] = -1
        else:
            raise OutOfBlocks(f"the sliding-window layers' pool ({self.local_blocks} blocks) is pinned whole; "
                              "raise max_sequences")
        self._local[block] = local

    # -- data ----------------------------------------------------------------------------------
    def _mapped(self, blocks: torch.Tensor) -> torch.Tensor:
        """The local blocks of global ones, which a step's ``prepare`` (or ``follow``) has pinned."""
        local = self._local[blocks]
        if bool((local < 0).any()):
            raise ValueError("a block outside the window pool was read; pin it first (prepare or follow)")
        return local

    def _table(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[KVStorage, int, torch.Tensor]:
        """The pool of a layer, its index there and the blocks holding a table's first ``num_tokens`` tokens."""
        storage, index = self._route[layer]
        if storage is self.blocks:
            return storage, index, block_table
        return storage, index, self._mapped(block_table[:cdiv(num_tokens, self.plan.tokens_per_block)])

    def _slots(self, layer: int, slots: torch.Tensor) -> tuple[KVStorage, int, torch.Tensor]:
        """The pool of a layer, its index there and where flat slots of the blocks are in it."""
        storage, index = self._route[layer]
        if storage is self.window:
            tpb = self.plan.tokens_per_block
            slots = self._mapped(slots // tpb) * tpb + slots % tpb
        return storage, index, slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V in the layer's pool."""
        storage, index, where = self._slots(layer, slots)
        storage.write(index, where, k, v)

    def write_stored(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V already in the element type in the layer's pool."""
        storage, index, where = self._slots(layer, slots)
        storage.write_stored(index, where, k, v)

    def read(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V of the table's first num_tokens tokens."""
        storage, index, table = self._table(layer, block_table, num_tokens)
        return storage.read(index, table, num_tokens)

    def read_unscaled(self, layer: int, block_table: torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """The layer's pool's ``read_unscaled``."""
        storage, index, table = self._table(layer, block_table, num_tokens)
        return storage.read_unscaled(index, table, num_tokens)

    def stored_kv(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> StoredKV:
        """The layer's pool's ``stored_kv``."""
        storage, index, table = self._table(layer, block_table, num_tokens)
        return storage.stored_kv(index, table, num_tokens)

    def layer_slots(self, layer: int, slots: torch.Tensor) -> tuple[StoredKV, torch.Tensor]:
        """The layer's pool and where the slots are in it."""
        storage, index, where = self._slots(layer, slots)
        return storage.layer_slots(index, where)

    def copy_block(self, source: int, copy: int) -> None:
        """Copy a block in the blocks' layers and, where the window pool maps it, in the local ones."""
        self.blocks.copy_block(source, copy)
        if self._local[source] >= 0:
            self._map(copy)
            self.window.copy_block(int(self._local[source]), int(self._local[copy]))

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """The blocks' pools, and the window pool's as ``window.`` ones."""
        return {**self.blocks.token_tensors(),
                **{f"{WINDOW}{name}": t for name, t in self.window.token_tensors().items()}}

    def session_rows(self, seq: Sequence) -> dict[str, torch.Tensor]:
        """Every token's rows of the global layers; the local layers' rows of what the next query's window reads."""
        rows = self.blocks.session_rows(seq)
        slots = self._slots(self.plan.local_layers[0], self._window_slots(seq, len(seq)))[2]
        return rows | {f"{WINDOW}{name}": t.flatten(1, 2)[:, slots].cpu().contiguous()
                       for name, t in self.window.token_tensors().items()}

    def restore_rows(self, seq: Sequence, rows: dict[str, torch.Tensor], start: int) -> None:
        """The global layers' rows from ``start`` on, and the saved window pinned and put back."""
        self.blocks.restore_rows(seq, {k: v for k, v in rows.items() if not k.startswith(WINDOW)}, start)
        self.follow(seq, len(seq))
        slots = self._slots(self.plan.local_layers[0], self._window_slots(seq, len(seq)))[2]
        for name, t in self.window.token_tensors().items():
            t.flatten(1, 2)[:, slots] = rows[f"{WINDOW}{name}"].to(t.device)

    def _window_slots(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        """The blocks' slots of the positions a local layer keeps for a sequence of ``num_tokens``."""
        return sequence_slots(seq, self.kept_from(self.plan.local_layers[0], num_tokens), num_tokens,
                              self.plan.tokens_per_block)

    def window_bytes(self) -> tuple[int, int]:
        """The window pool's bytes (reserved, pinned)."""
        per_block = self.window.bytes_per_token(self.window.layout, self.tokens_per_block) * self.tokens_per_block
        return self.local_blocks * per_block, len(self._pins) * per_block

    def scales_fingerprint(self) -> str:
        """The fingerprint of the scales of every layer."""
        return self._fingerprint
