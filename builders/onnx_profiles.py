"""The one registry of ONNX export profiles (opset, how INT8 KV codes travel in and out of the graphs, what the
graphs take as input) and of the precisions an NPU graph computes in.

- ``npu``: the form Qualcomm's HTP compiler (QNN, through ONNX Runtime's QNN execution provider) finalizes.
  The host looks the tokens up and precomputes RoPE: the graphs take ``inputs_embeds`` and each position's
  cos/sin rows (and, with sliding-window layers, their mask), so nothing gathers from a weight table by an
  input (HTP cannot finalize such a Gather). INT8 KV as uint8 with zero point 128: the HTP works on unsigned
  8/16-bit tensors, and the cache's symmetric int8 code q is the uint8 code q + 128 with the same scale, so
  nothing is requantized. Precision ``a16w8`` (every activation uint16, linear weights int8 per channel, the
  one form HTP v68 runs) or ``fp16`` (float graphs, which HTP v73+ computes in fp16).
- ``ort``: the graphs for ONNX Runtime's CPU/CUDA/TensorRT providers: ``input_ids`` and ``position_ids`` in,
  the embedding and RoPE tables inside; INT8 KV as int8 with zero point 0 (the signed symmetric form ONNX
  Runtime's quantization tools default to); float graphs.

Linear weights by the engine's weight format (``WEIGHT_FORMS``; norms are float32 in every one): full
precision as float32 MatMul operands; W8A16 as an int8 (in, out) initializer through a per-channel
DequantizeLinear (axis 1, per-axis since 13) into MatMul, standard QDQ, in both profiles; W4A16-AWQ and
int4-g32 in the ``ort`` profile only, as ONNX Runtime's ``com.microsoft.MatMulNBits`` (AWQ after a Mul by the
prequant scale; int4-g32 with a float zero point per block of 32), since standard ONNX has int4 tensors only from
opset 21. The head (``HEAD_FORMS``): float32 embedding and lm_head, or the int8 head in the ``ort`` profile as an
8-bit MatMulNBits lm_head whose blocks the embedding Gather dequantizes.

``ort`` is opset 17: QuantizeLinear/DequantizeLinear take int8 and uint8 (since 10, per-axis since 13),
Split/Unsqueeze take their sizes and axes as inputs (13), and ReduceMean still takes ``axes`` as an attribute
(inputs from 18), the form every QDQ toolchain reading opset 13+ models accepts. ``npu`` is opset 23: 16-bit
QDQ is standard from 21, and the A16W8 graphs normalize with RMSNormalization (23).
"""
from __future__ import annotations

from dataclasses import dataclass

from cabinllm.runtime.errors import ConfigError


@dataclass(frozen=True)
class OnnxProfile:
    """One export profile."""

    name: str
    description: str
    opset: int
    int8_dtype: str  # element type of INT8 KV codes in the graphs
    int8_zero_point: int
    host_inputs: bool  # the host looks up embeddings and RoPE rows (the graphs take inputs_embeds, rope_cos, ...)
    weight_formats: tuple[str, ...]  # engine weight formats (runtime.formats.weight_formats) the graphs can carry
    precisions: tuple[str, ...]  # PRECISIONS the graphs can compute in, the default first
    head_formats: tuple[str, ...]  # engine head formats (runtime.formats.weight_formats.HEAD_FORMATS) it carries

    def check_weights(self, weight_format: str, head: str = "fp16") -> None:
        """ConfigError naming the fix when this profile cannot write an engine's weight or head format."""
        if head not in self.head_formats:
            raise ConfigError(f"the {self.name} profile cannot write the {head} head; export with --profile "
                              f"{' or '.join(p.name for p in ONNX_PROFILES.values() if head in p.head_formats)}, "
                              f"or build the engine with cabin-build --head {' or '.join(self.head_formats)}")
        if weight_format in NOT_EXPORTED:
            raise ConfigError(f"{weight_format} weights cannot be exported to ONNX: {NOT_EXPORTED[weight_format]}")
        if weight_format not in self.weight_formats:
            others = [p.name for p in ONNX_PROFILES.values() if weight_format in p.weight_formats]
            why = " (standard ONNX has int4 tensors only from opset 21)" if "int4" in weight_format and self.opset < 21 else ""
            raise ConfigError(f"the {self.name} profile (opset {self.opset}) cannot write {weight_format} weights{why}; "
                             f"export with --profile {' or '.join(others)}, or build the engine with cabin-build "
                             f"--weights {' or '.join(self.weight_formats)}")

    def check_precision(self, precision: str) -> None:
        """ConfigError naming the choices when this profile's graphs cannot compute in ``precision``."""
        if precision not in self.precisions:
            raise ConfigError(f"the {self.name} profile's graphs compute in {' or '.join(self.precisions)}, not "
                              f"{precision}; choose --precision {' or '.join(self.precisions)}"
                              + (" or --profile npu" if "npu" != self.name else ""))


