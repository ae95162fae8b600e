"""What pictures and clips share: their encoder as transformers defines it, on a copy of the model whose text part
is a one-layer stub (``encoder_model``), their encoded rows kept by digest in an LRU of a byte budget
(``FeatureCache``) and a conversation's rows by digest, encoded on first read (``EncodedRows``)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Protocol

import torch

from cabinllm.runtime.errors import CabinError, CheckpointError
from cabinllm.runtime.model.interface import MediaRows


class FeatureCache:
    """Encoded rows by media digest, least recently used dropped first beyond ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._rows: OrderedDict[bytes, MediaRows] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def bytes_used(self) -> int:
        """Bytes of the rows held."""
        return sum(r.rows.numel() * r.rows.element_size() for r in self._rows.values())

    def get(self, digest: bytes) -> MediaRows | None:
        """The rows of a picture or clip, or None (counted as a hit or a miss)."""
        rows = self._rows.get(digest)
        if rows is None:
            self.misses += 1
            return None
        self.hits += 1
        self._rows.move_to_end(digest)
        return rows

    def put(self, digest: bytes, rows: MediaRows) -> None:
        """Keep a picture's or clip's rows, dropping the oldest beyond the budget (rows larger than it are not kept)."""
        self._rows[digest] = rows
        while self._rows and self.bytes_used > self.max_bytes:
            self._rows.popitem(last=False)

    def rows(self, digest: bytes, offsets: torch.Tensor, inputs: dict[str, torch.Tensor],
             encode: Callable[[dict[str, torch.Tensor]], torch.Tensor], kind: str, gone: CabinError) -> MediaRows:
        """A prepared picture's or clip's rows: the kept ones, else ``encode(inputs)`` (then kept); ``gone`` where they
        are needed again and its inputs are not held (a restored session's), CheckpointError where the ``kind``
        ("vision", "audio") encoder's rows do not match the placeholder tokens at ``offsets``."""
        rows = self.get(digest)
        if rows is None and not inputs:
            raise gone
        if rows is None:
            rows = MediaRows(encode(inputs).float(), offsets)
            if len(rows.rows) != len(offsets):
                raise CheckpointError(f"the {kind} encoder gave {len(rows.rows)} rows for {len(offsets)} placeholder "
                                      f"tokens; the {kind} folder and processor do not match: rebuild the engine")
            self.put(digest, rows)
        return rows


def open_encoder_folder(folder: Path, families: Mapping[str, object], kind: str,
                        processor: Callable[[Path], object]) -> tuple[object, object, object]:
    """An encoder folder's HF config, its ``processor(folder)`` and its family among ``families`` (by model_type);
    CheckpointError naming the folder and the fix where one is unreadable or the ``kind`` ("vision", "audio") family
    is not supported."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        loaded = processor(folder)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}: unreadable {kind} config or processor ({err}); rebuild the engine") from err
    if config.model_type not in families:
        raise CheckpointError(f"{folder}: {kind} family {config.model_type!r} is not supported; supported: "
                              f"{', '.join(families)}")
    return config, loaded, families[config.model_type]


def media_message(message: dict, kind: str, digests: list[bytes]) -> dict:
    """The message with its media before its text, as ``{"type": kind, "digest": hex}`` parts."""
    return {**message, "content": [{"type": kind, "digest": digest.hex()} for digest in digests]
            + [{"type": "text", "text": message.get("content") or ""}]}


class Encoder(Protocol):
    """What encodes a conversation's media into input rows (``Vision``, ``AudioEncoder``)."""

    def encode(self, item) -> MediaRows:
        """The decoder's input rows of one prepared picture or clip."""


class EncodedRows(Mapping):
    """The input rows of a conversation's pictures or clips by digest, each encoded when first read (its encoder's
    ``encode``)."""

    def __init__(self, encoder: Encoder, items: dict[str, object]) -> None:
        self.encoder, self.items = encoder, items

    def __getitem__(self, digest: bytes) -> MediaRows:
        item = self.items.get(digest.hex())
        if item is None:
            raise KeyError(digest)
        return self.encoder.encode(item)

    def __iter__(self):
        return (bytes.fromhex(d) for d in self.items)

    def __len__(self) -> int:
        return len(self.items)


def encoder_model(config, weights: Path, prefixes: tuple[str, ...],
                  build: Callable[[object], torch.nn.Module]) -> torch.nn.Module:
    """The family's transformers model (``build`` of the config: the inner model, whose tensor names the engine's
    encoder file keeps) with a one-layer stub for its text part and the encoder's tensors (``prefixes``) loaded."""
    from safetensors.torch import load_file

    text = config.get_text_config()
    stub = dict(num_hidden_layers=1, vocab_size=max(config_token_ids(config)) + 1, intermediate_size=8)
    for key, value in stub.items():
        setattr(text, key, value)
    if hasattr(text, "layer_types"):
        text.layer_types = text.layer_types[:1]
    if not weights.is_file():
        raise CheckpointError(f"{weights}: not found; rebuild the engine from the model's HF folder")
    model = build(config).eval()
    missing, _ = model.load_state_dict(load_file(str(weights)), strict=False)
    absent = [name for name in missing if name.startswith(prefixes)]
    if absent:
        raise CheckpointError(f"{weights}: {len(absent)} encoder tensors are missing (first: {absent[0]}); rebuild "
                              "the engine")
    return model


def config_token_ids(config) -> list[int]:
    """The special token ids a vision- or audio-language config names (the stub's vocabulary must hold them)."""
    keys = ("image_token_id", "image_token_index", "vision_start_token_id", "vision_end_token_id", "video_token_id",
            "audio_token_index")
    return [getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)] or [0]
