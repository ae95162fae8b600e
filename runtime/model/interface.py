"""What the engine core asks of a model runner: a batch of spans over the paged cache in, logits out.

A ``Span`` is the new tokens of one sequence at their positions; the sequence's block table says where its K/V
live, and its ``media`` spans say which positions are a picture's (audio next) placeholder tokens, whose input rows
come from ``media`` (``MediaRows`` by digest). The reference runner (``cabinllm.runtime.model.transformer``, C
kernels on the CPU) and the ONNX Runtime runner (``cabinllm.runtime.backends.onnxruntime``) implement
``ModelRunner``; nothing above them knows which one runs.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.kv.blocks import MediaSpan, Sequence
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.kv.storage import KVLayout


@dataclass
class Span:
    """New tokens of one sequence in a step: ``token_ids`` at positions [start_pos, start_pos + N)."""

    token_ids: list[int]
    start_pos: int
    seq: Sequence

    @property
    def end(self) -> int:
        """Tokens attended to by the span's last new token, itself included."""
        return self.start_pos + len(self.token_ids)


@dataclass
class MediaRows:
    """A picture's (or a clip's) input rows for the decoder: ``rows`` (n, hidden) at ``offsets`` (n,) within its
    span (the placeholder tokens; a tiled picture's span holds text tokens between its tiles)."""

    rows: torch.Tensor
    offsets: torch.Tensor


MediaTable = Mapping[bytes, MediaRows]  # media rows by digest (a lazy mapping may encode them on first read)


@dataclass
class MediaFeed:
    """The pictures among a feed of tokens: where they are (positions from the feed's first token) and their input
    rows by digest."""

    spans: list[MediaSpan]
    rows: MediaTable


class ModelRunner(Protocol):
    """A model over the paged KV cache: tokens of one or more sequences in, logits out."""

    config: ModelConfig  # its max_position_embeddings is the context the core plans against
    batched: bool  # whether one ``step`` runs several sequences' spans (else the core runs one per step)

    @property
    def kv_layout(self) -> KVLayout:
        """Shape of this model's KV cache."""

    def step(self, spans: list[Span], cache: PagedKVCache, all_logits: bool = False,
             media: MediaTable | None = None) -> torch.Tensor:
        """Run each span's tokens (slots allocated), writing their K/V; logits of each span's last token
        (spans, vocab), or of every token (tokens, vocab)."""

    def forward(self, token_ids: list[int], start_pos: int, cache: PagedKVCache, seq: Sequence,
                all_logits: bool = False, media: MediaTable | None = None) -> torch.Tensor:
        """``step`` of one span: logits of its last token (vocab,) or of every token (N, vocab)."""
