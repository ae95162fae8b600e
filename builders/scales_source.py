"""Where a build's KV scales come from: a calibrated ``kv_scales.json``, a calibration run now
(cabinllm.calibration.calibrate), or a quick abs-max measurement on sample exchanges
(cabinllm.calibration.quick_scales).

A file's scales are checked against the model's own K/V range, measured quickly on the sample exchanges: a range
(scale x 127) far from it makes INT8 clip nearly every value or round it to 0, and the engine answer garbage.

With ``--equalize`` the calibrated per-channel ranges are folded into the weights
(cabinllm.calibration.equalize) and the scales that fit the new weights replace the calibrated ones.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cabinllm.calibration.calibrate import CalibrationRequest, calibrate
from cabinllm.calibration.equalize import FIRST_TOKEN, KeyGrouping, equalized_ranges
from cabinllm.calibration.equalize import equalize as fold
from cabinllm.calibration.quick_scales import SAMPLES_FILE, quick_kv_scales
from cabinllm.runtime.errors import ScalesError
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.engine_folder import EngineFolder
from cabinllm.runtime.formats.scales_file import KVScales, LayerRanges, ScalesFile, load_scales_file, save_scales
from cabinllm.runtime.kv.quant import INT8_MAX
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import Checkpoint, vision_of

Log = Callable[[str], None]
RANGE_FACTOR = 100.0  # a file's K/V range this many times above or below the model's own is refused
CLIP_WARN_RATE = 0.01  # a layer whose scale clips more than this share of the calibration data is warned about


@dataclass
class BuildScales:
    """The scales a build uses, the weights they belong to, and how they were made."""

    scales: KVScales
    weights: dict[str, torch.Tensor]
    method: str
    source: str
    equalized: bool


def scales_from_file(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], fingerprint: str,
                     equalize: bool, out: Path, log: Log = print) -> BuildScales:
    """Scales of a calibrated file checked against this model (its fingerprint, and its K/V range measured on the
    sample exchanges); equalized weights and scales when asked. ``out`` is the scales file of the engine folder
    being built, whose checkpoint gives the tokenizer; warnings go to ``log``."""
    shape = (config.num_key_value_heads, config.head_size)
    found = load_scales_file(path, fingerprint, config.num_hidden_layers, shape)
    if found.equalized:
        raise ScalesError(f"{path}: these scales belong to equalized weights (equalized: true), not to the model "
                          "as imported; give the plain kv_scales.json from calibration and add --equalize")
    measured = quick_kv_scales(Transformer(config, weights), ChatTokenizer(EngineFolder(out.parent).checkpoint))
    check_scales_range(path, found.scales, measured)
    warning = clipping_warning(path, found.ranges)
    if warning:
        log(warning)
    if not equalize:
        shutil.copyfile(path, out)
        return BuildScales(found.scales, weights, found.method, str(path), False)
    if found.ranges is None:
        raise ScalesError(f"{path}: --equalize needs per-channel K/V ranges (kv_scales.json version 2 from "
                          "calibration); re-run calibration with this CabinLLM or build without --equalize")
    return equalized(found, config, weights, str(path), out)


def check_scales_range(path: Path, scales: KVScales, measured: KVScales) -> None:
    """ScalesError listing each layer whose K or V range (scale x 127) is more than RANGE_FACTOR times above or
    below the model's own, ``measured``: INT8 with such a scale clips every value or rounds it to 0."""
    off = []
    for layer, (k, v, own_k, own_v) in enumerate(zip(scales.k, scales.v, measured.k, measured.v)):
        for name, scale, own in (("K", k, own_k), ("V", v, own_v)):
            ratio = scale / own
            if not 1 / RANGE_FACTOR <= ratio <= RANGE_FACTOR:
                how_far = f"{ratio:.3g}x too large" if ratio > 1 else f"{1 / ratio:.3g}x too small"
                off.append(f"layer {layer} {name}: range {scale * INT8_MAX:.3g} where the model reaches "
                           f"{own * INT8_MAX:.3g}, {how_far}")
    if off:
        raise ScalesError(f"{path}: scales far outside this model's K/V range (more than {RANGE_FACTOR:g}x above or "
                          "below the abs-max measured on the sample exchanges); an engine with them answers "
                          "garbage:\n  " + "\n  ".join(off)
                          + "\ncalibrate this model with cabin-calibrate and build with that file")


def clipping_warning(path: Path, ranges: list[LayerRanges] | None) -> str | None:
    """A warning naming each layer whose K or V scale clips more than CLIP_WARN_RATE of the calibration data
    (as the file records it), or None."""
    clipping = [f"{layer} {name} ({rate:.2%})" for layer, r in enumerate(ranges or [])
                for name, rate in (("K", r.k_clip_rate), ("V", r.v_clip_rate)) if rate > CLIP_WARN_RATE]
    if not clipping:
        return None
    return (f"warning: {path}: the scales of layer {', '.join(clipping)} clip more than {CLIP_WARN_RATE:.0%} of the "
            "calibration data's values, which are cut to the scale's range and cost accuracy; calibrating with "
            "--method max (or a higher --percentile) clips less")


def calibrated_scales(data: str, config: ModelConfig, weights: dict[str, torch.Tensor], checkpoint: Path,
                      fingerprint: str, equalize: bool, out: Path) -> BuildScales:
    """Scales calibrated now on dialogues (``builtin``, ``sharegpt`` or a file; cabinllm.calibration.calibrate); a
    vision-language build's pictures are read by the vision part written beside the checkpoint."""
    model = Checkpoint("build", config, weights, ChatTokenizer(checkpoint), fingerprint,
                        vision=vision_of(checkpoint.parent))
    request = CalibrationRequest(data=data, grade=False)  # max_tokens: the default, capped at the context
    found = calibrate(model, request, progress=False).scales_file
    source = f"calibrated on {data} dialogues"
    if equalize:
        return equalized(found, config, weights, source, out)
    save_scales(out, found.scales, fingerprint, found.method, found.data, found.ranges)
    return BuildScales(found.scales, weights, found.method, source, False)


def equalized(found: ScalesFile, config: ModelConfig, weights: dict[str, torch.Tensor], source: str,
              out: Path) -> BuildScales:
    """Weights with the equalization of ``found.ranges`` (and of its first token, cabinllm.calibration.equalize)
    folded in, and the scales that fit them."""
    new_weights, scales = fold(config, weights, found.ranges, first_token=found.data.get(FIRST_TOKEN))
    method = f"{found.method}+equalized"
    ranges = equalized_ranges(found.ranges, grouping=KeyGrouping.of(config))
    save_scales(out, scales, found.fingerprint, method, found.data, ranges, equalized=True)
    return BuildScales(scales, new_weights, method, source, True)


def quick_scales(config: ModelConfig, weights: dict[str, torch.Tensor], checkpoint: Path, fingerprint: str,
                 out: Path) -> BuildScales:
    """Abs-max scales measured on the built-in sample exchanges (cabinllm.calibration.quick_scales)."""
    scales = quick_kv_scales(Transformer(config, weights), ChatTokenizer(checkpoint))
    source = f"calibration/data/{SAMPLES_FILE}"
    save_scales(out, scales, fingerprint, "quick-max", {"source": source})
    return BuildScales(scales, weights, "quick-max", source, False)
