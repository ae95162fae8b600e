"""The calibration job: dialogues -> K/V statistics -> per-layer scales with ranges, ready for kv_scales.json."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from calibration.scales import DEFAULT_PERCENTILE, LayerClips, compute_clips, layer_ranges
from calibration.selection import prepare_dialogues
from calibration.stats import KVStats, collect_stats
from runtime.kv_scales import ScalesFile, save_scales
from runtime.model_source import LoadedModel


@dataclass
class CalibrationRequest:
    """What to calibrate on and how."""

    data: str = "builtin"
    num_dialogues: int = 64
    max_tokens: int = 2048
    min_tokens: int = 0
    method: str = "max"
    percentile: float = DEFAULT_PERCENTILE
    seed: int = 0


@dataclass
class CalibrationResult:
    """Scales (with per-channel ranges), the statistics behind them and how long it took."""

    scales_file: ScalesFile
    stats: KVStats
    clips: LayerClips
    seconds: float


def calibrate(model: LoadedModel, request: CalibrationRequest, progress: bool = True) -> CalibrationResult:
    """Collect K/V statistics on the train split of the data and compute scales by the requested method."""
    started = time.perf_counter()
    dialogues, summary = prepare_dialogues(request.data, "train", request.num_dialogues, request.seed,
                                           model.tokenizer, request.max_tokens, request.min_tokens)
    stats = collect_stats(model.transformer(), dialogues, progress=progress)
    clips = compute_clips(stats, request.method, request.percentile)
    method = f"percentile-{request.percentile:g}" if request.method == "percentile" else request.method
    seconds = time.perf_counter() - started
    summary = {**summary, "seconds": round(seconds, 1)}
    scales_file = ScalesFile(clips.scales(), model.fingerprint, method, summary, layer_ranges(stats, clips))
    return CalibrationResult(scales_file, stats, clips, seconds)


def write_scales(path: str | Path, scales_file: ScalesFile) -> None:
    """Write a ScalesFile as kv_scales.json (atomically)."""
    save_scales(path, scales_file.scales, scales_file.fingerprint, scales_file.method, scales_file.data,
                scales_file.ranges, scales_file.equalized)
