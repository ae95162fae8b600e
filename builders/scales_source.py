"""Where a build's KV scales come from: a calibrated ``kv_scales.json``, a calibration run now
(calibration.calibrate), or a quick abs-max measurement on sample exchanges (calibration.quick_scales).

With ``--equalize`` the calibrated per-channel ranges are folded into the weights
(calibration.equalize) and the scales that fit the new weights replace the calibrated ones.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from calibration.calibrate import CalibrationRequest, calibrate
from calibration.equalize import equalize as fold, equalized_ranges
from calibration.quick_scales import SAMPLES_FILE, quick_kv_scales
from runtime.checkpoint import ModelConfig
from runtime.kv_scales import ScalesError, ScalesFile, load_scales_file, save_scales
from runtime.kv_storage import KVScales
from runtime.model import Transformer
from runtime.model_source import LoadedModel
from runtime.tokenizer import ChatTokenizer


@dataclass
class BuildScales:
    """The scales a build uses, the weights they belong to, and how they were made."""

    scales: KVScales
    weights: dict[str, torch.Tensor]
    method: str
    source: str
    equalized: bool


def scales_from_file(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], fingerprint: str,
                     equalize: bool, out: Path) -> BuildScales:
    """Scales of a calibrated file checked against this model; equalized weights and scales when asked."""
    shape = (config.num_key_value_heads, config.head_size)
    found = load_scales_file(path, fingerprint, config.num_hidden_layers, shape)
    if found.equalized:
        raise ScalesError(f"{path}: these scales belong to equalized weights (equalized: true), not to the model "
                          "as imported; give the plain kv_scales.json from calibration and add --equalize")
    if not equalize:
        shutil.copyfile(path, out)
        return BuildScales(found.scales, weights, found.method, str(path), False)
    if found.ranges is None:
        raise ScalesError(f"{path}: --equalize needs per-channel K/V ranges (kv_scales.json version 2 from "
                          "calibration); re-run calibration with this CabinLLM or build without --equalize")
    return equalized(found, config, weights, str(path), out)


def calibrated_scales(data: str, config: ModelConfig, weights: dict[str, torch.Tensor], checkpoint: Path,
                      fingerprint: str, equalize: bool, out: Path) -> BuildScales:
    """Scales calibrated now on dialogues (``builtin``, ``sharegpt`` or a file; calibration.calibrate)."""
    model = LoadedModel("build", config, weights, ChatTokenizer(checkpoint), fingerprint)
    request = CalibrationRequest(data=data, max_tokens=min(CalibrationRequest.max_tokens,
                                                           config.max_position_embeddings))
    found = calibrate(model, request, progress=False).scales_file
    source = f"calibrated on {data} dialogues"
    if equalize:
        return equalized(found, config, weights, source, out)
    save_scales(out, found.scales, fingerprint, found.method, found.data, found.ranges)
    return BuildScales(found.scales, weights, found.method, source, False)


def equalized(found: ScalesFile, config: ModelConfig, weights: dict[str, torch.Tensor], source: str,
              out: Path) -> BuildScales:
    """Weights with the equalization factors of ``found.ranges`` folded in, and the scales that fit them."""
    new_weights, scales = fold(config, weights, found.ranges)
    method = f"{found.method}+equalized"
    save_scales(out, scales, found.fingerprint, method, found.data, equalized_ranges(found.ranges), equalized=True)
    return BuildScales(scales, new_weights, method, source, True)


def quick_scales(config: ModelConfig, weights: dict[str, torch.Tensor], checkpoint: Path, fingerprint: str,
                 out: Path) -> BuildScales:
    """Abs-max scales measured on the built-in sample exchanges (calibration.quick_scales)."""
    scales = quick_kv_scales(Transformer(config, weights), ChatTokenizer(checkpoint))
    source = f"calibration/data/{SAMPLES_FILE}"
    save_scales(out, scales, fingerprint, "quick-max", {"source": source})
    return BuildScales(scales, weights, "quick-max", source, False)
