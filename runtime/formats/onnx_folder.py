"""The ONNX graph folder cabin-export writes and the ONNX Runtime backend reads: layout, graph inputs and
outputs, manifest.

Layout::

    NAME/
      manifest.json        context, chunk, KV mode and its graph type (element type, zero point, scales),
                           opset, profile, the ops used, the weight format and how the linear layers
                           carry it, the model (config, fingerprint), the engine's default system prompt
      prompt.onnx          ``chunk`` new tokens over a window of ``context`` past tokens
      token.onnx           1 new token over the same window
      weights.bin          the weights both graphs read (ONNX external data)
      tokenizer/           tokenizer.json and tokenizer_config.json
      host/                npu profile: the tables the host looks up (embedding.npy, rope_cos.npy, ...)
      *_ctx.onnx, *.bin    npu profile with an htp_arch: the graphs compiled by QNN for the HTP (an EPContext
                           model of each and the one context binary both name, the weights stored once)

Both graphs have static shapes (batch 1). Their inputs in the ort profile::

    input_ids       int64   [1, T]                 T = chunk (prompt) or 1 (token)
    position_ids    int64   [1, T]

and in the npu profile, which gathers nothing by an input (the host looks rows up in ``host/``)::

    inputs_embeds   float32 [1, T, hidden]         embedding rows (times the family's embedding multiplier)
    rope_cos        float32 [1, T, 1, rotated]     RoPE rows of the new tokens' positions
    rope_sin        float32 [1, T, 1, rotated]
    rope_local_cos, rope_local_sin, local_attention_mask   only with sliding-window layers (Gemma 3):
                                                   their own RoPE rows and mask

then in both::

    attention_mask  float32 [1, 1, T, context + T] 0 where a new token may attend, the manifest's
                                                   attention_mask_value elsewhere: the window's slots
                                                   first, then the T new tokens
    past_key.L      KV      [1, kv_heads, head_size, context]   one pair per layer, K after RoPE
    past_value.L    KV      [1, kv_heads, context, head_size]
    ->
    logits          float32 [1, T, vocab]
    new_key.L       KV      [1, T, kv_heads, head_size]         the new tokens' K/V only
    new_value.L     KV      [1, T, kv_heads, head_size]

The window comes in the layouts attention multiplies by (K transposed: q @ K, then probs @ V), so no
graph copies or transposes it; the new rows go out token-major, as the paged cache stores them. Each
graph's metadata records the model fingerprint, context, chunk and KV mode it was built for; loading
checks them against the manifest. A folder is written whole (cabinllm.runtime.formats.atomic).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cabinllm.runtime.errors import CheckpointError, Fix, Hint
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE, read_manifest
from cabinllm.runtime.formats.scales_file import KVScales

ONNX_FORMAT = "cabin-onnx/2"  # 2: the npu profile's host inputs, the mask value, the precision
PROMPT_GRAPH = "prompt.onnx"
TOKEN_GRAPH = "token.onnx"
WEIGHTS_FILE = "weights.bin"
TOKENIZER_DIR = "tokenizer"
MASKED = -30000.0  # additive mask of a slot a token may not attend to: finite, and in fp16 range for NPUs
# the mask of quantized graphs: a uint16 activation spans the scores and the mask, so a smaller finite value keeps
# the scores' resolution (0.0025 over [-130, 30]); exp(-100) is 4e-44 of a visible key's weight
QUANTIZED_MASKED = -100.0
HOST_DIR = "host"
INPUTS_EMBEDS = "inputs_embeds"
ROPE_INPUTS = ("rope_cos", "rope_sin")
LOCAL_ROPE_INPUTS = ("rope_local_cos", "rope_local_sin")
LOCAL_MASK = "local_attention_mask"
# the host tables of the stored prefix: its K/V (layers, tokens, kv_heads, head_size) and logits (tokens, vocab)
PREFIX_TABLES = ("prefix_keys", "prefix_values", "prefix_logits")
EXPORT_AGAIN = "export it again with cabin-export"
# metadata every graph carries -> the manifest value it must equal
GRAPH_METADATA = ("model_fingerprint", "context", "chunk", "kv_cache")


def past_key(layer: int) -> str:
    """Input name of a layer's past K."""
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    """Input name of a layer's past V."""
    return f"past_value.{layer}"


def new_key(layer: int) -> str:
    """Output name of a layer's new K."""
    return f"new_key.{layer}"


def new_value(layer: int) -> str:
    """Output name of a layer's new V."""
    return f"new_value.{layer}"


@dataclass(frozen=True)
class KvGraphType:
    """How the graphs pass K/V in and out: element type, and for 8-bit codes the zero point and per-layer scales
    (the cache's int8 code q travels as q + zero_point)."""

    dtype: str  # numpy name: float32, float16, int8, uint8
    zero_point: int | None = None
    scales: list[float] | None = None

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"dtype": self.dtype, "zero_point": self.zero_point, "scales": self.scales}