@dataclass(frozen=True)
class Precision:
    """What an exported graph computes in."""

    name: str
    description: str
    quantized: bool  # activations and weights quantized by ONNX Runtime's QNN tooling (calibrated)
    kv_caches: tuple[str, ...]  # the --kv-cache modes it takes


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("a16w8", "uint16 activations, int8 per-channel weights, uint8 KV with the engine's scales "
              "(calibrated static QDQ; what HTP v68 and later run)", True, ("int8",)),
    Precision("fp16", "float graphs (float32 in the file; the HTP v73+ computes them in fp16, CPU providers in fp32)",
              False, ("fp32", "fp16", "int8")),
)}

ONNX_PROFILES: dict[str, OnnxProfile] = {p.name: p for p in (
    OnnxProfile("npu", "QNN HTP: inputs_embeds and RoPE rows from the host, INT8 KV as uint8 + zero point 128",
                23, "uint8", 128, True, ("fp16", "int8"), ("a16w8", "fp16"), ("fp16",)),
    OnnxProfile("ort", "ONNX Runtime providers: input_ids in, INT8 KV as int8 + zero point 0", 17, "int8", 0,
                False, ("fp16", "int8", "int4-awq", "int4-g32"), ("fp16",), ("fp16", "int8")),
)}
# engine weight format -> how the graphs carry its linear layers
WEIGHT_FORMS = {
    "fp16": "float32 MatMul weights",
    "int8": "int8 (in, out) weights, per-channel DequantizeLinear into MatMul",
    "int4-awq": "uint4 blocks in com.microsoft.MatMulNBits (zero point 8) after a Mul by the prequant scale",
    "int4-g32": "uint4 blocks of 32 in com.microsoft.MatMulNBits with a float zero point -minimum / scale each",
}
# engine weight formats no profile writes -> why (cabin-export quotes it)
NOT_EXPORTED = {
    "int4-g32-a8": ("ONNX Runtime's MatMulNBits takes int8 inputs (accuracy_level 4) with integer zero points only, "
                    "and int4-g32's minima are not (onnxruntime 1.32 computed the same logits at accuracy_level 4 "
                    "as at 0 on these blocks); build the engine with cabin-build --weights int4-g32, the same "
                    "blocks on float activations, to export it"),
}
# engine head format -> how the graphs carry the embedding and lm_head
HEAD_FORMS = {
    "fp16": "float32 embedding Gather and lm_head MatMul",
    "int8": "8-bit com.microsoft.MatMulNBits lm_head (blocks of 32, zero point 128); the embedding Gathers its blocks",
}


def onnx_profile(name: str) -> OnnxProfile:
    """The profile of a name; ValueError naming the known ones otherwise."""
    try:
        return ONNX_PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown ONNX profile {name!r}; choose one of {', '.join(ONNX_PROFILES)}") from None


def precision(name: str) -> Precision:
    """The precision of a name; ConfigError naming the known ones otherwise."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ConfigError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}") from None
