"""The model over a list of tokens on a fresh cache, every layer's K/V kept: what calibration and evaluation read
(``run_tokens``)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import PagedKVCache, sized_config
from cabinllm.runtime.model.interface import MediaFeed, ModelRunner


@dataclass
class Prefilled:
    """A cache holding one sequence's K/V after the model ran over its tokens, and the logits it gave."""

    cache: PagedKVCache
    seq: Sequence
    logits: torch.Tensor

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K (post-RoPE) and V of every token in one layer, shape (tokens, kv_heads, head_size)."""
        return self.cache.read(layer, self.seq)


def run_tokens(model: ModelRunner, token_ids: list[int], kv_mode: str = "fp32", scales: KVScales | None = None,
               all_logits: bool = False, cache: PagedKVCache | None = None, chunk: int | None = None,
               media: MediaFeed | None = None, device: torch.device | str = "cpu") -> Prefilled:
    """Run the model over token_ids (``media``: the pictures among them) on a fresh cache sized to them (or on
    ``cache``, empty) and hand back its K/V.

    A fresh cache keeps every layer's K/V of every token, sliding-window layers' too (their attention still sees
    their window only), so that calibration reads them all. They go through the model at once, or in pieces of
    ``chunk`` tokens. Modes that keep a window of recent tokens at higher precision are prefilled block by block at
    most, so every position sees the window as it would while decoding. ``device``: where a fresh cache's pools
    live (the model's: a GPU for the CUDA runner).
    """
    if cache is None:
        layout = replace(model.kv_layout, windows=())
        cache = PagedKVCache(layout, sized_config(layout, kv_mode, len(token_ids)), scales, device=device)
    seq = Sequence()
    chunk = min(chunk or len(token_ids), cache.tokens_per_block if cache.mode.recent_window else len(token_ids))
    logits = []
    for start in range(0, len(token_ids), chunk):
        piece = token_ids[start:start + chunk]
        spans = [span for span in media.spans if start <= span.start < start + chunk] if media else []
        if start == 0:
            cache.allocate(seq, piece, spans)
        else:
            cache.append(seq, piece, spans)
        logits.append(model.forward(piece, start, cache, seq, all_logits=all_logits,
                                    media=media.rows if media else None))
    return Prefilled(cache, seq, torch.cat(logits) if all_logits else logits[-1])
