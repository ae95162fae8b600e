"""A loaded engine: a built engine folder (cabinllm.runtime.formats.engine_folder) on the reference engine or the CUDA
runner (weights, tokenizer, KV scales), or any backend's model (``ModelRunner``) with its tokenizer and the cache
defaults."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch

from cabinllm.runtime.engine.core import EngineCore
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.errors import CheckpointError, Fix, Hint
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE, SCALES_FILE, EngineFolder
from cabinllm.runtime.formats.onnx_folder import ONNX_FORMAT
from cabinllm.runtime.formats.scales_file import KVScales, load_scales
from cabinllm.runtime.model.interface import ModelRunner
from cabinllm.runtime.generation.grammar import Vocabulary
from cabinllm.runtime.kv.cache import DEFAULT_TOKENS_PER_BLOCK, KvCacheConfig, PagedKVCache
from cabinllm.runtime.kv.modes import KV_MODES, kv_mode_name
from cabinllm.runtime.model.cuda import CudaRunner, check_device, check_kv_mode
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.model.audio import AUDIO_FOLDER, AudioEncoder
from cabinllm.runtime.model.vision import VISION_FOLDER, Vision


def built_kv_mode(manifest: dict) -> str:
    """The KV mode an engine was built for (fp16 for a manifest that does not say)."""
    return kv_mode_name(manifest.get("kv_cache", "fp16"))


def kv_cache_config(manifest: dict, config: KvCacheConfig = KvCacheConfig()) -> KvCacheConfig:
    """``config`` with what it leaves to the engine filled in: the KV mode the engine was built for and the block
    size of the target it was planned for."""
    tpb = config.tokens_per_block or int(manifest.get("plan", {}).get("tokens_per_block", DEFAULT_TOKENS_PER_BLOCK))
    return replace(config, kv_mode=config.kv_mode or built_kv_mode(manifest), tokens_per_block=tpb)


@dataclass
class Engine:
    """A loaded engine: its model (the reference ``Transformer`` from ``load``, or another backend's), tokenizer and
    manifest."""

    folder: Path
    config: ModelConfig
    model: ModelRunner
    tokenizer: ChatTokenizer
    manifest: dict
    fingerprint: str
    scales: KVScales | None
    device: torch.device = torch.device("cpu")  # where the model and its KV pools live

    @classmethod
    def load(cls, folder: str | Path, device: str = "cpu") -> "Engine":
        """Load an engine folder written by cabin-build (its checkpoint checked against its manifest): on the
        reference engine (``device`` cpu), or on the CUDA runner in fp16 (``device`` cuda or cuda:N; refused where
        torch has no CUDA)."""
        where = check_device(device)
        folder = EngineFolder(Path(folder))
        manifest = folder.manifest()
        if manifest.get("format") == ONNX_FORMAT:
            raise CheckpointError(f"{folder.path}: an ONNX graph folder ({ONNX_FORMAT} in {MANIFEST_FILE}), which the "
                                  "reference engine does not load; give the engine folder it was exported from",
                                  (Hint(Fix.BACKEND, "onnxruntime"),))
        config, weights, fingerprint = folder.load_checkpoint()
        scales = load_scales(folder.scales, fingerprint, config.num_hidden_layers) if folder.scales.exists() else None
        tokenizer = ChatTokenizer(folder.checkpoint)
        model = Transformer(config, weights)
        if where.type == "cuda":
            model = CudaRunner.of(model, device)
        return cls(folder.path, config, model, tokenizer, manifest, fingerprint, scales, where)

    @property
    def default_kv_mode(self) -> str:
        """The KV mode the engine was built for (fp16 where the reference engine has no such storage, e.g. fp8)."""
        mode = KV_MODES.get(built_kv_mode(self.manifest))
        return mode.name if mode is not None and mode.reference else "fp16"

    @cached_property
    def vision(self) -> Vision | None:
        """The engine's vision part (a vision-language engine's ``vision/`` folder, loaded on first use), or None."""
        folder = self.folder / VISION_FOLDER
        return Vision(folder) if folder.is_dir() else None

    @cached_property
    def audio(self) -> AudioEncoder | None:
        """The engine's audio part (an audio-language engine's ``audio/`` folder, loaded on first use), or None."""
        folder = self.folder / AUDIO_FOLDER
        return AudioEncoder(folder) if folder.is_dir() else None

    @cached_property
    def vocabulary(self) -> Vocabulary:
        """The model's tokens for constrained decoding (built on first use)."""
        return Vocabulary(self.tokenizer.to_json(), self.config.vocab_size, self.stop_token_ids())

    def stop_token_ids(self) -> list[int]:
        """Every id that ends an assistant turn."""
        return self.tokenizer.stop_token_ids

    def kv_cache_config(self, config: KvCacheConfig = KvCacheConfig()) -> KvCacheConfig:
        """``config`` with this engine's defaults where it leaves them unset (``kv_cache_config``; a mode only the
        reference engine lacks, e.g. fp8, falls back to fp16)."""
        return kv_cache_config(self.manifest, replace(config, kv_mode=config.kv_mode or self.default_kv_mode))

    def new_cache(self, config: KvCacheConfig = KvCacheConfig(), max_sequences: int = 1) -> PagedKVCache:
        """A fresh paged KV cache for this engine (what ``config`` leaves unset: the engine's, ``kv_cache_config``);
        ``max_sequences``: the live sequences whose windows a model with sliding-window layers holds at once."""
        config = self.kv_cache_config(config)
        if self.device.type != "cpu":
            check_kv_mode(config.kv_mode, self.device)
        if config.mode.static_scales and self.scales is None:
            raise CheckpointError(f"{self.folder}: KV mode {config.kv_mode} needs {SCALES_FILE}; rebuild with "
                                  "cabin-build")
        return PagedKVCache(self.model.kv_layout, config, self.scales, max_sequences=max_sequences,
                            device=self.device)

    def new_core(self, cache: PagedKVCache | None = None, config: SchedulerConfig | None = None) -> EngineCore:
        """An engine core running this engine's model over ``cache`` (default: ``new_cache()``); on the CUDA runner
        its decode graphs cover the core's sessions."""
        if isinstance(self.model, CudaRunner) and config is not None:
            self.model.size_graphs(config.max_sessions)
        return EngineCore(self.model, cache or self.new_cache(), self.tokenizer.decode_reply, config)
