"""What one step of the CUDA runner reads on the device (``StepInputs``), and decode steps captured as CUDA graphs
(``DecodeGraphs``).

A decode step of a small model is bound by kernel launches, not by the GPU: a CUDA graph replays the whole step's
launches at once. A graph holds fixed shapes and addresses, so each batch size bucket (``GRAPH_SIZES`` up to the
runner's ``max_batch``) gets one graph over static input buffers, captured on first use: a step of ``n`` sequences
runs the graph of the smallest bucket >= n with its inputs padded (``StepInputs.of(..., rows=bucket)``): a padded
row stores nothing (slot -1), reads no key (length 0) and gives logits nobody reads. Block tables are padded to the
widest a sequence can have, and decode attention splits its keys a fixed number of ways, so that nothing in the
graph depends on a host value. A new cache (other pools) captures anew.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cabinllm.runtime.kernels.bindings import StoredKV
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.kv.window import WindowedStorage
from cabinllm.runtime.model.interface import Span

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # batch size buckets of captured decode steps
DEFAULT_MAX_BATCH = 16  # the largest bucket captured unless the runner is told otherwise
PADDED_SLOT = -1  # a padded row's slot: the KV write stores nothing there


def graph_sizes(max_batch: int) -> tuple[int, ...]:
    """The buckets up to ``max_batch``, which is one itself."""
    return tuple(size for size in GRAPH_SIZES if size < max_batch) + (max_batch,)


def bucket(sizes: tuple[int, ...], rows: int) -> int | None:
    """The smallest bucket holding ``rows`` rows, or None where none does (the step runs without a graph)."""
    return next((size for size in sizes if size >= rows), None)


@dataclass
class LayerView:
    """Where one kind of layer (the paged blocks' layers, or a sliding-window model's local layers) finds each row's
    K/V: the new tokens' slots in its pools, each sequence's block table (int32, padded with block 0) and the keys
    that table holds (its query's own included)."""

    slots: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    ctx_lens: list[int]

    def copy_(self, other: "LayerView") -> None:
        """Take ``other``'s values (same shapes) into these tensors."""
        for name in ("slots", "tables", "lens"):
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)


@dataclass
class StepInputs:
    """One step's device inputs: token ids and positions (tokens,), a ``LayerView`` per kind of layer and which
    each layer reads (``layer_view``), each layer's pools, the new tokens per sequence and decode's split count
    (None: chosen from the lengths)."""

    ids: torch.Tensor
    positions: torch.Tensor
    views: list[LayerView]
    layer_view: list[int]
    pools: list[StoredKV]
    q_lens: list[int]
    splits: int | None = None

    @classmethod
    def of(cls, spans: list[Span], cache: PagedKVCache, device: torch.device, rows: int | None = None,
           widths: tuple[int, ...] | None = None, splits: int | None = None) -> "StepInputs":
        """The inputs of ``spans`` (their slots allocated and prepared); ``rows``, ``widths``: pad a decode step to
        ``rows`` sequences and its views' tables to ``widths`` blocks."""
        storage, tpb = cache.storage, cache.tokens_per_block
        padding = 0 if rows is None else rows - len(spans)
        ids = [t for span in spans for t in span.token_ids] + [0] * padding
        positions = [p for span in spans for p in range(span.start_pos, span.end)] + [0] * padding
        slots = torch.cat([cache.slots(span.seq, span.start_pos, span.end) for span in spans]
                          + [torch.full((padding,), PADDED_SLOT, dtype=torch.long)])
        tables = [list(span.seq.block_table) for span in spans]
        lens = [span.end for span in spans]
        views = [(slots, tables, lens)]
        layer_view = [0] * cache.layout.num_layers
        if isinstance(storage, WindowedStorage):
            views.append(_local_view(storage, spans, slots, tpb))
            for layer in storage.plan.local_layers:
                layer_view[layer] = 1
        empty = torch.zeros(0, dtype=torch.long)
        pools = [storage.layer_slots(layer, empty)[0] for layer in range(cache.layout.num_layers)]
        built = [_view(view_slots, view_tables, view_lens, padding, None if widths is None else widths[i], device)
                 for i, (view_slots, view_tables, view_lens) in enumerate(views)]
        as_device = lambda values: torch.tensor(values, dtype=torch.long).to(device)  # noqa: E731
        return cls(as_device(ids), as_device(positions), built, layer_view, pools,
                   [len(span.token_ids) for span in spans] + [1] * padding, splits)

    def copy_(self, other: "StepInputs") -> None:
        """Take ``other``'s tensors' values (same shapes) into these: a captured graph's static inputs."""
        self.ids.copy_(other.ids, non_blocking=True)
        self.positions.copy_(other.positions, non_blocking=True)
        for mine, theirs in zip(self.views, other.views):
            mine.copy_(theirs)


