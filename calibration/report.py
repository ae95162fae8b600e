"""The calibration report folder: ranges plot, per-layer table with clip rates, markdown summary."""
from __future__ import annotations

from pathlib import Path

from calibration.calibrate import CalibrationResult
from calibration.charts import plot_ranges
from runtime.atomic import atomic_write_text

RANGES_PNG = "ranges.png"
SUMMARY_MD = "summary.md"


def summary_markdown(model_name: str, result: CalibrationResult, command: str) -> str:
    """The markdown summary: what was measured on which data, and each layer's ranges, scales and clip rates."""
    data, stats, clips, scales = result.scales_file.data, result.stats, result.clips, result.scales_file.scales
    lines = [
        "# KV calibration report", "",
        f"- model: `{model_name}` (fingerprint `{result.scales_file.fingerprint}`)",
        f"- command: `{command}`",
        f"- data: `{data['source']}`, split `{data['split']}`, seed {data['seed']}: {data['dialogues']} dialogues, "
        f"{data['tokens']} tokens (at most {data['max_tokens']} per dialogue)",
        f"- records read: {data['records']}, malformed skipped: {data['skipped_malformed']}"
        + (f" {data['skip_reasons']}" if data['skip_reasons'] else "")
        + (", file cut off mid-record (read up to the last complete record)" if data['truncated_tail'] else ""),
        f"- method: `{result.scales_file.method}`; scale = clip / 127; shared TensorRT-LLM scale = max(K, V)",
        f"- time: {result.seconds:.1f} s", "",
        f"![K/V ranges per layer]({RANGES_PNG})", "",
        "| layer | K abs-max | V abs-max | K clip | V clip | K scale | V scale | shared scale "
        "| V levels with shared scale | K clipped % | V clipped % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, shared in enumerate(scales.shared()):
        lines.append(f"| {i} | {float(stats.k.layer_amax[i]):.3f} | {float(stats.v.layer_amax[i]):.3f} "
                     f"| {clips.k[i]:.3f} | {clips.v[i]:.3f} | {scales.k[i]:.5f} | {scales.v[i]:.5f} | {shared:.5f} "
                     f"| {clips.v[i] / shared:.0f} of 127 "
                     f"| {100 * clips.k_clip_rate[i]:.4f} | {100 * clips.v_clip_rate[i]:.4f} |")
    levels = [v / s for v, s in zip(clips.v, scales.shared())]
    lines += ["", f"With one shared scale per layer (TensorRT-LLM's format), V uses {min(levels):.0f} to "
              f"{max(levels):.0f} of the 127 INT8 levels; KV equalization (int8-shared-eq) gives every layer "
              "all of them.", ""]
    return "\n".join(lines)


def write_calibration_report(folder: Path, model_name: str, result: CalibrationResult, command: str) -> None:
    """Write ranges.png and summary.md into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    plot_ranges(result.stats, result.clips, folder / RANGES_PNG)
    atomic_write_text(folder / SUMMARY_MD, summary_markdown(model_name, result, command))
