"""Open a llama.cpp GGUF file for import: config from metadata, dequantized weights, and the Q4_0 / Q4_1 / Q8_0
blocks of its tensors as stored (for int4-g32 weights and the int8 head).

Block layouts (ggml-common.h ``block_q4_0``, ``block_q4_1``, ``block_q8_0``; 32 weights each): Q4_1 is fp16 d, fp16
m, 16 bytes of nibbles, weight j in the low nibble of byte j and weight j + 16 in the high one, w = d * q + m; Q4_0
the same without m, w = d * (q - 8); Q8_0 fp16 d and 32 int8, w = d * q.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import SOURCE_FIX, ModelConfig, default_head_size
from cabinllm.runtime.model.families import FAMILIES, family
from cabinllm.runtime.model.families.family import SourceNames
from cabinllm.runtime.sources.weight_plan import SourceModel, check_plan, weight_plan

# llama.cpp's general.architecture -> ours, from each family's gguf_architecture (Mistral GGUFs say "llama")
GGUF_ARCHITECTURES = {f.gguf_architecture: f.architecture for f in FAMILIES.values() if f.gguf_architecture}
SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"))
GGUF_NAMES = SourceNames(
    embedding="token_embd.weight",
    final_norm="output_norm.weight",
    lm_head="output.weight",
    input_norm="blk.{l}.attn_norm.weight",
    post_norm="blk.{l}.ffn_norm.weight",
    q="blk.{l}.attn_q.weight",
    k="blk.{l}.attn_k.weight",
    v="blk.{l}.attn_v.weight",
    dense="blk.{l}.attn_output.weight",
    mlp_gate="blk.{l}.ffn_gate.weight",
    mlp_up="blk.{l}.ffn_up.weight",
    mlp_down="blk.{l}.ffn_down.weight",
)
_REQUIRED = object()
BLOCK = 32  # weights per Q4_0 / Q4_1 / Q8_0 block
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


@dataclass
class Blocks:
    """A tensor's GGUF blocks as arrays over (rows, ...): 4-bit codes (rows, cols / 2) in the block's nibble order
    with fp16 ``scale`` and ``minimum`` (rows, cols / 32), or int8 codes (rows, cols) with ``minimum`` None (Q8_0)."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None

    @property
    def bits(self) -> int:
        """4 or 8."""
        return 8 if self.minimum is None else 4

    def rows(self, order: np.ndarray | slice) -> "Blocks":
        """These rows only, in this order."""
        return Blocks(self.codes[order], self.scale[order], None if self.minimum is None else self.minimum[order])


def parse_blocks(data: np.ndarray, kind: GGMLQuantizationType) -> Blocks | None:
    """The blocks of a tensor's raw bytes (rows, bytes per row); None for a type other than Q4_0, Q4_1 and Q8_0."""
    size = _BLOCK_BYTES.get(kind)
    if size is None:
        return None
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(data.shape[0], -1, size)
    rows, groups = raw.shape[:2]
    scale = raw[..., 0:2].copy().view(np.float16).reshape(rows, groups)
    if kind == GGMLQuantizationType.Q8_0:
        return Blocks(raw[..., 2:].copy().view(np.int8).reshape(rows, groups * BLOCK), scale, None)
    if kind == GGMLQuantizationType.Q4_0:  # d * (q - 8) = d * q + (-8 d), exact in fp16 and in the fp32 sum
        return Blocks(raw[..., 2:].reshape(rows, groups * BLOCK // 2).copy(), scale, scale * np.float16(-8))
    minimum = raw[..., 2:4].copy().view(np.float16).reshape(rows, groups)
    return Blocks(raw[..., 4:].reshape(rows, groups * BLOCK // 2).copy(), scale, minimum)


def read_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file (memory-mapped, parsed once per process while the file is unchanged);
    CheckpointError naming it when it is not GGUF or is truncated."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; pass a .gguf file or an HF model folder")
    stat = path.stat()
    return _parse(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=2)
def _parse(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError) as err:
        raise CheckpointError(
            f"{path}: not a readable GGUF file ({err}); if it is one, it may be truncated: download it again"
        ) from err


def _meta(reader: GGUFReader, key: str, path: Path, default: object = _REQUIRED):
    """One metadata value, or ``default``; CheckpointError naming the key when it is required and absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{path}: metadata key {key} is missing; the GGUF file is incomplete")
        return default
    return field.contents()


def config_from_gguf(reader: GGUFReader, path: Path) -> ModelConfig:
    """A ModelConfig from GGUF metadata; tied embeddings when the file has no ``output.weight``."""
    arch = _meta(reader, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    scaling = _meta(reader, f"{arch}.rope.scaling.type", path, "none")
    if "rope_freqs.weight" in tensor_names or scaling != "none":
        raise CheckpointError(
            f"{path}: RoPE scaling in GGUF files is not supported; import the model's HF folder instead"
        )
    hidden = _meta(reader, f"{arch}.embedding_length", path)
    heads = _meta(reader, f"{arch}.attention.head_count", path)
    config = ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=len(_meta(reader, "tokenizer.ggml.tokens", path)),
        hidden_size=hidden,
        num_hidden_layers=_meta(reader, f"{arch}.block_count", path),
        num_attention_heads=heads,
        num_key_value_heads=_meta(reader, f"{arch}.attention.head_count_kv", path, heads),
        head_size=_meta(reader, f"{arch}.attention.key_length", path, default_head_size(hidden, heads)),
        intermediate_size=_meta(reader, f"{arch}.feed_forward_length", path),
        max_position_embeddings=_meta(reader, f"{arch}.context_length", path),
        rotary_base=float(_meta(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        norm_epsilon=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        qkv_bias=family(GGUF_ARCHITECTURES[arch]).qkv_bias,
        tie_word_embeddings="output.weight" not in tensor_names,
    )
    config.check(str(path), SOURCE_FIX)
    return config


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, ``w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)``."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def open_gguf(path: Path) -> SourceModel:
    """Read a GGUF file's metadata, check every needed tensor's shape and type, and return a loader."""
    reader = read_gguf(path)
    config = config_from_gguf(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    plan = weight_plan(config, GGUF_NAMES)
    # GGUF lists dims innermost first; numpy (and the plan) outermost first.
    check_plan(plan, {name: tuple(reversed(t.shape.tolist())) for name, t in tensors.items()}, str(path))
    for parts in plan.values():
        for part in parts:
            kind = tensors[part.name].tensor_type
            if kind not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{path}: tensor {part.name} has type {kind.name}, which the importer cannot dequantize; "
                    f"use a GGUF with {'/'.join(t.name for t in SUPPORTED_TYPES)} tensors or import the HF folder"
                )
    # llama.cpp permutes q/k rows of Llama models only (its Qwen2 converter does not): the family's gguf_permuted_qk
    permuted = (
        {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
        if family(config.architecture).gguf_permuted_qk
        else {}
    )

    def load(name: str) -> torch.Tensor:
        tensor = tensors[name]
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        n_head = permuted.get(name.split(".")[-2])
        if n_head is not None:
            weight = unpermute_rows(weight, n_head)
        return torch.from_numpy(np.array(weight, dtype=np.float32))

    def load_blocks(name: str) -> Blocks | None:
        tensor = tensors[name]
        blocks = parse_blocks(tensor.data, tensor.tensor_type)
        n_head = permuted.get(name.split(".")[-2])
        if blocks is None or n_head is None:
            return blocks
        return blocks.rows(unpermute_rows(np.arange(blocks.codes.shape[0]), n_head))

    return SourceModel(config, plan, load, load_blocks)
