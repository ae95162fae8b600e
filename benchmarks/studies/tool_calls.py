"""What a constrained reply to an in-car command holds: over a set of commands (tests/data/vehicle_commands.jsonl,
each with the function meant), replies with ``tool_choice="required"`` against the car's functions
(cli/data/vehicle_functions.json) and replies under a JSON schema of the command's intent. Counts how many are
valid (a call of a catalogue function whose arguments validate against its schema; JSON that validates) and how
many pick the function meant. Validity is the grammar's doing; the function picked is the model's (a 135M model
picks poorly: this measures it, it does not tune the set to it). Greedy, on the batched scheduler.

    python -m cabinllm.benchmarks.studies.tool_calls --engine engines/smollm2-135m-int8-eq
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import torch
from tqdm import tqdm

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.cli.chat import BUILTIN_TOOLS
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.grammar import json_schema_grammar, reply_grammar
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.tools import Tool, read_tools
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig

COMMANDS = Path(__file__).resolve().parents[2] / "tests" / "data" / "vehicle_commands.jsonl"
SYSTEM = "You are the assistant of a car. Carry out the driver's command."


@dataclass
class Scored:
    """One reply: what it was, whether it is valid and whether it picked the function meant."""

    command: str
    meant: str
    reply: str
    picked: str | None
    valid: bool
    problem: str | None


def intent_schema(tools: list[Tool]) -> dict:
    """The JSON schema of a structured reply to a command: the function meant and a short confirmation."""
    return {"type": "object", "properties": {"intent": {"type": "string", "enum": [t.name for t in tools]},
                                             "confirmation": {"type": "string", "maxLength": 60}},
            "required": ["intent", "confirmation"], "additionalProperties": False}


def read_commands(path: Path) -> list[dict]:
    """The commands and the function each means."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_replies(engine: Engine, tools: list[Tool], commands: list[dict], mode: str, max_new_tokens: int,
                sessions: int = 4) -> list[str]:
    """The greedy reply to each command (``run_requests``)."""
    return [request.text for request in run_requests(engine, tools, commands, mode, max_new_tokens, sessions)]


def run_requests(engine: Engine, tools: list[Tool], commands: list[dict], mode: str, max_new_tokens: int,
                 sessions: int = 4, logprobs: int | None = None) -> list[Request]:
    """The greedy request of each command, run on one scheduler: the first alone, so that the prefix every prompt
    shares (the system prompt and the tool list) is computed once and found in the cache by the rest, queued
    together; ``logprobs`` as ``Request`` takes them."""
    tokenizer = engine.tokenizer.with_tools(tools if mode == "tools" else [])
    grammar = (reply_grammar(tokenizer.tool_format, tools, "required", parallel=False) if mode == "tools"
               else json_schema_grammar(intent_schema(tools)))
    scheduler = engine.new_core(engine.new_cache(KvCacheConfig(max_bytes=256 << 20)),
                          SchedulerConfig(max_sessions=sessions, max_queue=len(commands), queue_timeout_s=3600))
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids())
    requests = []
    for command in commands:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": command["command"]}]
        requests.append(Request(tokenizer.encode_prompt(tokenizer.render(messages)), params, lambda *_: None,
                                grammar=engine.vocabulary.start(grammar), logprobs=logprobs))
    with tqdm(total=len(requests), desc=f"{mode} replies", unit="reply") as progress:
        for batch in (requests[:1], requests[1:]):
            for request in batch:
                scheduler.add_request(request)
            while any(r.finish_reason is None for r in batch):
                scheduler.step()
                progress.update(sum(r.finish_reason is not None for r in requests) - progress.n)
    return requests


def score(engine: Engine, tools: list[Tool], commands: list[dict], mode: str, replies: list[str]) -> list[Scored]:
    """Each reply checked: a call (mode tools) or an intent (mode json_schema) that validates, and its pick."""
    schemas = {tool.name: tool.parameters for tool in tools}
    scored = []
    for command, reply in zip(commands, replies):
        picked, problem = None, None
        try:
            if mode == "tools":
                calls = engine.tokenizer.tool_format.parse(reply)
                if not calls:
                    raise ValueError("no whole call")
                picked, arguments = calls[0]
                if picked not in schemas:
                    raise ValueError(f"{picked} is not a catalogue function")
                jsonschema.validate(json.loads(arguments), schemas[picked])
            else:
                intent = json.loads(reply)
                jsonschema.validate(intent, intent_schema(tools))
                picked = intent["intent"]
        except (ValueError, jsonschema.ValidationError) as err:
            problem = str(err).splitlines()[0]
        scored.append(Scored(command["command"], command["function"], reply, picked, problem is None, problem))
    return scored


def summary(scored: list[Scored]) -> dict:
    """Counts of valid replies and of the function meant picked."""
    return {"replies": len(scored), "valid": sum(s.valid for s in scored),
            "picked_meant": sum(s.picked == s.meant for s in scored)}


def markdown(result: dict) -> str:
    """The results as a markdown table."""
    lines = [f"# Constrained replies to {result['commands']} in-car commands ({result['engine']}, greedy, "
             f"{result['threads']} thread(s), load {result['machine']['load_average_1m']:.2f})", "",
             "| mode | valid | picked the function meant | seconds |", "|---|---|---|---|"]
    for mode, row in result["modes"].items():
        lines.append(f"| {mode} | {row['valid']}/{row['replies']} | {row['picked_meant']}/{row['replies']} "
                     f"| {row['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.tool_calls",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--commands", type=Path, default=COMMANDS, help="JSONL of {command, function}")
    parser.add_argument("--tools", type=Path, default=BUILTIN_TOOLS, help="JSON file of OpenAI tool definitions")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128,
                        help="longest reply (the longest call of the catalogue's strings at a character a token fits)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads")
    parser.add_argument("--output", type=Path, default=RESULTS / "tool_calls", help="results path, without suffix")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine, tools, commands = Engine.load(args.engine), read_tools(args.tools), read_commands(args.commands)
    modes = {}
    for mode in ("tools", "json_schema"):
        start = time.perf_counter()
        scored = score(engine, tools, commands, mode, run_replies(engine, tools, commands, mode, args.max_new_tokens))
        modes[mode] = {**summary(scored), "seconds": time.perf_counter() - start, "replies_each": [vars(s) for s in scored]}
    result = {"engine": args.engine.name, "commands": len(commands), "threads": args.threads,
              "machine": machine_info(), "modes": modes}
    write_results(args.output, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
