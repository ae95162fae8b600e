"""``cabin-calibrate``: per-layer INT8 K/V scales from real dialogues, written as kv_scales.json plus a report."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from cabinllm.calibration.calibrate import (BUILTIN, CALIBRATION_METHODS, DEFAULTS, CalibrationRequest, calibrate,
                                            describe_mix, short_coverage_warning, write_scales)
from cabinllm.calibration.clip_search import CANDIDATES, SEARCH_METHOD
from cabinllm.calibration.clips import DEFAULT_PERCENTILE
from cabinllm.calibration.report import write_calibration_report
from cabinllm.cli.args import (cli_message, entry_point, float_range, int_range, non_negative_int, os_error_message,
                               positive_int)
from cabinllm.runtime.errors import CabinError
from cabinllm.runtime.sources.model_source import load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-calibrate."""
    parser = argparse.ArgumentParser(
        prog="cabin-calibrate",
        description="Run the model over dialogues (train split), collect per-layer K/V statistics and write "
                    "static INT8 KV scales (kv_scales.json, with per-channel ranges for equalization); grade them "
                    "on held-out dialogues of the same data.")
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), an engine or checkpoint folder, "
                             "a .gguf file or an HF model folder")
    parser.add_argument("--data", default="builtin",
                        help="'builtin' (cockpit dialogues), 'sharegpt' (packaged ShareGPT V3), a .jsonl file "
                             "(OpenAI messages; on a vision-language engine a user message may show pictures: "
                             "\"images\": [paths from the file's folder]) or a ShareGPT .json file")
    parser.add_argument("--num-dialogues", type=positive_int,
                        help="sessions (builtin) or dialogues to collect statistics on (default: "
                             f"{DEFAULTS[BUILTIN][0]} cabin sessions for builtin, {DEFAULTS['other'][0]} dialogues "
                             "otherwise)")
    parser.add_argument("--max-tokens", type=int_range(2),
                        help="tokens per session or dialogue at most, capped at the model's context (default: "
                             f"{DEFAULTS[BUILTIN][1]} for builtin, whose sessions are stitched to this length, "
                             f"{DEFAULTS['other'][1]} otherwise)")
    parser.add_argument("--min-tokens", type=non_negative_int, default=0,
                        help="use only dialogues with at least this many tokens (default 0; not for builtin, whose "
                             "sessions have --max-tokens)")
    parser.add_argument("--mix", default="sharegpt",
                        help="general dialogue mixed into builtin cabin sessions, its train split: 'sharegpt' "
                             "(packaged ShareGPT V3), a .jsonl or ShareGPT .json file, or 'none' (default sharegpt)")
    parser.add_argument("--mix-dialogues", type=positive_int, default=CalibrationRequest.mix_dialogues,
                        help=f"mixed-in dialogues of up to {CalibrationRequest.mix_tokens} tokens "
                             f"(default {CalibrationRequest.mix_dialogues})")
    parser.add_argument("--method", default=SEARCH_METHOD, choices=CALIBRATION_METHODS,
                        help="how clips are chosen: 'kl' scores the clip rules "
                             f"{', '.join(r.name for r in CANDIDATES)} (per channel) "
                             "by the next-token KL of int8-eq (equalized, the first token's K/V stored exactly; "
                             "the file records that token) against full precision on a validation part of the data, "
                             "and keeps the first unless a later one is lower by more than 2 standard errors, for "
                             "the channel clips equalization uses, "
                             "and the --percentile clip for the one scale per layer of the unequalized modes; "
                             "'max', 'percentile' and 'mse' (least per-tensor INT8 error) read every clip from the "
                             "statistics alone (default kl)")
    parser.add_argument("--percentile", type=float_range(0, 100), default=DEFAULT_PERCENTILE,
                        help=f"percentile of |x| for --method percentile, and for the per-layer scales of --method "
                             f"kl (default {DEFAULT_PERCENTILE})")
    parser.add_argument("--no-grade", dest="grade", action="store_false",
                        help="skip grading the scales on held-out dialogues of the same data")
    parser.add_argument("--seed", type=int, default=0, help="selects which dialogues are used (default 0)")
    parser.add_argument("--output", type=Path, default=Path("kv_scales.json"),
                        help="scales file to write (default kv_scales.json)")
    parser.add_argument("--report", type=Path, help="folder for the report (ranges plot, clip rates, summary.md)")
    return parser.parse_args(argv)


@entry_point("cabin-calibrate")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    request = CalibrationRequest(args.data, args.num_dialogues, args.max_tokens, args.min_tokens, args.method,
                                 args.percentile, args.seed, args.mix, args.mix_dialogues, grade=args.grade)
    try:
        model = load_model(args.model)
        result = calibrate(model, request)
    except CabinError as err:
        print(f"cabin-calibrate: error: {cli_message(err)}", file=sys.stderr)
        return 2
    try:
        write_scales(args.output, result.scales_file)
    except OSError as err:
        print(f"cabin-calibrate: error: {os_error_message(err, args.output)}", file=sys.stderr)
        return 2
    data = result.scales_file.data
    print(f"calibrated {data['dialogues']} dialogues, {data['tokens']} tokens in {result.seconds:.1f} s "
          f"({data['records']} records read, {data['skipped_malformed']} malformed skipped"
          f"{', file cut off mid-record' if data['truncated_tail'] else ''})"
          f"{'; mixed in ' + describe_mix(data) if describe_mix(data) else ''}; method {result.scales_file.method}"
          f" -> {args.output}", file=sys.stderr)
    warning = short_coverage_warning(data)
    if warning:
        print(f"cabin-calibrate: warning: {cli_message(warning)}", file=sys.stderr)
    for mode, r in list(result.grade.items())[1:]:  # after the fp32 reference
        print(f"held-out grade {mode:<15} perplexity {r.ppl_delta_pct:+.2f}%  KL {r.kl:.5f}  "
              f"top-1 {100 * r.top1_agree:.2f}%", file=sys.stderr)
    if args.report:
        try:
            command = shlex.join(["cabin-calibrate", *(sys.argv[1:] if argv is None else argv)])
            write_calibration_report(args.report, model.name, result, command)
        except OSError as err:
            print(f"cabin-calibrate: error: {os_error_message(err, args.report)}", file=sys.stderr)
            return 2
        print(f"report written to {args.report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
