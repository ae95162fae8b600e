"""The calibration job: dialogues -> K/V statistics -> per-layer scales with ranges, ready for kv_scales.json.

With ``builtin`` data the statistics come from long cabin sessions (in-car dialogues of the train split
stitched under one system prompt, cabinllm.calibration.stitch) and, unless ``mix`` is ``none``, long ShareGPT
dialogue of its train split. One more session or dialogue per source, never in the statistics, is the
validation part that the ``kl`` method chooses clips on (cabinllm.calibration.clip_search). The held-out split of
the same sources grades the scales the run wrote (KL, top-1, perplexity change of the shared, equalized
and dynamic modes), so the report says how good they are without a second command. The token every sequence
starts with is recorded (``first_token``), for equalization to store its K and V exactly
(cabinllm.calibration.equalize).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cabinllm.calibration.clip_search import SEARCH_METHOD, CandidateScore, choose_clips
from cabinllm.calibration.clips import (DEFAULT_PERCENTILE, METHODS, LayerClips, compute_clips, kind_ranges,
                                        layer_ranges)
from cabinllm.calibration.equalize import FIRST_TOKEN
from cabinllm.calibration.evaluate import ModeResult, evaluate
from cabinllm.calibration.selection import TokenizedDialogue, media_summary, prepare_dialogues
from cabinllm.calibration.stats import KVStats, collect_stats
from cabinllm.runtime.errors import ConfigError, DataError, Fix, Hint
from cabinllm.runtime.formats.scales_file import ScalesFile, save_scales
from cabinllm.runtime.sources.model_source import Checkpoint

CALIBRATION_METHODS = (SEARCH_METHOD, *METHODS)
NO_MIX = "none"
BUILTIN = "builtin"
VALIDATION_TOKENS = 1024  # per source: the validation and grading parts are cut to this many tokens
GRADE_MODES = ("int8", "int8-eq", "int8-dynamic")
BY_KIND = "by_kind"  # the data summary's K/V ranges at text and at image or audio positions (clips.kind_ranges)
SHORT_COVERAGE = 0.25  # the report warns when the longest sequence covers less than this share of the context


@dataclass
class CalibrationRequest:
    """What to calibrate on and how; ``None`` counts take the data's default (DEFAULTS)."""

    data: str = BUILTIN
    num_dialogues: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    method: str = SEARCH_METHOD
    percentile: float = DEFAULT_PERCENTILE
    seed: int = 0
    mix: str = "sharegpt"  # a data source as ``data`` takes it, or NO_MIX
    mix_dialogues: int = 4
    mix_tokens: int = 2048
    grade: bool = True


# (dialogues, max tokens) when not given: builtin -> cabin sessions; any other data -> single dialogues.
DEFAULTS = {BUILTIN: (2, 4096), "other": (64, 2048)}


@dataclass
class CalibrationResult:
    """Scales (with per-channel ranges), the statistics behind them, how long it took and how good they are."""

    scales_file: ScalesFile
    stats: KVStats
    clips: LayerClips
    seconds: float
    candidates: list[CandidateScore] = field(default_factory=list)
    grade: dict[str, ModeResult] = field(default_factory=dict)


@dataclass
class _Part:
    """Dialogues of one source: for statistics, for validation, and their data summary."""

    stats: list[TokenizedDialogue]
    validation: list[TokenizedDialogue]
    summary: dict


def _source_part(data: str, split: str, count: int, seed: int, model: Checkpoint, max_tokens: int,
                 min_tokens: int, sessions: bool, validation: int) -> _Part:
    dialogues, summary = prepare_dialogues(data, split, count + validation, seed, model.tokenizer, max_tokens,
                                           min_tokens, sessions, model.vision, model.audio)
    held = [d.cut(VALIDATION_TOKENS) for d in dialogues[count:]]
    return _Part(dialogues[:count], held, summary)


def _parts(model: Checkpoint, request: CalibrationRequest, split: str, validation: int) -> list[_Part]:
    """The primary source and, for builtin data, the mixed-in general dialogue."""
    context = model.config.max_position_embeddings
    count, max_tokens = DEFAULTS[BUILTIN if request.data == BUILTIN else "other"]
    count = request.num_dialogues or count
    max_tokens = min(request.max_tokens or max_tokens, context)
    if split == "heldout":
        count, max_tokens = 0, min(VALIDATION_TOKENS, context)
    builtin = request.data == BUILTIN
    min_tokens = max_tokens if builtin else min(request.min_tokens, max_tokens)
    parts = [_source_part(request.data, split, count, request.seed, model, max_tokens, min_tokens, builtin,
                          validation)]
    if builtin and request.mix != NO_MIX:
        mix_tokens = min(request.mix_tokens if split == "train" else VALIDATION_TOKENS, context)
        try:
            parts.append(_source_part(request.mix, split, request.mix_dialogues if split == "train" else 0,
                                      request.seed, model, mix_tokens, mix_tokens, False, validation))
        except DataError as err:
            raise DataError(f"{err.message} (general dialogue mixed into builtin)",
                            (*err.hints, Hint(Fix.NO_MIX))) from err
    return parts


