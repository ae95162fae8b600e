"""The vision encoder (tower and projector) of a vision-language engine as an ONNX graph of one static picture
size, for the board's TensorRT build (and the NPU path): exported by torch.onnx from the same module the reference
engine runs, then run once by ONNX Runtime and compared with torch on the same picture.

The static size is that of a camera frame (``CAMERA_FRAME``) after the family's processor: its pixel tensors' shapes
are the graph's inputs, its rows (one per image token) the output ``image_rows``. Qwen2-VL's grid is traced into the
graph (its vision transformer's positions follow the grid); Idefics3's position ids take torch.export (the
TorchScript exporter cannot type them), the others the TorchScript exporter.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import torch

from cabinllm.builders.image_plan import CAMERA_FRAME, camera_frame
from cabinllm.runtime.errors import CheckpointError, Fix, Hint
from cabinllm.runtime.model.vision import Vision

VISION_ONNX = "vision.onnx"
VISION_ENGINE = "vision.engine"
OPSET = 18
OUTPUT = "image_rows"
DYNAMO_FAMILIES = ("idefics3",)  # exported through torch.export (needs onnxscript)


class _Encoder(torch.nn.Module):
    """The engine's encoder as a module of positional pixel tensors."""

    def __init__(self, vision: Vision, names: list[str]) -> None:
        super().__init__()
        self.vision, self.model, self.names = vision, vision.model, names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.vision._features(dict(zip(self.names, tensors)))


def vision_engine_command(folder: str) -> list[str]:
    """TensorRT's ``trtexec`` call that builds the encoder's engine from the graph, run in the engine folder on the
    board (fp16; the graph's shapes are static). CabinLLM's TensorRT-LLM session does not run that engine yet: it
    encodes pictures with ``vision/`` in torch and sends the rows as a prompt table."""
    return ["trtexec", f"--onnx={folder}/{VISION_ONNX}", "--fp16", f"--saveEngine={folder}/{VISION_ENGINE}"]


def export_vision_onnx(vision: Vision, folder: Path) -> dict:
    """Write ``folder``/vision.onnx for a camera frame's size and check it against torch; returns the manifest's
    record of it (inputs and their shapes, rows, the largest difference from torch)."""
    import onnxruntime as ort

    prepared = vision.prepare(*camera_frame())
    names = list(prepared.inputs)
    tensors = tuple(prepared.inputs[name] for name in names)
    encoder = _Encoder(vision, names).eval()
    path = folder / VISION_ONNX
    dynamo = vision.family.model_type in DYNAMO_FAMILIES
    try:
        with torch.inference_mode():
            expected = encoder(*tensors).float().numpy()
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():  # tracer notes
            warnings.simplefilter("ignore")
            torch.onnx.export(encoder, tensors, str(path), input_names=names, output_names=[OUTPUT],
                              opset_version=OPSET, dynamo=dynamo, external_data=False)
    except (ImportError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"the {vision.family.model_type} vision encoder did not export to ONNX ({err}); the "
                              "reference engine runs it in torch", (Hint(Fix.BUILD_TARGET, "cpu"),)) from err
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: prepared.inputs[i.name].numpy() for i in session.get_inputs()}
    rows = session.run(None, feed)[0]
    gap = float(np.abs(rows - expected).max())
    if rows.shape != expected.shape or not gap < 1e-3:
        raise CheckpointError(f"the exported vision graph gives rows {rows.shape} differing from torch's "
                              f"{expected.shape} by {gap:g}; the reference engine runs it in torch",
                              (Hint(Fix.BUILD_TARGET, "cpu"),))
    return {"file": VISION_ONNX, "picture": list(CAMERA_FRAME), "opset": OPSET,
            "inputs": {name: {"shape": list(feed[name].shape), "dtype": str(feed[name].dtype)} for name in feed},
            "traced": {name: prepared.inputs[name].tolist() for name in names if name not in feed},  # Qwen2-VL's grid
            "output": {"name": OUTPUT, "shape": list(rows.shape)}, "image_tokens": prepared.image_tokens,
            "max_abs_diff_vs_torch": gap, "exporter": "torch.export" if dynamo else "torchscript"}
