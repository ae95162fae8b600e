"""How a confirmation threshold trades wrong calls for questions: over sets of in-car commands (each with the
function meant), the greedy call of each with ``tool_choice="required"`` (one call) against the car's functions,
the probability the model gave the function's name (``ToolFormat.name_probabilities``), and for each threshold P
how many calls cabin-chat's ``--confirm-below P`` would ask about and how many calls of a function not meant would
run unasked. Greedy, on the batched scheduler, as the tool_calls study runs its replies.

    python -m cabinllm.benchmarks.studies.call_confidence --engine engines/smollm2-int8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.benchmarks.studies.tool_calls import COMMANDS, read_commands, run_requests
from cabinllm.cli.args import float_range, positive_int
from cabinllm.cli.chat import BUILTIN_TOOLS
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.model.tools import read_tools

MORE_COMMANDS = Path(__file__).parent / "data" / "vehicle_commands_16.jsonl"
THRESHOLDS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9)


def confidences(engine: Engine, tools_path: Path, commands: list[dict], max_new_tokens: int) -> list[dict]:
    """Each command's call: the function meant, the function called and the probability of its name."""
    tools = read_tools(tools_path)
    tool_format = engine.tokenizer.with_tools(tools).tool_format
    out = []
    for command, request in zip(commands, run_requests(engine, tools, commands, "tools", max_new_tokens,
                                                       logprobs=0)):
        calls = tool_format.parse(request.text) or []
        called = calls[0][0] if calls else None
        probability = tool_format.name_probabilities(
            [engine.vocabulary.token_bytes(lp.token) for lp in request.token_logprobs],
            [lp.logprob for lp in request.token_logprobs], [called])[0] if called else 0.0
        out.append({"command": command["command"], "meant": command["function"], "called": called,
                    "probability": probability, "finish_reason": request.finish_reason})
    return out


def trade_off(calls: list[dict], threshold: float) -> dict:
    """At one threshold: the questions asked, the wrong calls run unasked, the wrong calls caught, the right calls
    asked about."""
    asked = [c for c in calls if c["probability"] < threshold]
    wrong = [c for c in calls if c["called"] != c["meant"]]
    return {"asked": len(asked), "wrong_run": sum(c["probability"] >= threshold for c in wrong),
            "wrong_caught": sum(c["probability"] < threshold for c in wrong),
            "right_asked": sum(c["called"] == c["meant"] for c in asked)}


def markdown(result: dict) -> str:
    """The trade-off as a markdown table, a column pair per command set."""
    sets = result["sets"]
    head = " | ".join(f"asked ({name}) | wrong calls run ({name})" for name in sets)
    lines = [f"# Confirming calls below a threshold ({result['engine']}, greedy, {result['threads']} thread(s), load "
             f"{result['machine']['load_average_1m']:.2f})", "",
             "Wrong calls with no threshold: " + ", ".join(f"{s['wrong']}/{s['commands']} ({name})"
                                                           for name, s in sets.items()), "",
             f"| P | {head} |", "|---|" + "---|" * (2 * len(sets))]
    for i, threshold in enumerate(result["thresholds"]):
        cells = " | ".join(f"{s['trade_off'][i]['asked']} | {s['trade_off'][i]['wrong_run']}" for s in sets.values())
        lines.append(f"| {threshold:g} | {cells} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.call_confidence",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--commands", type=Path, nargs="+", default=[COMMANDS, MORE_COMMANDS],
                        help="JSONL files of {command, function}, each a set of its own")
    parser.add_argument("--tools", type=Path, default=BUILTIN_TOOLS, help="JSON file of OpenAI tool definitions")
    parser.add_argument("--thresholds", type=float_range(0, 1, low_included=True), nargs="+",
                        default=list(THRESHOLDS), help="the values of --confirm-below to count")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="longest reply")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads")
    parser.add_argument("--output", type=Path, default=RESULTS / "call_confidence",
                        help="results path, without suffix")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.engine)
    sets = {}
    for path in args.commands:
        commands = read_commands(path)
        calls = confidences(engine, args.tools, commands, args.max_new_tokens)
        sets[f"{len(commands)} commands"] = {
            "file": path.name, "commands": len(commands), "wrong": sum(c["called"] != c["meant"] for c in calls),
            "trade_off": [trade_off(calls, threshold) for threshold in args.thresholds], "calls": calls}
    if len(sets) > 1:
        every = [call for one in sets.values() for call in one["calls"]]
        sets[f"all {len(every)}"] = {"commands": len(every), "wrong": sum(c["called"] != c["meant"] for c in every),
                                     "trade_off": [trade_off(every, threshold) for threshold in args.thresholds]}
    result = {"engine": args.engine.name, "threads": args.threads, "thresholds": args.thresholds,
              "machine": machine_info(), "sets": sets}
    write_results(args.output, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
