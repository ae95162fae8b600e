"""int4-g32 and the int8 head from GGUF blocks: Q4_1, Q4_0 and Q8_0 tensors taken block for block (encoded back,
they are the file's bytes), the engine's op computes what the fp32 import computes, float tensors are rounded."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf import GGMLQuantizationType as QType
from test_import import write_tiny_gguf

from cabinllm.calibration.gguf_weights import to_int4_g32, to_int8_head
from cabinllm.runtime.formats.weight_formats import MINIMUM, SCALE
from cabinllm.runtime.model.linear import Int4G32Linear, Int8G32Table
from cabinllm.runtime.sources.gguf import open_gguf
from cabinllm.runtime.sources.model_source import open_source
from cabinllm.runtime.sources.weight_plan import iter_weights

# GGUF tensors whose rows a checkpoint tensor keeps in order (q/k rows are un-permuted, so not compared here)
SAME_ROWS = {"blk.0.ffn_down.weight": "transformer.layers.0.mlp.proj",
             "blk.0.ffn_gate.weight": "transformer.layers.0.mlp.fc",
             "blk.0.ffn_up.weight": "transformer.layers.0.mlp.gate"}


def gguf_bytes(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, kind: QType) -> np.ndarray:
    """Checkpoint tensors encoded as the GGUF blocks of ``kind``: (rows, bytes per row), llama.cpp's layout
    (fp16 d, [fp16 m,] then the codes of each block of 32)."""
    rows, groups = scale.shape
    parts = [scale.numpy().view(np.uint8).reshape(rows, groups, 2)]
    if kind == QType.Q4_1:
        parts.append(minimum.numpy().view(np.uint8).reshape(rows, groups, 2))
    else:
        assert kind == QType.Q8_0 or torch.equal(minimum, (scale * -8).half())  # Q4_0: minimum -8 d, exactly
    per_block = 32 if kind == QType.Q8_0 else 16
    parts.append(codes.numpy().view(np.uint8).reshape(rows, groups, per_block))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("kind", [QType.Q4_1, QType.Q4_0])
def test_gguf_blocks_round_trip_bit_for_bit(tmp_path, kind):
    """Import, convert to int4-g32 and encode again: every byte of the file's Q4_1 / Q4_0 tensors; the op's
    weights are the fp32 import's exactly."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, kind)
    model = open_gguf(path)
    floats = dict(iter_weights(model))
    config, weights, done = to_int4_g32(model.config, floats, open_source(path))
    assert not done.rounded and len(done.exact) == 5  # qkv, dense, fc, gate, proj
    raw = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}
    for name, base in SAME_ROWS.items():
        stored = [weights[f"{base}.{suffix}"] for suffix in ("weight", SCALE, MINIMUM)]
        assert np.array_equal(gguf_bytes(*stored, kind), raw[name].reshape(stored[0].shape[0], -1))
    for base in {f"transformer.layers.0.{n}" for n in ("attention.qkv", "attention.dense", "mlp.proj")}:
        op = Int4G32Linear(*(weights[f"{base}.{suffix}"] for suffix in ("weight", SCALE, MINIMUM)))
        assert torch.equal(op.dequantize(), floats[f"{base}.weight"].float())
    assert config.quantization["quant_algo"] == "W4A16_G32"


def test_q8_0_head_round_trips_and_float_tensors_are_rounded(tmp_path):
    """A Q8_0 embedding becomes the int8 head block for block; from an F32 file the same conversion rounds every
    tensor to Q4_1 / Q8_0 and says so."""
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(path, QType.Q8_0)
    model = open_gguf(path)
    floats = dict(iter_weights(model))
    _, weights, done = to_int8_head(model.config, floats, open_source(path))
    assert not done.rounded and len(done.exact) == 2  # embedding and lm_head, both the tied token_embd
    raw = np.asarray(next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight").data)
    codes, scale = weights["lm_head.weight"], weights[f"lm_head.{SCALE}"]
    assert np.array_equal(gguf_bytes(codes, scale, None, QType.Q8_0), raw.reshape(codes.shape[0], -1))
    assert torch.equal(Int8G32Table(codes, scale).dequantize(), floats["lm_head.weight"].float())

    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path)
    model = open_gguf(path)
    floats = dict(iter_weights(model))
    _, _, linears = to_int4_g32(model.config, floats, open_source(path))
    _, _, head = to_int8_head(model.config, floats, open_source(path))
    assert not linears.exact and len(linears.rounded) == 5 and not head.exact and len(head.rounded) == 2
    assert "rounded" in linears.summary("int4-g32") and "lossless" not in linears.summary("int4-g32")
