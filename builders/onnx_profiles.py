"""The one registry of ONNX export profiles: opset, how INT8 KV codes travel in and out of the graphs, and
which ops a graph may use.

- ``npu``: standard ONNX ops only, each on the allow-list ``builders/data/onnx_npu_ops.txt``; INT8 KV as
  uint8 with zero point 128. QNN's HTP backend takes unsigned 8/16-bit QDQ tensors (ONNX Runtime's QNN
  execution provider documents MatMul on HTP for (uint8, uint8), (uint8, uint16), (uint16, uint8) and says
  QNN operators "typically support the uint8 and uint16 data types"); the cache's symmetric int8 code q is
  the uint8 code q + 128 with the same scale, so nothing is requantized.
- ``ort``: the same graphs for ONNX Runtime's CPU/CUDA/TensorRT providers, INT8 KV as int8 with zero point 0
  (the signed symmetric form ONNX Runtime's quantization tools default to), no allow-list.

Opset 17 for both: QuantizeLinear/DequantizeLinear take int8 and uint8 (since 10, per-axis since 13),
Split/Unsqueeze take their sizes and axes as inputs (13), and ReduceMean still takes ``axes`` as an attribute
(inputs from 18), the form every QDQ toolchain reading opset 13+ models accepts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class OnnxProfile:
    """One export profile."""

    name: str
    description: str
    opset: int
    int8_dtype: str  # element type of INT8 KV codes in the graphs
    int8_zero_point: int
    allow_list: str | None  # data file of the ops the graphs may use (None: any op)

    def allowed_ops(self) -> frozenset[str] | None:
        """The ops a graph of this profile may use (None: no restriction)."""
        if self.allow_list is None:
            return None
        lines = (DATA_DIR / self.allow_list).read_text(encoding="utf-8").splitlines()
        return frozenset(line.split()[0] for line in lines if line.strip() and not line.startswith("#"))


ONNX_PROFILES: dict[str, OnnxProfile] = {p.name: p for p in (
    OnnxProfile("npu", "standard ONNX ops on the NPU allow-list, INT8 KV as uint8 + zero point 128 (QNN HTP)",
                17, "uint8", 128, "onnx_npu_ops.txt"),
    OnnxProfile("ort", "ONNX Runtime providers, INT8 KV as int8 + zero point 0", 17, "int8", 0, None),
)}


def onnx_profile(name: str) -> OnnxProfile:
    """The profile of a name; ValueError naming the known ones otherwise."""
    try:
        return ONNX_PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown ONNX profile {name!r}; choose one of {', '.join(ONNX_PROFILES)}") from None
