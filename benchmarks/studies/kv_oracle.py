"""The floor of static INT8 KV scales on a set of dialogues: scales fitted on those very dialogues.

No calibration can know the evaluated dialogues better than they know themselves, so int8-eq with
per-channel clips taken from the dialogues it is measured on (abs-max, or a percentile) is what TensorRT-LLM's
format (one scale per layer, equalization folded into the weights, the first token on the grid) can reach on
them. int8-dynamic (a scale per token and KV head) runs beside it on the same reference. Compare with
``cabin-eval --scales kv_scales.json`` on the same dialogues (same flags) to see how far calibrated scales are
from that floor.

    python -m cabinllm.benchmarks.studies.kv_oracle --num-dialogues 8 --seed 0
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from cabinllm.calibration.calibrate import GRADE_MODES, common_first_token
from cabinllm.calibration.clips import compute_clips, layer_ranges
from cabinllm.calibration.equalize import FIRST_TOKEN
from cabinllm.calibration.evaluate import evaluate
from cabinllm.calibration.selection import TokenizedDialogue, prepare_dialogues
from cabinllm.calibration.stats import collect_stats
from cabinllm.cli.args import float_range, positive_int
from cabinllm.runtime.errors import DataError
from cabinllm.runtime.formats.scales_file import ScalesFile
from cabinllm.runtime.sources.model_source import Checkpoint, load_model

MODES = list(GRADE_MODES)  # the modes cabin-calibrate grades its own scales on


def fitted_scales(model: Checkpoint, dialogues: list[TokenizedDialogue], percentile: float) -> ScalesFile:
    """Scales whose clips come from the statistics of ``dialogues`` themselves (percentile 100: the abs-max)."""
    stats = collect_stats(model.transformer(), dialogues)
    clips = compute_clips(stats, "max") if percentile == 100 else compute_clips(stats, "percentile", percentile)
    data = {FIRST_TOKEN: common_first_token(dialogues)}
    return ScalesFile(clips.scales(), model.fingerprint, f"fitted:{percentile:g}", data, layer_ranges(stats, clips))


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the table, and the JSON with --json."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.kv_oracle",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' or an engine / checkpoint folder")
    parser.add_argument("--data", default="sharegpt", help="'builtin', 'sharegpt' or a dialogue file")
    parser.add_argument("--split", default="heldout", choices=["heldout", "all"],
                        help="dialogues of the held-out split or all of them (default heldout)")
    parser.add_argument("--num-dialogues", type=positive_int, default=8, help="dialogues (default 8)")
    parser.add_argument("--max-tokens", type=positive_int, default=2048,
                        help="tokens per dialogue at most (default 2048)")
    parser.add_argument("--min-tokens", type=positive_int, default=2048,
                        help="tokens per dialogue at least (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="selects the dialogues (default 0)")
    parser.add_argument("--percentile", type=float_range(0, 100), default=100.0,
                        help="clip percentile of the fitted scales (default 100: the abs-max)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    try:
        dialogues, data = prepare_dialogues(args.data, args.split, args.num_dialogues, args.seed, model.tokenizer,
                                            args.max_tokens, args.min_tokens)
    except DataError as err:
        print(f"kv_oracle: error: {err}", file=sys.stderr)
        return 2
    results = evaluate(model, dialogues, MODES, fitted_scales(model, dialogues, args.percentile))
    print(f"{data['dialogues']} {args.split} dialogues of {args.data}, {data['tokens']} tokens; "
          f"static scales fitted on them (clip percentile {args.percentile:g})")
    print(f"{'mode':<18}{'ppl vs fp32':>12}{'KL':>10}{'top-1 agree':>13}")
    for name, r in results.items():
        print(f"{name:<18}{r.ppl_delta_pct:>+11.3f}%{r.kl:>10.5f}{100 * r.top1_agree:>12.2f}%")
    if args.json:
        args.json.write_text(json.dumps({"data": data, "percentile": args.percentile,
                                         "modes": {m: asdict(r) for m, r in results.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
