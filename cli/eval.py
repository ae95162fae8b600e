"""``cabin-eval``: perplexity, KL and top-1 agreement of KV cache modes and weight formats on held-out dialogues."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cabinllm.calibration.calibrate import CalibrationRequest, calibrate
from cabinllm.calibration.charts import plot_accuracy
from cabinllm.calibration.evaluate import (EVAL_MODES, REFERENCE_MODE, REFERENCE_WEIGHTS, WEIGHTS_SEPARATOR,
                                           ModeResult, eval_mode, evaluate, results_json)
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.calibration.weight_quant import (CALIBRATED_WEIGHTS, DEFAULT_CALIB_DIALOGUES, DEFAULT_CALIB_TOKENS,
                                               EVAL_WEIGHTS, INT8_HEAD, calibration_tokens, eval_weights)
from cabinllm.cli.args import (add_device_flag, add_kv_cache, cli_message, entry_point, int_range, non_negative_int,
                               os_error_message, output_name, positive_int)
from cabinllm.runtime.errors import CabinError, ConfigError
from cabinllm.runtime.formats.atomic import atomic_write_text
from cabinllm.runtime.formats.scales_file import ScalesFile, load_scales_file
from cabinllm.runtime.model.cuda import check_device
from cabinllm.runtime.sources.model_source import Checkpoint, load_model, open_source, resolve_model

RESULTS_JSON = "eval.json"
EVAL_SPLITS = ("heldout", "all")
DEFAULT_EVAL_DIALOGUES = 8
BUILTIN_SETS = ("builtin", "sharegpt")
CALIBRATED_NOW = "calibrated now"
CHART_PNG = "accuracy.png"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-eval."""
    parser = argparse.ArgumentParser(
        prog="cabin-eval",
        description="Teacher-forced accuracy of KV cache modes against full precision (fp32 KV) on held-out "
                    "dialogues (or every dialogue of a file you bring): perplexity, mean KL of next-token "
                    "distributions, top-1 agreement, and KL and top-1 per bucket of token positions.")
    parser.add_argument("--model", default="default", help="'default', an engine or checkpoint folder, a .gguf "
                                                           "file or an HF model folder")
    parser.add_argument("--data", default="builtin",
                        help="'builtin', 'sharegpt', a .jsonl (a vision-language engine's may show pictures: "
                             "\"images\" on user messages) or a ShareGPT .json file")
    add_kv_cache(parser, "the KV modes to measure (-eq: on equalized weights)", tuple(EVAL_MODES), many=True)
    parser.add_argument("--weights", default=REFERENCE_WEIGHTS,
                        help=f"comma-separated weights to measure, each alone (fp32 KV) and with each --kv-cache mode: "
                             f"{', '.join(EVAL_WEIGHTS)}; int8 and int4-awq are quantized with ModelOpt on "
                             f"{DEFAULT_CALIB_DIALOGUES} train dialogues of --data ({DEFAULT_CALIB_TOKENS} tokens "
                             "each), int4-rtn rounds to nearest on the same groups, int4-g32 takes a GGUF's Q4_0 / "
                             f"Q4_1 blocks as stored (int4-g32-a8: on int8 activations; {INT8_HEAD}: and its Q8_0 "
                             "embedding as the int8 head); "
                             "the -eq modes run on fp32 "
                             "weights only (default fp32: weights as loaded)")
    parser.add_argument("--scales", type=Path,
                        help="kv_scales.json from cabin-calibrate; default: the engine's own if it has channel "
                             "ranges, else a calibration on the train split of --data")
    parser.add_argument("--split", choices=EVAL_SPLITS,
                        help="which dialogues of --data to evaluate: 'heldout' (the part cabin-calibrate never "
                             "trains on) or 'all' (every dialogue); default: heldout for builtin and sharegpt, "
                             "all for a file you bring unless cabin-eval calibrates on that file now (no scales "
                             "given), then heldout")
    parser.add_argument("--num-dialogues", type=positive_int,
                        help=f"dialogues to evaluate (default: {DEFAULT_EVAL_DIALOGUES} with --split heldout, "
                             "every dialogue with --split all)")
    parser.add_argument("--max-tokens", type=int_range(2), default=2048,
                        help="tokens per dialogue at most (default 2048)")
    parser.add_argument("--min-tokens", type=non_negative_int, default=0,
                        help="use only dialogues with at least this many tokens (default 0)")
    parser.add_argument("--sessions", action="store_true",
                        help="stitch consecutive dialogues of the split into sessions of at least --min-tokens "
                             "tokens (parts of one conversation together), for positions no single dialogue "
                             "reaches, e.g. --max-tokens 8192 --min-tokens 8192")
    parser.add_argument("--calib-dialogues", type=positive_int, default=16,
                        help="train dialogues (sessions for builtin) for the calibration made when no scales are "
                             "given, by cabin-calibrate's default method (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="selects which dialogues are used (default 0)")
    parser.add_argument("--json", action="store_true", help="print the JSON object instead of the table")
    parser.add_argument("--output", type=Path, default=Path("eval_report"),
                        help=f"folder for {RESULTS_JSON} and {CHART_PNG} (default eval_report)")
    add_device_flag(parser)
    return parser.parse_args(argv)


def resolve_scales(args: argparse.Namespace, model: Checkpoint, modes: list[str]) -> tuple[ScalesFile | None, str]:
    """The scales the static modes use, and where they came from."""
    if not any(eval_mode(m).kv_mode.static_scales for m in modes):
        return None, "none needed"
    kv_shape = (model.config.num_key_value_heads, model.config.head_size)
    layers = model.config.num_hidden_layers
    if args.scales:
        return load_scales_file(args.scales, model.fingerprint, layers, kv_shape), str(args.scales)
    if model.scales_path:
        found = load_scales_file(model.scales_path, model.fingerprint, layers, kv_shape)
        if found.ranges is not None or not any(eval_mode(m).equalized for m in modes):
            return found, str(model.scales_path)
    request = CalibrationRequest(args.data, args.calib_dialogues, args.max_tokens, args.min_tokens, seed=args.seed,
                                 grade=False)
    print(f"cabin-eval: no scales given; calibrating on {args.calib_dialogues} train dialogues of {args.data}",
          file=sys.stderr)
    result = calibrate(model, request)
    method = result.scales_file.method
    return result.scales_file, f"{CALIBRATED_NOW}: {args.calib_dialogues} train dialogues of {args.data}, {method}"


def eval_split(args: argparse.Namespace, scales_source: str) -> str:
    """The split evaluated: --split if given, else heldout for the built-in sets and when the scales were
    calibrated now on the train split of --data, all for a file the user brings."""
    if args.split:
        return args.split
    return "heldout" if args.data in BUILTIN_SETS or scales_source.startswith(CALIBRATED_NOW) else "all"


def format_table(results: dict[str, ModeResult]) -> str:
    """The results as an aligned text table."""
    w = max(10, *(len(r.weights) + 2 for r in results.values()))
    rows = [f"{'weights':<{w}}{'weight MB':>10}  {'KV mode':<16}{'bytes/token':>12}{'perplexity':>12}{'vs fp32':>10}"
            f"{'KL':>11}{'top-1 agree':>13}"]
    for mode, r in results.items():
        delta = "-" if mode == REFERENCE_MODE else f"{r.ppl_delta_pct:+.2f}%"
        kv = mode.split(WEIGHTS_SEPARATOR)[-1]
        rows.append(f"{r.weights:<{w}}{r.weight_bytes / 1e6:>10.1f}  {kv:<16}{r.kv_bytes_per_token:>12}"
                    f"{r.ppl:>12.4f}{delta:>10}{r.kl:>11.5f}{100 * r.top1_agree:>12.2f}%")
    return "\n".join(rows)


def quantized_weights(names: list[str], model: Checkpoint, source: str, data: str, seed: int) -> dict:
    """Each requested weights entry other than fp32, made from the model's full-precision weights (int4-g32 from
    the blocks of ``source``, the --model argument, where it is a GGUF)."""
    names = [n for n in names if n != REFERENCE_WEIGHTS]
    if not names:
        return {}
    if model.config.weight_format.quant_algo is not None:
        raise ConfigError(f"--weights {','.join(names)} quantizes full-precision weights, and {model.name} is "
                         f"{model.config.weight_format.quant_algo}; give the full-precision model")
    tokens = calibration_tokens(data, model.tokenizer, seed=seed) if set(names) & set(CALIBRATED_WEIGHTS) else []
    path = resolve_model(source)
    blocks = open_source(path) if path.suffix == ".gguf" else None  # int4-g32 takes a GGUF's blocks
    return {name: eval_weights(name, model.config, model.weights, tokens, source=blocks) for name in names}


def format_position_table(results: dict[str, ModeResult]) -> str:
    """KL and top-1 agreement of each mode per bucket of positions (with its token count), as an aligned table."""
    return _split_table(results, "by_position", "tok", 22)


def format_kind_table(results: dict[str, ModeResult]) -> str:
    """KL and top-1 agreement of each mode at text and at image positions ('' where no dialogue shows pictures)."""
    return _split_table(results, "by_kind", "positions", 28) if results[REFERENCE_MODE].by_kind else ""


def _split_table(results: dict[str, ModeResult], split: str, unit: str, width: int) -> str:
    """KL / top-1 of each mode in each part of a split of the positions (a ModeResult field), aligned."""
    parts = getattr(results[REFERENCE_MODE], split)
    w = max(16, *(len(mode) + 2 for mode in results))
    rows = [f"{'KL / top-1 at':<{w}}" + "".join(f"{f'{p} ({n.tokens} {unit})':>{width}}" for p, n in parts.items())]
    for mode, r in results.items():
        if mode != REFERENCE_MODE:
            cells = getattr(r, split)
            rows.append(f"{mode:<{w}}" + "".join(
                f"{f'{cells[p].kl:.5f} / {100 * cells[p].top1_agree:.2f}%':>{width}}" for p in parts))
    return "\n".join(rows)


@entry_point("cabin-eval")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    modes = [m.strip() for m in args.kv_cache.split(",") if m.strip()]
    started = time.perf_counter()
    try:
        check_device(args.device)  # before anything loads
        unknown = [m for m in modes if eval_mode(m) is None]
        if unknown or not modes:
            raise ConfigError(f"unknown --kv-cache mode(s) {unknown}; choose from {', '.join(EVAL_MODES)}")
        weight_names = [w.strip() for w in args.weights.split(",") if w.strip()]
        unknown = [w for w in weight_names if w not in EVAL_WEIGHTS]
        if unknown or not weight_names:
            raise ConfigError(f"unknown --weights {unknown}; choose from {', '.join(EVAL_WEIGHTS)}")
        model = load_model(args.model)
        scales, scales_source = resolve_scales(args, model, modes)
        split = eval_split(args, scales_source)
        if split == "all" and scales_source.startswith(CALIBRATED_NOW):
            print("cabin-eval: warning: --split all also evaluates the train dialogues the scales were just "
                  "calibrated on; pass --scales or --split heldout for an unbiased figure", file=sys.stderr)
        count = args.num_dialogues or (DEFAULT_EVAL_DIALOGUES if split == "heldout" else None)
        dialogues, data = prepare_dialogues(args.data, split, count, args.seed, model.tokenizer,
                                            args.max_tokens, args.min_tokens, args.sessions, model.vision,
                                            model.audio)
        weights = quantized_weights(weight_names, model, args.model, args.data, args.seed)
        results = evaluate(model, dialogues, modes, scales, weights=weights, device=args.device)
    except CabinError as err:
        print(f"cabin-eval: error: {cli_message(err)}", file=sys.stderr)
        return 2
    table = "\n\n".join(t for t in (format_table(results), format_position_table(results),
                                      format_kind_table(results)) if t)
    record = {"modes": results_json(results), "model": model.name, "scales": scales_source, "data": data,
              "seconds": round(time.perf_counter() - started, 1),
              "command": " ".join(["cabin-eval", *sys.argv[1:]] if argv is None else ["cabin-eval", *argv])}
    try:
        args.output.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.output / RESULTS_JSON, json.dumps(record, indent=2))
        plot_accuracy(results, args.output / CHART_PNG,
                      f"{model.name} on {data['dialogues']} {split} {args.data} dialogues, {data['tokens']} tokens")
    except OSError as err:
        print(f"cabin-eval: error: {os_error_message(err, args.output)}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(results_json(results), indent=2), flush=True)
        else:
            print(f"{data['dialogues']} {split} dialogues of {args.data}, {data['tokens']} tokens; "
                  f"scales: {scales_source}")
            print(table, flush=True)
    except OSError as err:  # a full disk under --json > FILE
        print(f"cabin-eval: error: {os_error_message(err, output_name(sys.stdout))}", file=sys.stderr)
        return 2
    print(f"results in {args.output / RESULTS_JSON} and {args.output / CHART_PNG}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
