"""A built engine folder: checkpoint, tokenizer, KV scales and manifest, ready to run.

Layout::

    engines/NAME/
      manifest.json          what was built, from what, with which tools
      checkpoint/            TensorRT-LLM checkpoint + tokenizer files
      kv_scales.json         static INT8 KV scales (K, V, shared) of this model
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.checkpoint import CheckpointError, ModelConfig, load_checkpoint
from runtime.kv_cache import KV_MODES, STATIC_INT8_MODES, KVScales, PagedKVCache
from runtime.kv_scales import load_scales, model_fingerprint
from runtime.model import Transformer
from runtime.tokenizer import ChatTokenizer

MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = "checkpoint"
SCALES_FILE = "kv_scales.json"
DEFAULT_TOKENS_PER_BLOCK = 32


@dataclass
class Engine:
    """A loaded reference engine."""

    folder: Path
    config: ModelConfig
    model: Transformer
    tokenizer: ChatTokenizer
    manifest: dict
    fingerprint: str
    scales: KVScales | None

    @classmethod
    def load(cls, folder: str | Path) -> "Engine":
        """Load an engine folder written by cabin-build."""
        folder = Path(folder)
        manifest_path = folder / MANIFEST_FILE
        if not manifest_path.is_file():
            raise CheckpointError(f"{manifest_path}: not found; build an engine first with cabin-build")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        config, weights = load_checkpoint(folder / CHECKPOINT_DIR)
        fingerprint = model_fingerprint(config, weights)
        scales_path = folder / SCALES_FILE
        scales = load_scales(scales_path, fingerprint, config.num_hidden_layers) if scales_path.exists() else None
        tokenizer = ChatTokenizer(folder / CHECKPOINT_DIR)
        return cls(folder, config, Transformer(config, weights), tokenizer, manifest, fingerprint, scales)

    @property
    def default_kv_mode(self) -> str:
        """The KV mode the engine was built for (fp16 where the reference engine has no such storage, e.g. fp8)."""
        mode = self.manifest.get("kv_cache", "fp16")
        return mode if mode in KV_MODES else "fp16"

    def stop_token_ids(self) -> list[int]:
        """Every id that ends an assistant turn."""
        return self.tokenizer.stop_token_ids

    def new_cache(self, mode: str | None = None, max_bytes: int = 64 << 20,
                  tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK) -> PagedKVCache:
        """A fresh paged KV cache for this engine within a byte budget."""
        mode = mode or self.default_kv_mode
        if mode in STATIC_INT8_MODES and self.scales is None:
            raise CheckpointError(f"{self.folder}: KV mode {mode} needs {SCALES_FILE}; rebuild with cabin-build")
        return PagedKVCache(self.model.kv_layout, mode, max_bytes, tokens_per_block, self.scales)
