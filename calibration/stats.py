"""Per-layer K/V range statistics collected by running the model over dialogues.

K is measured as the cache stores it (after RoPE). For K and for V, each layer
keeps per channel the abs-max and a histogram of |x| on fixed log-spaced bins
(per head and per layer follow by summing), good for percentiles and clipping
error. Memory is fixed by the model's shape, whatever the amount of data. Where the dialogues show pictures, each
layer's K and V are also kept apart at text and at image positions (a position whose input is an encoder row).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from cabinllm.calibration.selection import TokenizedDialogue
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.model.transformer import Transformer

HIST_BINS = 1024  # 1.8 % wide each
HIST_LOW, HIST_HIGH = 1e-4, 1e4  # |x| below HIST_LOW counts in bin 0, above HIST_HIGH in the last bin
_LOG_LOW, _LOG_HIGH = math.log(HIST_LOW), math.log(HIST_HIGH)
_BIN_WIDTH = (_LOG_HIGH - _LOG_LOW) / HIST_BINS


def bin_edges() -> torch.Tensor:
    """The HIST_BINS + 1 edges of the |x| histogram (float64); bin 0 starts at 0."""
    edges = torch.logspace(_LOG_LOW, _LOG_HIGH, HIST_BINS + 1, base=torch.e, dtype=torch.float64)
    edges[0] = 0.0
    return edges


@dataclass
class RangeStats:
    """Ranges of K (or V) of every layer per channel: abs-max (layers, kv_heads, head_size) and |x| histogram
    (layers, kv_heads, head_size, HIST_BINS)."""

    channel_amax: torch.Tensor
    channel_hist: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, num_kv_heads: int, head_size: int) -> "RangeStats":
        """Statistics of no data."""
        return cls(torch.zeros(num_layers, num_kv_heads, head_size),
                   torch.zeros(num_layers, num_kv_heads, head_size, HIST_BINS, dtype=torch.float64))

    @property
    def layer_hist(self) -> torch.Tensor:
        """|x| histogram per layer, shape (layers, HIST_BINS)."""
        return self.channel_hist.sum(dim=(1, 2))

    @property
    def layer_amax(self) -> torch.Tensor:
        """Abs-max per layer, shape (layers,)."""
        return self.channel_amax.amax(dim=(1, 2))

    @property
    def head_amax(self) -> torch.Tensor:
        """Abs-max per layer and KV head, shape (layers, kv_heads)."""
        return self.channel_amax.amax(dim=2)

    def update(self, layer: int, x: torch.Tensor) -> None:
        """Add values of shape (tokens, kv_heads, head_size) to one layer."""
        magnitude = x.abs()
        self.channel_amax[layer] = torch.maximum(self.channel_amax[layer], magnitude.amax(dim=0))
        bins = ((magnitude.clamp(HIST_LOW, HIST_HIGH).log() - _LOG_LOW) / _BIN_WIDTH).long().clamp(0, HIST_BINS - 1)
        channels = x.shape[1] * x.shape[2]
        index = (torch.arange(channels).view(x.shape[1:]) * HIST_BINS + bins).flatten()
        counts = torch.bincount(index, minlength=channels * HIST_BINS)
        self.channel_hist[layer] += counts.view(*x.shape[1:], HIST_BINS).double()


# a position's input: a token's embedding, a picture's encoder row, or a clip's (TokenizedDialogue.kinds indexes these)
POSITION_KINDS = ("text", "image", "audio")


@dataclass
class KVStats:
    """K and V statistics of a model over some data; where the data shows pictures or holds clips, also per layer at
    text and at image (audio) positions (``by_kind``: kind -> (K, V), each of one channel: a layer's values
    pooled)."""

    k: RangeStats
    v: RangeStats
    dialogues: int = 0
    tokens: int = 0
    by_kind: dict[str, tuple[RangeStats, RangeStats]] = field(default_factory=dict)


def collect_stats(model: Transformer, dialogues: list[TokenizedDialogue], progress: bool = True) -> KVStats:
    """Run the model in full precision over each dialogue and gather K/V statistics of every layer."""
    layout = model.kv_layout
    stats = KVStats(RangeStats.empty(layout.num_layers, layout.num_kv_heads, layout.head_size),
                    RangeStats.empty(layout.num_layers, layout.num_kv_heads, layout.head_size))
    seen = {int(i) for d in dialogues for i in d.kinds().unique()}
    if seen - {0}:
        stats.by_kind = {kind: (RangeStats.empty(layout.num_layers, 1, 1), RangeStats.empty(layout.num_layers, 1, 1))
                         for i, kind in enumerate(POSITION_KINDS) if i in seen | {0}}
    total = sum(len(d.token_ids) for d in dialogues)
    with tqdm(total=total, unit="tok", desc="collecting K/V stats", file=sys.stderr, disable=not progress) as bar:
        for dialogue in dialogues:
            ids = dialogue.token_ids
            run = run_tokens(model, ids, media=dialogue.media)
            kinds = dialogue.kinds()
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # short element-wise passes: a busy machine's thread pool costs 5x more
            try:
                for layer in range(layout.num_layers):
                    k, v = run.kv(layer)
                    stats.k.update(layer, k)
                    stats.v.update(layer, v)
                    for kind, (kind_k, kind_v) in stats.by_kind.items():
                        rows = kinds == POSITION_KINDS.index(kind)
                        if rows.any():
                            kind_k.update(layer, k[rows].reshape(-1, 1, 1))
                            kind_v.update(layer, v[rows].reshape(-1, 1, 1))
            finally:
                torch.set_num_threads(threads)
            stats.dialogues += 1
            stats.tokens += len(ids)
            bar.update(len(ids))
    return stats
