"""The one registry of ONNX export profiles: opset, how INT8 KV codes travel in and out of the graphs, and
which ops a graph may use.

- ``npu``: standard ONNX ops only, each on the allow-list ``builders/data/onnx_npu_ops.txt``; INT8 KV as
  uint8 with zero point 128. QNN's HTP backend takes unsigned 8/16-bit QDQ tensors (ONNX Runtime's QNN
  execution provider documents MatMul on HTP for (uint8, uint8), (uint8, uint16), (uint16, uint8) and says
  QNN operators "typically support the uint8 and uint16 data types"); the cache's symmetric int8 code q is
  the uint8 code q + 128 with the same scale, so nothing is requantized.
- ``ort``: the same graphs for ONNX Runtime's CPU/CUDA/TensorRT providers, INT8 KV as int8 with zero point 0
  (the signed symmetric form ONNX Runtime's quantization tools default to), no allow-list.

Linear weights by the engine's weight format (``WEIGHT_FORMS``; embedding, lm_head and norms are float32 in
every one): full precision as float32 MatMul operands; W8A16 as an int8 (in, out) initializer through a
per-channel DequantizeLinear (axis 1, per-axis since 13) into MatMul, standard QDQ, in both profiles; W4A16-AWQ
in the ``ort`` profile only, as ONNX Runtime's ``com.microsoft.MatMulNBits`` after a Mul by the prequant scale
(standard ONNX has int4 tensors only from opset 21).

Opset 17 for both: QuantizeLinear/DequantizeLinear take int8 and uint8 (since 10, per-axis since 13),
Split/Unsqueeze take their sizes and axes as inputs (13), and ReduceMean still takes ``axes`` as an attribute
(inputs from 18), the form every QDQ toolchain reading opset 13+ models accepts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cabinllm.runtime.errors import ConfigError

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
    weight_formats: tuple[str, ...]  # engine weight formats (runtime.formats.weight_formats) the graphs can carry

    def check_weights(self, weight_format: str) -> None:
        """ValueError naming the fix when this profile cannot write an engine's weight format."""
        if weight_format not in self.weight_formats:
            others = [p.name for p in ONNX_PROFILES.values() if weight_format in p.weight_formats]
            why = " (standard ONNX has int4 tensors only from opset 21)" if "int4" in weight_format else ""
            raise ConfigError(f"the {self.name} profile (opset {self.opset}) cannot write {weight_format} weights{why}; "
                             f"export with --profile {' or '.join(others)}, or build the engine with cabin-build "
                             f"--weights {' or '.join(self.weight_formats)}")

    def allowed_ops(self) -> frozenset[str] | None:
        """The ops a graph of this profile may use (None: no restriction)."""
        if self.allow_list is None:
            return None
        lines = (DATA_DIR / self.allow_list).read_text(encoding="utf-8").splitlines()
        return frozenset(line.split()[0] for line in lines if line.strip() and not line.startswith("#"))


ONNX_PROFILES: dict[str, OnnxProfile] = {p.name: p for p in (
    OnnxProfile("npu", "standard ONNX ops on the NPU allow-list, INT8 KV as uint8 + zero point 128 (QNN HTP)",
                17, "uint8", 128, "onnx_npu_ops.txt", ("fp16", "int8")),
    OnnxProfile("ort", "ONNX Runtime providers, INT8 KV as int8 + zero point 0", 17, "int8", 0, None,
                ("fp16", "int8", "int4-awq")),
)}
# engine weight format -> how the graphs carry its linear layers
WEIGHT_FORMS = {
    "fp16": "float32 MatMul weights",
    "int8": "int8 (in, out) weights, per-channel DequantizeLinear into MatMul",
    "int4-awq": "uint4 blocks in com.microsoft.MatMulNBits (zero point 8) after a Mul by the prequant scale",
}


def onnx_profile(name: str) -> OnnxProfile:
    """The profile of a name; ValueError naming the known ones otherwise."""
    try:
        return ONNX_PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown ONNX profile {name!r}; choose one of {', '.join(ONNX_PROFILES)}") from None
