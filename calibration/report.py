"""The calibration report folder: ranges plot, per-layer table with clip rates, markdown summary."""
from __future__ import annotations

from pathlib import Path

from cabinllm.calibration.calibrate import BY_KIND, CalibrationResult, describe_mix, short_coverage_warning
from cabinllm.calibration.charts import plot_kind_ranges, plot_ranges
from cabinllm.runtime.formats.atomic import atomic_write_text

RANGES_PNG = "ranges.png"
KIND_RANGES_PNG = "ranges_by_kind.png"  # where the data shows pictures or holds clips
SUMMARY_MD = "summary.md"


def summary_markdown(model_name: str, result: CalibrationResult, command: str) -> str:
    """The markdown summary: what was measured on which data, and each layer's ranges, scales and clip rates."""
    data, stats, clips, scales = result.scales_file.data, result.stats, result.clips, result.scales_file.scales
    lines = [
        "# KV calibration report", "",
        f"- model: `{model_name}` (fingerprint `{result.scales_file.fingerprint}`)",
        f"- command: `{command}`",
        f"- data: `{data['source']}`, split `{data['split']}`, seed {data['seed']}: {data['dialogues']} "
        f"{'sessions' if data.get('sessions') else 'dialogues'}, {data['tokens']} tokens "
        f"(at most {data['max_tokens']} per {'session' if data.get('sessions') else 'dialogue'})",
        f"- records read: {data['records']}, malformed skipped: {data['skipped_malformed']}"
        + (f" {data['skip_reasons']}" if data['skip_reasons'] else "")
        + (", file cut off mid-record (read up to the last complete record)" if data['truncated_tail'] else ""),
        f"- method: `{result.scales_file.method}`; scale = clip / 127; shared TensorRT-LLM scale = max(K, V)",
        f"- time: {result.seconds:.1f} s",
    ]
    if describe_mix(data):
        lines.append(f"- mixed in: {describe_mix(data)} (train split)")
    positions = data.get("positions")
    if positions:
        lines.append(f"- token positions covered: 0 to {positions['longest']} of the model's context of "
                     f"{positions['context']} ({100 * positions['longest'] / positions['context']:.0f}%)")
    warning = short_coverage_warning(data)
    if warning:
        lines.append(f"- **warning**: {warning}")
    lines += _candidate_lines(result) + _grade_lines(result) + [
        "",
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
              f"{max(levels):.0f} of the 127 INT8 levels; KV equalization (int8-eq) gives every layer "
              "all of them.", ""]
    return "\n".join(lines + _kind_lines(data.get(BY_KIND)))


def _kind_lines(kinds: dict | None) -> list[str]:
    """K/V ranges at image (or audio) positions beside text positions, where the data shows pictures (holds
    clips)."""
    if not kinds:
        return []
    kind = next(k for k in kinds if k != "text")
    text, image = kinds["text"], kinds[kind]
    lines = [f"## K/V at {kind} and text positions ({image['positions']} {kind}, {text['positions']} text positions)",
             "", f"The scales cover both; a layer whose {kind} K or V reaches past the clip loses those values.", "",
             f"![K/V at text and {kind} positions]({KIND_RANGES_PNG})", "",
             f"| layer | K abs-max text | K abs-max {kind} | V abs-max text | V abs-max {kind} "
             f"| K clipped % text / {kind} | V clipped % text / {kind} |", "|---|---|---|---|---|---|---|"]
    for i in range(len(text["k_amax"])):
        lines.append(f"| {i} | {text['k_amax'][i]:.3f} | {image['k_amax'][i]:.3f} | {text['v_amax'][i]:.3f} "
                     f"| {image['v_amax'][i]:.3f} | {text['k_clipped_pct'][i]:.4f} / {image['k_clipped_pct'][i]:.4f} "
                     f"| {text['v_clipped_pct'][i]:.4f} / {image['v_clipped_pct'][i]:.4f} |")
    return lines + [""]


def _candidate_lines(result: CalibrationResult) -> list[str]:
    if not result.candidates:
        return []
    validation = result.scales_file.data.get("validation_ids", [])
    lines = ["", f"## Clips chosen by next-token KL ({len(validation)} validation sequences, never in the statistics)",
             "", "| clip rule | KL of int8-eq | top-1 agreement |", "|---|---|---|"]
    chosen = result.scales_file.method.split(":", 1)[-1]
    for c in result.candidates:
        mark = " (chosen)" if c.rule == chosen else ""
        lines.append(f"| {c.rule}{mark} | {c.kl:.5f} | {100 * c.top1_agree:.2f}% |")
    return lines


def _grade_lines(result: CalibrationResult) -> list[str]:
    if not result.grade:
        return ["", "No held-out dialogue of this data to grade the scales on."]
    ids = result.scales_file.data.get("grade_ids", [])
    positions = sum(b.tokens for b in next(iter(result.grade.values())).by_position.values())
    split = set(result.grade["fp32"].by_kind) == {"text", "image"}  # KL at text and at image positions
    lines = ["", f"## Grade on held-out data ({len(ids)} sequences of the held-out split, {positions} positions)", "",
             "| KV mode | perplexity vs fp32 | KL | top-1 agreement |" + (" KL text / image |" if split else ""),
             "|---|---|---|---|" + ("---|" if split else "")]
    for mode, r in result.grade.items():
        if mode != "fp32":
            kinds = f" {r.by_kind['text'].kl:.5f} / {r.by_kind['image'].kl:.5f} |" if split else ""
            lines.append(f"| {mode} | {r.ppl_delta_pct:+.2f}% | {r.kl:.5f} | {100 * r.top1_agree:.2f}% |{kinds}")
    return lines


def write_calibration_report(folder: Path, model_name: str, result: CalibrationResult, command: str) -> None:
    """Write ranges.png (and ranges_by_kind.png where the data shows pictures) and summary.md into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    plot_ranges(result.stats, result.clips, folder / RANGES_PNG)
    if result.scales_file.data.get(BY_KIND):
        plot_kind_ranges(result.scales_file.data[BY_KIND], result.clips, folder / KIND_RANGES_PNG)
    atomic_write_text(folder / SUMMARY_MD, summary_markdown(model_name, result, command))
