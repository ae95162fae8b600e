"""``cabin-calibrate``: per-layer INT8 K/V scales from real dialogues, written as kv_scales.json plus a report."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibration.calibrate import CalibrationRequest, calibrate, write_scales
from calibration.dialogues import DataError
from calibration.report import write_calibration_report
from calibration.scales import DEFAULT_PERCENTILE, METHODS
from runtime.checkpoint import CheckpointError
from runtime.cli_args import float_range, int_range, non_negative_int, os_error_message, positive_int
from runtime.model_source import load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-calibrate."""
    parser = argparse.ArgumentParser(
        prog="cabin-calibrate",
        description="Run the model over dialogues (train split), collect per-layer K/V statistics and write "
                    "static INT8 KV scales (kv_scales.json, with per-channel ranges for equalization).")
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), an engine or checkpoint folder, "
                             "a .gguf file or an HF model folder")
    parser.add_argument("--data", default="builtin",
                        help="'builtin' (cockpit dialogues), 'sharegpt' (packaged ShareGPT V3), a .jsonl file "
                             "(OpenAI messages) or a ShareGPT .json file")
    parser.add_argument("--num-dialogues", type=positive_int, default=64, help="dialogues to calibrate on (default 64)")
    parser.add_argument("--max-tokens", type=int_range(2), default=2048,
                        help="tokens per dialogue at most (default 2048)")
    parser.add_argument("--min-tokens", type=non_negative_int, default=0,
                        help="use only dialogues with at least this many tokens (default 0)")
    parser.add_argument("--method", default="max", choices=METHODS, help="how a layer's clip is chosen")
    parser.add_argument("--percentile", type=float_range(0, 100), default=DEFAULT_PERCENTILE,
                        help=f"percentile of |x| for --method percentile (default {DEFAULT_PERCENTILE})")
    parser.add_argument("--seed", type=int, default=0, help="selects which dialogues are used (default 0)")
    parser.add_argument("--output", type=Path, default=Path("kv_scales.json"), help="scales file to write")
    parser.add_argument("--report", type=Path, help="folder for the report (ranges plot, clip rates, summary.md)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    request = CalibrationRequest(args.data, args.num_dialogues, args.max_tokens, args.min_tokens, args.method,
                                 args.percentile, args.seed)
    try:
        model = load_model(args.model)
        result = calibrate(model, request)
    except (CheckpointError, DataError, ValueError) as err:
        print(f"cabin-calibrate: error: {err}", file=sys.stderr)
        return 2
    try:
        write_scales(args.output, result.scales_file)
    except OSError as err:
        print(f"cabin-calibrate: error: {os_error_message(err, args.output)}", file=sys.stderr)
        return 2
    data = result.scales_file.data
    print(f"calibrated {data['dialogues']} dialogues, {data['tokens']} tokens in {result.seconds:.1f} s "
          f"({data['records']} records read, {data['skipped_malformed']} malformed skipped"
          f"{', file cut off mid-record' if data['truncated_tail'] else ''}) -> {args.output}", file=sys.stderr)
    if args.report:
        try:
            write_calibration_report(args.report, model.name, result, " ".join(["cabin-calibrate", *sys.argv[1:]]))
        except OSError as err:
            print(f"cabin-calibrate: error: {os_error_message(err, args.report)}", file=sys.stderr)
            return 2
        print(f"report written to {args.report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
