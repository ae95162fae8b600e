"""INT8 KV with pictures on the random-weight model of SmolVLM-256M's shape (cabinllm.benchmarks.studies.vlm_bench):
calibration on built-in cabin dialogues whose first user message shows a camera picture, the K/V ranges at image
positions beside text positions, and the held-out KL / top-1 of the INT8 modes at text and at image positions.
Random weights show the mechanics (where a picture's K/V sit against the scales), never answer quality.

    python -m cabinllm.benchmarks.studies.vlm_calibration [--work DIR] [--dialogues N] [--heldout N]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.random_vlm import picture_dialogues
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.benchmarks.studies.vlm_bench import SHAPE, prepare_model
from cabinllm.calibration.calibrate import BY_KIND, GRADE_MODES, CalibrationRequest, calibrate
from cabinllm.calibration.evaluate import evaluate
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.cli.args import positive_int
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.sources.model_source import load_model

PICTURE = (640, 360)  # a camera frame at half size (the processor scales it up: 4 tiles and the global view)
MAX_TOKENS = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.vlm_calibration",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("out/vlm_bench"), help="where the model and data go")
    parser.add_argument("--dialogues", type=positive_int, default=6, help="train dialogues for the statistics")
    parser.add_argument("--heldout", type=positive_int, default=4, help="held-out dialogues graded")
    parser.add_argument("--output", type=Path, default=RESULTS / "vlm_calibration", help="results path, no suffix")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    CPU_THREADS.use(1)
    _, engine = prepare_model(args.work)
    folder = args.work / "picture_dialogues"
    folder.mkdir(parents=True, exist_ok=True)
    data = str(picture_dialogues(folder, 200, PICTURE))
    model = load_model(str(engine.folder))
    found = calibrate(model, CalibrationRequest(data, args.dialogues, MAX_TOKENS, grade=False))
    heldout, summary = prepare_dialogues(data, "heldout", args.heldout, 0, model.tokenizer, MAX_TOKENS,
                                         vision=model.vision)
    grade = evaluate(model, heldout, list(GRADE_MODES), found.scales_file)
    result = {"machine": machine_info(), "command": " ".join(["python -m cabinllm.benchmarks.studies.vlm_calibration",
                                                               *(argv or sys.argv[1:])]),
              "model": f"random weights, {SHAPE} shape", "picture": list(PICTURE), "method": found.scales_file.method,
              "calibration": {k: found.scales_file.data[k] for k in ("dialogues", "tokens", "pictures", BY_KIND)},
              "clips": {"k": found.clips.k, "v": found.clips.v}, "heldout": {k: summary[k] for k in
                                                                           ("dialogues", "tokens", "pictures")},
              "grade": {mode: asdict(r) for mode, r in grade.items()}, "seconds": round(found.seconds, 1)}
    write_results(args.output, result, table(result))
    return 0


def table(result: dict) -> str:
    """The results as a short Markdown page."""
    kinds, cal, held = result["calibration"][BY_KIND], result["calibration"], result["heldout"]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return "\n".join([
        f"# INT8 KV with pictures ({SHAPE} shape, random weights: mechanics, not answer quality; 1 thread)", "",
        f"Load average {result['machine']['load_average_1m']:.2f}. Command: `{result['command']}`. Calibration "
        f"({result['method']}): {cal['dialogues']} built-in dialogues, {cal['tokens']} tokens, {cal['pictures']['count']}"
        f" pictures of {result['picture'][0]}x{result['picture'][1]}; graded on {held['dialogues']} held-out ones "
        f"({held['tokens']} tokens, {held['pictures']['image_positions']} image positions).", "",
        "| positions | count | K abs-max, max over layers | V abs-max, max over layers "
        "| K beyond the clip %, mean over layers | V beyond the clip % |", "|---|---|---|---|---|---|",
        *(f"| {name} | {kind['positions']} | {max(kind['k_amax']):.3f} | {max(kind['v_amax']):.3f} | "
          f"{mean(kind['k_clipped_pct']):.4f} | {mean(kind['v_clipped_pct']):.4f} |" for name, kind in kinds.items()),
        "", "| KV mode | perplexity vs fp32 (text targets) | KL text | KL image | top-1 text | top-1 image |",
        "|---|---|---|---|---|---|",
        *(f"| {mode} | {r['ppl_delta_pct']:+.3f}% | {r['by_kind']['text']['kl']:.2e} | "
          f"{r['by_kind']['image']['kl']:.2e} | {100 * r['by_kind']['text']['top1_agree']:.2f}% | "
          f"{100 * r['by_kind']['image']['top1_agree']:.2f}% |" for mode, r in result["grade"].items()
          if mode != "fp32"), ""])


if __name__ == "__main__":
    sys.exit(main())
