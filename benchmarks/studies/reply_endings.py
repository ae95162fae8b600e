"""Calls and structured replies at their token limits, through cabin-serve with the openai client: 16 in-car commands
against 6 functions (tests/data/cabin_commands.jsonl, cabin_functions.json; tool_choice "required", max_tokens 64,
everything else default, then once more with parallel_tool_calls false), and 40 json_schema / json_object requests
with max_tokens from 8 to 64 (tests/data/structured_requests.jsonl, structured_formats.json). Counts the replies
that carry their calls in tool_calls, those over the cap, those with call markup in content, and the structured
replies that parse and validate (or were refused up front with a 400 naming max_tokens). Then what the steering to
a whole sentence costs: decode tok/s of the same constrained replies in the engine core with and without it.

Starts ``cabin-serve`` as a subprocess on a free loopback port (``--threads`` threads).

    python -m cabinllm.benchmarks.studies.reply_endings --engine engines/smollm2-int8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.benchmarks.studies.serve_bench import free_port, start_server
from cabinllm.cli.args import positive_int
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.generation import grammar
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.model.tools import Tool

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
SYSTEM = "You are the assistant of a car. Carry out the driver's command."
STRUCTURED_SYSTEM = "You are the assistant of a car. Answer the driver in JSON."
MARKUP = ("<tool_call>", "</tool_call>", '{"name": ')


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def tool_replies(client, model: str, tools: list[dict], commands: list[dict], max_tokens: int,
                 parallel: bool | None) -> list[dict]:
    """Each command's reply with tool_choice "required" (``parallel``: parallel_tool_calls, None: left out)."""
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    rows = []
    for command in commands:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        reply = client.chat.completions.create(
            model=model, tools=tools, tool_choice="required", max_tokens=max_tokens, **extra,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": command["command"]}])
        choice = reply.choices[0]
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
        valid = all(name in schemas and _valid(arguments, schemas[name]) for name, arguments in calls)
        content = choice.message.content or ""
        rows.append({"command": command["command"], "meant": command["function"], "finish_reason": choice.finish_reason,
                     "calls": calls, "content": content, "valid": valid, "tokens": reply.usage.completion_tokens,
                     "markup": any(mark in content for mark in MARKUP)})
    return rows


def structured_replies(client, model: str, formats: dict, requests: list[dict]) -> list[dict]:
    """Each request's reply under its response format: parsed and validated, or the 400 that refused it."""
    import openai

    rows = []
    for request in requests:
        response_format = formats[request["format"]]
        schema = response_format.get("json_schema", {}).get("schema", {"type": "object"})
        row = {**request, "refused": None, "finish_reason": None, "text": None, "valid": False}
        try:
            choice = client.chat.completions.create(
                model=model, max_tokens=request["max_tokens"], response_format=response_format,
                messages=[{"role": "system", "content": STRUCTURED_SYSTEM},
                          {"role": "user", "content": request["prompt"]}]).choices[0]
        except openai.BadRequestError as err:
            row["refused"] = f"{err.body.get('param')}: {err.body.get('message')}"
        else:
            row.update(finish_reason=choice.finish_reason, text=choice.message.content)
            try:
                row["valid"] = _valid(choice.message.content, schema)
            except json.JSONDecodeError:
                row["valid"] = False
        rows.append(row)
    return rows


def _valid(text: str, schema: dict) -> bool:
    """Whether JSON text validates against ``schema`` (JSONDecodeError where it is no JSON)."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except jsonschema.ValidationError:
        return False
    return True


def steering_cost(engine: Engine, tools: list[Tool], commands: list[dict], formats: dict, structured: list[dict],
                  max_tokens: int, rounds: int) -> dict:
    """What the steering to a whole sentence costs. Per token: the check of each token (``GrammarState.fits``) replayed
    over the commands' greedy calls (tool_choice "required", ``max_tokens``) and the structured replies' tokens, each
    against its own limit. End to end: decode tok/s of those greedy calls in the engine core with the steering and
    without it (``ENDING_DEPTH`` 0), interleaved (each first in every other round), medians over ``rounds``."""
    tokenizer = engine.tokenizer.with_tools(tools)
    calls = grammar.reply_grammar(tokenizer.tool_format, tools, "required")
    core = engine.new_core(engine.new_cache())
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, stop_token_ids=engine.stop_token_ids())
    prompts = [tokenizer.encode_prompt(tokenizer.render([{"role": "system", "content": SYSTEM},
                                                         {"role": "user", "content": c["command"]}]))
               for c in commands]
    depth, runs, replies = grammar.ENDING_DEPTH, {"steered": [], "unsteered": []}, []
    core.generate(Request(prompts[0], params, grammar=engine.vocabulary.start(calls)))  # warm up
    try:
        for round_ in range(rounds):
            for mode in list(runs)[::1 if round_ % 2 == 0 else -1]:  # each mode first in every other round
                grammar.ENDING_DEPTH = depth if mode == "steered" else 0
                tokens, seconds = 0, 0.0
                for prompt in prompts:
                    request = Request(prompt, params, grammar=engine.vocabulary.start(calls, tokenizer.tool_format))
                    core.generate(request)
                    tokens, seconds = tokens + len(request.token_ids) - 1, seconds + request.decode_s
                    if mode == "steered" and len(replies) < len(prompts):
                        replies.append((calls, tokenizer.tool_format, request.token_ids, max_tokens))
                runs[mode].append(tokens / seconds)
    finally:
        grammar.ENDING_DEPTH = depth
    for row in structured:
        if row["text"] is not None:
            schema = formats[row["format"]].get("json_schema", {}).get("schema", {"type": "object"})
            replies.append((grammar.json_schema_grammar(schema), None, engine.tokenizer.encode(row["text"]),
                            row["max_tokens"]))
    checks = _check_times(engine, replies)
    steered, unsteered = statistics.median(runs["steered"]), statistics.median(runs["unsteered"])
    return {"rounds": runs, "steered_tok_s": steered, "unsteered_tok_s": unsteered, "ratio": steered / unsteered,
            "check_tokens": len(checks), "check_median_us": statistics.median(checks) * 1e6,
            "check_p95_us": statistics.quantiles(checks, n=20)[-1] * 1e6,
            "check_mean_us": statistics.fmean(checks) * 1e6, "check_max_us": max(checks) * 1e6}


def _check_times(engine: Engine, replies: list[tuple]) -> list[float]:
    """Seconds of each token's check (``fits``) replayed over (grammar, tool format, tokens, limit) replies."""
    stops, times = set(engine.stop_token_ids()), []
    for text, tool_format, tokens, limit in replies:
        state = engine.vocabulary.start(text, tool_format)
        for i, token in enumerate(tokens):
            if token in stops:
                break
            started = time.perf_counter()
            state.fits(token, limit - i - 1)
            times.append(time.perf_counter() - started)
            state.push(token)
    return times


def tool_summary(rows: list[dict], cap: int) -> dict:
    """Counts of the tool replies."""
    return {"replies": len(rows), "with_calls": sum(bool(r["calls"]) for r in rows),
            "over_cap": sum(len(r["calls"]) > cap for r in rows), "markup_in_content": sum(r["markup"] for r in rows),
            "content_not_empty": sum(bool(r["content"]) for r in rows), "valid": sum(r["valid"] for r in rows),
            "calls": sum(len(r["calls"]) for r in rows), "tokens": sum(r["tokens"] for r in rows), "picked_meant": sum(
                bool(r["calls"]) and r["calls"][0][0] == r["meant"] for r in rows),
            "finish_reasons": {reason: sum(r["finish_reason"] == reason for r in rows)
                               for reason in sorted({r["finish_reason"] for r in rows})}}


def markdown(result: dict) -> str:
    """The results as markdown tables."""
    lines = [f"# Replies at their token limits ({result['engine']}, {result['threads']} thread(s), load "
             f"{result['machine']['load_average_1m']:.2f})", "",
             f"Tool calls: {result['commands']} commands, {result['functions']} functions, tool_choice required, "
             f"max_tokens {result['max_tokens']}, cap {result['cap']}", "",
             "| parallel_tool_calls | calls in tool_calls | over the cap | markup in content | calls valid | calls "
             "| first call the one meant | finish reasons | tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in result["tools"].items():
        s = row["summary"]
        reasons = ", ".join(f"{k} {v}" for k, v in s["finish_reasons"].items())
        lines.append(f"| {name} | {s['with_calls']}/{s['replies']} | {s['over_cap']} | {s['markup_in_content']} | "
                     f"{s['valid']}/{s['replies']} | {s['calls']} | {s['picked_meant']}/{s['replies']} | {reasons} | "
                     f"{s['tokens']} |")
    st = result["structured"]["summary"]
    lines += ["", "Structured replies: json_schema / json_object, max_tokens 8 to 64", "",
              "| requests | answered | parse and validate | refused up front (400, max_tokens) "
              "| finish stop / length |",
              "|---|---|---|---|---|",
              f"| {st['requests']} | {st['answered']} | {st['valid']}/{st['answered']} | {st['refused']} | "
              f"{st['stop']} / {st['length']} |"]
    if "cost" in result:
        cost = result["cost"]
        lines += ["", "Steering cost: the check of each token (replayed over the greedy calls and the structured "
                  "replies), and decode of the commands' greedy calls in the engine core with and without it", "",
                  "| tokens checked | check median | p95 | mean | max | decode with steering | without | ratio |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {cost['check_tokens']} | {cost['check_median_us']:.0f} us | {cost['check_p95_us']:.0f} us | "
                  f"{cost['check_mean_us']:.0f} us | {cost['check_max_us'] / 1000:.1f} ms | "
                  f"{cost['steered_tok_s']:.2f} tok/s | {cost['unsteered_tok_s']:.2f} tok/s | {cost['ratio']:.3f} |"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.reply_endings",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads of the server and the engine")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="max_tokens of the tool requests")
    parser.add_argument("--cost-rounds", type=int, default=3,
                        help="interleaved rounds of the steering cost (0: not measured)")
    parser.add_argument("--output", type=Path, default=RESULTS / "reply_endings", help="results path, without suffix")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    import openai

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tools = json.loads((DATA / "cabin_functions.json").read_text(encoding="utf-8"))
    commands = read_jsonl(DATA / "cabin_commands.jsonl")
    formats = json.loads((DATA / "structured_formats.json").read_text(encoding="utf-8"))
    requests = read_jsonl(DATA / "structured_requests.jsonl")
    port = free_port()
    server = start_server(argparse.Namespace(engine=args.engine, threads=args.threads, streams=4,
                                             kv_budget_mb=64, tokens_per_block=None), port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        started = time.perf_counter()
        tool_rows = {str(parallel).lower() if parallel is not None else "default (true)":
                     tool_replies(client, "bench", tools, commands, args.max_tokens, parallel)
                     for parallel in (None, False)}
        structured = structured_replies(client, "bench", formats, requests)
        serve_s = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(30)
    answered = [r for r in structured if r["refused"] is None]
    result = {"engine": args.engine.name, "threads": args.threads, "machine": machine_info(),
              "commands": len(commands), "functions": len(tools), "max_tokens": args.max_tokens,
              "cap": grammar.MAX_TOOL_CALLS, "serve_seconds": serve_s,
              "tools": {name: {"summary": tool_summary(rows, grammar.MAX_TOOL_CALLS), "replies": rows}
                        for name, rows in tool_rows.items()},
              "structured": {"summary": {"requests": len(structured), "answered": len(answered),
                                         "valid": sum(r["valid"] for r in answered),
                                         "refused": sum(r["refused"] is not None for r in structured),
                                         "stop": sum(r["finish_reason"] == "stop" for r in answered),
                                         "length": sum(r["finish_reason"] == "length" for r in answered)},
                             "replies": structured}}
    if args.cost_rounds > 0:
        engine = Engine.load(args.engine)
        result["cost"] = steering_cost(engine, [Tool.from_openai(t) for t in tools], commands, formats, structured,
                                       args.max_tokens, args.cost_rounds)
    result["machine_after"] = machine_info()
    write_results(args.output, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