def _local_view(storage: WindowedStorage, spans: list[Span], slots: torch.Tensor,
                tpb: int) -> tuple[torch.Tensor, list[list[int]], list[int]]:
    """The local layers' slots, tables and lengths: each table from the block its first query's window starts in,
    mapped into the window pool."""
    local = storage.plan.local_layers[0]
    tables, lens = [], []
    for span in spans:
        first = storage.plan.first_block(span.start_pos)
        held = span.end - first * tpb
        table = torch.tensor(span.seq.block_table[first:], dtype=torch.long)
        tables.append(storage.stored_kv(local, table, held).block_table.tolist())
        lens.append(held)
    real = slots >= 0
    mapped = slots.clone()
    mapped[real] = storage.layer_slots(local, slots[real])[1].to(slots.device)
    return mapped, tables, lens


def _view(slots: torch.Tensor, tables: list[list[int]], lens: list[int], padding: int, width: int | None,
          device: torch.device) -> LayerView:
    width = max([len(t) for t in tables] + [1]) if width is None else width
    padded = torch.zeros(len(tables) + padding, width, dtype=torch.int32)
    for i, table in enumerate(tables):
        padded[i, :len(table)] = torch.as_tensor(table, dtype=torch.int32)
    return LayerView(slots.to(device), padded.to(device),
                     torch.tensor(lens + [0] * padding, dtype=torch.int32).to(device), lens + [0] * padding)


def table_widths(cache: PagedKVCache, max_position: int) -> tuple[int, ...]:
    """The widest block table each view of ``cache`` can have: the blocks of the context (or the whole pool), and a
    local view's window blocks."""
    tpb = cache.tokens_per_block
    widths = (min(cdiv(max_position, tpb), cache.blocks.num_blocks),)
    if isinstance(cache.storage, WindowedStorage):
        widths += (cache.storage.plan.blocks_per_sequence,)
    return widths


class DecodeGraphs:
    """Decode steps of a CUDA runner as CUDA graphs, one per bucket, captured on first use."""

    def __init__(self, runner, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        """``runner``: the ``CudaRunner`` whose ``decode`` is captured."""
        self.runner, self.sizes = runner, graph_sizes(max_batch)
        self._storage = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepInputs, torch.Tensor]] = {}
        self._pool = None

    def run(self, spans: list[Span], cache: PagedKVCache) -> torch.Tensor | None:
        """Logits (spans, vocab) of a decode step replayed from its bucket's graph; None where no bucket holds it."""
        size = bucket(self.sizes, len(spans))
        if size is None:
            return None
        if cache.storage is not self._storage:
            self._graphs.clear()
            self._storage = cache.storage
        widths = table_widths(cache, self.runner.config.max_position_embeddings)
        splits = self.runner.kernels.decode_splits(widths[0] * cache.tokens_per_block)
        inputs = StepInputs.of(spans, cache, self.runner.device, size, widths, splits)
        if size not in self._graphs:
            self._graphs[size] = self._capture(inputs)
        graph, static, logits = self._graphs[size]
        static.copy_(inputs)
        graph.replay()
        return logits[:len(spans)].clone()

    def _capture(self, inputs: StepInputs) -> tuple[torch.cuda.CUDAGraph, StepInputs, torch.Tensor]:
        """A graph of ``runner.decode`` over static copies of ``inputs``, captured with every row padded (so that
        warming up and capturing store nothing in the cache)."""
        static = StepInputs(inputs.ids.clone(), inputs.positions.clone(),
                            [LayerView(v.slots.clone().fill_(PADDED_SLOT), v.tables.clone(), v.lens.clone().zero_(),
                                       v.ctx_lens) for v in inputs.views],
                            inputs.layer_view, inputs.pools, inputs.q_lens, inputs.splits)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the first run compiles the kernels, which a capture must not see
            self.runner.decode(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.runner.decode(static)
        self._pool = graph.pool()
        return graph, static, logits
