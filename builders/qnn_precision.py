"""Mixed precision for the A16W8 graphs: a plan names the weights stored as 16-bit integers instead of 8-bit, chosen by
measured sensitivity (cabinllm.benchmarks.studies.npu_sensitivity), and each HTP architecture says which of them it
runs. A 16-bit weight is quantized as the tooling quantizes an 8-bit one (symmetric, zero point 0; per output channel
for a MatMul, per tensor for a norm's scale) from the float graphs' weights, so only its step changes: 256 times
finer, at twice the bytes.

Measured on the HTP emulator (onnxruntime-qnn 2.7.0): v68 and v73 both run a norm's 16-bit scale (an elementwise
Mul); only v73 runs a MatMul with 16-bit weights (v68 leaves the node to the CPU).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cabinllm.runtime.errors import ConfigError, DataError

PLAN_FORMAT = "cabin-npu-precision/1"
INT16_MAX = 32767
# HTP architecture -> the ops whose weights it runs in 16 bits
W16_OPS = {68: ("Mul",), 73: ("Mul", "MatMul")}


@dataclass(frozen=True)
class PrecisionPlan:
    """The weights (float graph initializer names) stored as int16, and what chose them."""

    w16: tuple[str, ...] = ()
    chosen_by: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"format": PLAN_FORMAT, "w16": list(self.w16), "chosen_by": self.chosen_by}


def read_plan(path: Path) -> PrecisionPlan:
    """A plan file written by the sensitivity study; DataError naming what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {PLAN_FORMAT}")
        return PrecisionPlan(tuple(str(name) for name in data["w16"]), str(data.get("chosen_by", "")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(f"{path}: not a precision plan ({err}); write one with python -m "
                        "cabinllm.benchmarks.studies.npu_sensitivity") from None


def weight_ops(model) -> dict[str, str]:
    """Each quantized weight's float name -> the op that reads it (MatMul, Mul)."""
    readers = {name: node.op_type for node in model.graph.node for name in node.input}
    return {node.input[0].removesuffix("_quantized"): readers.get(node.output[0], "")
            for node in model.graph.node if node.op_type == "DequantizeLinear"
            and node.input[0].endswith("_quantized")}


def check_plan(plan: PrecisionPlan, model, htp_arch: int | None) -> None:
    """ConfigError naming the weights when the plan names one the graph lacks, or one whose op the HTP architecture
    does not run with 16-bit weights (naming what it runs)."""
    ops = weight_ops(model)
    unknown = [name for name in plan.w16 if name not in ops]
    if unknown:
        raise ConfigError(f"the precision plan names weights these graphs do not quantize: {', '.join(unknown[:5])}; "
                          "write the plan for this model with python -m cabinllm.benchmarks.studies.npu_sensitivity")
    if htp_arch is None:
        return
    refused = [name for name in plan.w16 if ops[name] not in W16_OPS[htp_arch]]
    if refused:
        raise ConfigError(f"HTP v{htp_arch} runs 16-bit weights only in {' and '.join(W16_OPS[htp_arch])} ops; the "
                          f"plan puts {len(refused)} {ops[refused[0]]} weight(s) in 16 bits ({', '.join(refused[:3])}"
                          f"{' ...' if len(refused) > 3 else ''}); choose a plan for v{htp_arch} "
                          f"(npu_sensitivity --htp-arch {htp_arch}) or compile for --htp-arch "
                          f"{max(a for a, o in W16_OPS.items() if ops[refused[0]] in o)}")


def apply_plan(model, floats: dict[str, np.ndarray], plan: PrecisionPlan) -> None:
    """Store the plan's weights of a quantized graph as int16 from their float values (in place)."""
    from onnx import numpy_helper

    wanted = set(plan.w16)
    tensors = {t.name: i for i, t in enumerate(model.graph.initializer)}
    for node in model.graph.node:
        name = node.input[0].removesuffix("_quantized")
        if node.op_type != "DequantizeLinear" or name not in wanted:
            continue
        weight = floats[name]
        per_channel = any(a.name == "axis" for a in node.attribute)
        peak = np.abs(weight).max(axis=0) if per_channel else np.abs(weight).max()
        scale = (np.maximum(peak, np.finfo(np.float32).tiny) / INT16_MAX).astype(np.float32)
        codes = np.clip(np.round(weight / scale), -INT16_MAX, INT16_MAX).astype(np.int16)
        for tensor, array in ((node.input[0], codes), (node.input[1], scale),
                              (node.input[2], np.zeros_like(scale, dtype=np.int16))):
            model.graph.initializer[tensors[tensor]].CopyFrom(numpy_helper.from_array(np.asarray(array), tensor))