def graph_metadata(manifest: dict) -> dict[str, str]:
    """The metadata a graph of this folder carries (strings, as ONNX stores them)."""
    values = {"model_fingerprint": manifest["model"]["fingerprint"], "context": manifest["context"],
              "chunk": manifest["chunk"], "kv_cache": manifest["kv_cache"]}
    return {f"cabin.{key}": str(values[key]) for key in GRAPH_METADATA}


@dataclass(frozen=True)
class StoredPrefix:
    """The tokens every conversation starts with, run once at export by the reference engine in float32 over the
    graphs' KV mode: their K/V (layers, tokens, kv_heads, head_size) as the cache gives them back, and logits (tokens,
    vocab). The graphs never run them, so no calibrated
    range holds the first token's massive activation (24,867 in the default model's residual stream, 200 times any
    later token's), as in PrefixQuant (Chen et al., 2024), which prefixes such tokens' K/V offline."""

    tokens: list[int]
    keys: np.ndarray
    values: np.ndarray
    logits: np.ndarray

    def covers(self, token_ids: list[int], start: int) -> int:
        """How many of tokens at ``start`` are the prefix's own (0 unless they begin a conversation with it)."""
        n = len(self.tokens)
        return min(n, len(token_ids)) if start == 0 and token_ids[:n] == self.tokens[:len(token_ids)] else 0


@dataclass(frozen=True)
class OnnxFolder:
    """An exported graph folder on disk."""

    path: Path

    @property
    def tokenizer(self) -> Path:
        """The tokenizer files."""
        return self.path / TOKENIZER_DIR

    def host_table(self, name: str) -> np.ndarray:
        """A table the host looks up (npu profile), memory-mapped; CheckpointError when it is missing."""
        path = self.path / HOST_DIR / f"{name}.npy"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing; {EXPORT_AGAIN}")
        return np.load(path, mmap_mode="r")

    def prefix(self, manifest: dict) -> StoredPrefix | None:
        """The stored prefix the export wrote (quantized graphs), or None."""
        tokens = manifest.get("prefix")
        if tokens is None:
            return None
        return StoredPrefix(list(tokens), *(np.array(self.host_table(name)) for name in PREFIX_TABLES))

    def manifest(self) -> dict:
        """The manifest, checked for the keys the runtime reads; CheckpointError naming what is wrong."""
        manifest = read_manifest(self.path)
        if manifest is None or manifest.get("format") != ONNX_FORMAT:
            raise CheckpointError(f"{self.path}: no {MANIFEST_FILE} of an ONNX export ({ONNX_FORMAT})",
                                  (Hint(Fix.EXPORT_ONNX),))
        try:
            context, chunk = int(manifest["context"]), int(manifest["chunk"])
            float(manifest["attention_mask_value"]), bool(manifest["host_inputs"]), str(manifest["precision"])
            self.config(manifest)
            self.kv_graph(manifest)
            if not isinstance(manifest["model"]["fingerprint"], str):
                raise ValueError("the model fingerprint is not a string")
            graphs = [self.path / manifest["graphs"][name] for name in ("prompt", "token")]
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{self.path / MANIFEST_FILE}: incomplete or malformed ({err!r}); "
                                  f"{EXPORT_AGAIN}") from err
        if not 1 <= chunk <= context:
            raise CheckpointError(f"{self.path / MANIFEST_FILE}: chunk {chunk} and context {context} need "
                                  f"1 <= chunk <= context; {EXPORT_AGAIN}")
        for graph in graphs + [self.path / WEIGHTS_FILE]:
            if not graph.is_file():
                raise CheckpointError(f"{graph}: missing; {EXPORT_AGAIN}")
        return manifest

    def config(self, manifest: dict) -> ModelConfig:
        """The model's config as the manifest records it."""
        return ModelConfig.from_dict(manifest["model"]["config"], str(self.path / MANIFEST_FILE))

    def kv_graph(self, manifest: dict) -> KvGraphType:
        """How the graphs pass K/V."""
        return KvGraphType(**manifest["kv_graph"])

    def scales(self, manifest: dict) -> KVScales | None:
        """The static INT8 scales the graphs quantize with (one per layer for K and V), or None."""
        scales = self.kv_graph(manifest).scales
        return KVScales(list(scales), list(scales)) if scales is not None else None

    def check_graph(self, name: str, metadata: dict[str, str], manifest: dict) -> None:
        """CheckpointError when a graph's metadata says it was built for another model, window or KV mode."""
        expected = graph_metadata(manifest)
        for key, value in expected.items():
            if metadata.get(key) != value:
                raise CheckpointError(f"{self.path / name}: built for {key.removeprefix('cabin.')} "
                                      f"{json.dumps(metadata.get(key))} but {MANIFEST_FILE} says {json.dumps(value)}; "
                                      f"the graph comes from another export, {EXPORT_AGAIN}")