def describe_mix(data: dict) -> str:
    """One line on the general dialogue mixed into the calibration data ('' when none was)."""
    mixed = data.get("mixed")
    return f"{mixed['dialogues']} {mixed['source']} dialogues, {mixed['tokens']} tokens" if mixed else ""


def _data_summary(parts: list[_Part], context: int) -> dict:
    primary = parts[0].summary
    longest = max(len(d.token_ids) for p in parts for d in p.stats)
    primary = {key: value for key, value in primary.items() if key not in ("pictures", "clips")}  # counted again
    # without validation
    summary = {**primary, "dialogues": len(parts[0].stats), "tokens": sum(len(d.token_ids) for d in parts[0].stats),
               "ids": [d.id for d in parts[0].stats], "positions": {"longest": longest, "context": context},
               "validation_ids": [d.id for p in parts for d in p.validation], **media_summary(parts[0].stats)}
    if len(parts) > 1:
        mixed = parts[1].summary
        summary["mixed"] = {"source": mixed["source"], "dialogues": len(parts[1].stats),
                            "tokens": sum(len(d.token_ids) for d in parts[1].stats),
                            "ids": [d.id for d in parts[1].stats]}
    return summary


def common_first_token(dialogues: list[TokenizedDialogue]) -> int | None:
    """The token every dialogue starts with (the chat template's first), or None when they differ."""
    firsts = {d.token_ids[0] for d in dialogues}
    return firsts.pop() if len(firsts) == 1 else None


def short_coverage_warning(data: dict) -> DataError | None:
    """A warning (a DataError to show, not raise) when the scales saw positions covering much less than the engine's
    context, else None."""
    positions = data.get("positions")
    if not positions or positions["longest"] >= SHORT_COVERAGE * positions["context"]:
        return None
    return DataError(f"calibrated on sequences of at most {positions['longest']} tokens, the model holds "
                     f"{positions['context']}: K/V at later positions were never seen", (Hint(Fix.LONGER_DIALOGUES),))


def calibrate(model: Checkpoint, request: CalibrationRequest, progress: bool = True) -> CalibrationResult:
    """Collect K/V statistics on the train split of the data, compute scales by the requested method and grade
    them on the held-out split."""
    if request.method not in CALIBRATION_METHODS:
        raise ConfigError(f"unknown method {request.method!r}; choose one of {', '.join(CALIBRATION_METHODS)}")
    started = time.perf_counter()
    search = request.method == SEARCH_METHOD
    parts = _parts(model, request, "train", 1 if search else 0)
    summary = _data_summary(parts, model.config.max_position_embeddings)
    stats = collect_stats(model.transformer(), [d for p in parts for d in p.stats], progress=progress)
    first_token = common_first_token([d for p in parts for d in p.stats + p.validation])
    if first_token is not None:
        summary[FIRST_TOKEN] = first_token
    candidates: list[CandidateScore] = []
    if search:
        rule, searched, candidates = choose_clips(model, stats, [d for p in parts for d in p.validation],
                                                  progress=progress, first_token=first_token)
        # the search scores the equalized mode, which reads only the channel clips; the one scale per layer of
        # the unequalized modes is set by outliers, so it takes the percentile clip
        clips = replace(compute_clips(stats, "percentile", request.percentile), k_channel=searched.k_channel,
                        v_channel=searched.v_channel)
        method = f"{SEARCH_METHOD}:{rule.name}"
        summary["clip_search"] = [asdict(c) for c in candidates]
    else:
        clips = compute_clips(stats, request.method, request.percentile)
        method = f"percentile-{request.percentile:g}" if request.method == "percentile" else request.method
    if stats.by_kind:
        summary[BY_KIND] = kind_ranges(stats, clips)
    scales_file = ScalesFile(clips.scales(), model.fingerprint, method, summary, layer_ranges(stats, clips))
    grade = _grade(model, request, scales_file, progress) if request.grade else {}
    if grade:
        summary["grade"] = {mode: {k: v for k, v in asdict(r).items() if k != "by_position"}
                            for mode, r in grade.items()}
    seconds = time.perf_counter() - started
    summary["seconds"] = round(seconds, 1)
    return CalibrationResult(scales_file, stats, clips, seconds, candidates, grade)


def _grade(model: Checkpoint, request: CalibrationRequest, scales_file: ScalesFile,
           progress: bool) -> dict[str, ModeResult]:
    """The scales' accuracy on held-out dialogues of the same sources ({} when the data has none)."""
    try:
        parts = _parts(model, request, "heldout", 1)
    except DataError:
        return {}
    dialogues = [d for p in parts for d in p.validation]
    results = evaluate(model, dialogues, list(GRADE_MODES), scales_file, progress=progress)
    scales_file.data["grade_ids"] = [d.id for d in dialogues]
    return results


def write_scales(path: str | Path, scales_file: ScalesFile) -> None:
    """Write a ScalesFile as kv_scales.json (atomically)."""
    save_scales(path, scales_file.scales, scales_file.fingerprint, scales_file.method, scales_file.data,
                scales_file.ranges, scales_file.equalized)
