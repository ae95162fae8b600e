"""What constrained decoding costs: the token mask of a grammar library per token for the model's vocabulary
(llguidance, which the runtime uses, beside xgrammar where it is installed), and decode speed with a JSON-schema
constraint against none on the same engine. One thread; medians of interleaved repeats.

The mask workload: the intent schema of the tool_calls study and, for each of its in-car commands, the JSON a
reply would hold, fed token by token (a mask computed before every token, as decoding does).

    python -m cabinllm.benchmarks.studies.grammar_masks --engine engines/smollm2-135m-int8-eq
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies.tool_calls import COMMANDS, intent_schema, read_commands
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.cli.chat import BUILTIN_TOOLS
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.generation.grammar import JSON_LAYOUT, json_schema_grammar
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.model.tools import read_tools

LONG_REPLY = {"type": "object", "properties": {"reply": {"type": "string", "minLength": 400, "maxLength": 800}},
              "required": ["reply"], "additionalProperties": False}  # longer than any run: every run decodes all


def sample_texts(engine: Engine) -> tuple[dict, list[list[int]]]:
    """The intent schema and the token ids of the JSON each command's reply would hold."""
    tools, commands = read_tools(BUILTIN_TOOLS), read_commands(COMMANDS)
    texts = [json.dumps({"intent": c["function"], "confirmation": c["command"][:60]}) for c in commands]
    return intent_schema(tools), [engine.tokenizer.encode(text) for text in texts]


def llguidance_masks(engine: Engine, schema: dict, samples: list[list[int]]) -> dict:
    """Mask time per token and grammar start time of the runtime's own path (llguidance)."""
    grammar = json_schema_grammar(schema)
    starts, masks = [], []
    for ids in samples:
        t0 = time.perf_counter()
        state = engine.vocabulary.start(grammar)
        starts.append(time.perf_counter() - t0)
        for token in ids:
            t0 = time.perf_counter()
            allowed = state.allowed()
            masks.append(time.perf_counter() - t0)
            assert allowed[token]
            state.push(token)
    return _times("llguidance", starts, masks)


def xgrammar_masks(engine: Engine, schema: dict, samples: list[list[int]]) -> dict | None:
    """The same with xgrammar (None where it is not installed)."""
    try:
        import xgrammar
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(engine.tokenizer.to_json()))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=engine.config.vocab_size,
                                                   stop_token_ids=engine.stop_token_ids())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, engine.config.vocab_size)
    separators = (JSON_LAYOUT["item_separator"], JSON_LAYOUT["key_separator"])
    starts, masks = [], []
    for ids in samples:
        t0 = time.perf_counter()
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                       separators=separators))
        starts.append(time.perf_counter() - t0)
        for token in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:engine.config.vocab_size]
            masks.append(time.perf_counter() - t0)
            assert allowed[token]
            matcher.accept_token(token)
    return _times("xgrammar", starts, masks)


def _times(library: str, starts: list[float], masks: list[float]) -> dict:
    masks = sorted(masks)
    return {"library": library, "tokens": len(masks), "start_ms_median": statistics.median(starts) * 1e3,
            "mask_us_median": statistics.median(masks) * 1e6, "mask_us_p95": masks[int(0.95 * len(masks))] * 1e6}


def decode_speed(engine: Engine, constrained: bool, tokens: int) -> float:
    """Decode tokens/s of one greedy reply of ``tokens`` tokens, under LONG_REPLY or free."""
    prompt = engine.tokenizer.encode_prompt(engine.tokenizer.render(
        [{"role": "user", "content": "Describe the drive along the coast in detail."}]))
    params = SamplingParams(max_new_tokens=tokens)  # no stop token: every run decodes all its tokens
    grammar = engine.vocabulary.start(json_schema_grammar(LONG_REPLY)) if constrained else None
    core = engine.new_core(config=SchedulerConfig(prefill_chunk=len(prompt)))
    result = core.generate(Request(prompt, params, grammar=grammar))
    assert len(result.token_ids) == tokens
    return result.decode_tok_s


def markdown(result: dict) -> str:
    """The results as markdown tables."""
    lines = [f"# Constrained decoding cost ({result['engine']}, vocabulary {result['vocab_size']:,}, 1 thread, load "
             f"{result['load_average_before']:.2f} before / {result['load_average_after']:.2f} after)", "",
             "| library | grammar start ms | mask us/token median | p95 | tokens |", "|---|---|---|---|---|"]
    lines += [f"| {r['library']} | {r['start_ms_median']:.2f} | {r['mask_us_median']:.0f} | {r['mask_us_p95']:.0f} "
              f"| {r['tokens']} |" for r in result["masks"]]
    d = result["decode"]
    lines += ["", "| decode, {} tokens | tok/s (median of {}) |".format(d["tokens"], d["repeats"]), "|---|---|",
              f"| free | {d['free_tok_s']:.2f} |", f"| JSON schema | {d['constrained_tok_s']:.2f} |",
              f"| ratio | {d['ratio']:.3f}x |"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.grammar_masks",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--tokens", type=positive_int, default=64, help="tokens of each decode run")
    parser.add_argument("--repeats", type=positive_int, default=5, help="interleaved decode runs of each kind")
    parser.add_argument("--output", type=Path, default=RESULTS / "grammar_masks", help="results path, without suffix")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine.load(args.engine)
    engine.vocabulary  # built once (about half a second), not timed
    load_before = os.getloadavg()[0]
    schema, samples = sample_texts(engine)
    masks = [m for m in (llguidance_masks(engine, schema, samples), xgrammar_masks(engine, schema, samples)) if m]
    decode_speed(engine, False, 8)  # warm-up
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for constrained in (False, True):
            runs[constrained].append(decode_speed(engine, constrained, args.tokens))
    free, constrained = statistics.median(runs[False]), statistics.median(runs[True])
    result = {"engine": args.engine.name, "vocab_size": engine.config.vocab_size, "machine": machine_info(),
              "load_average_before": load_before, "load_average_after": os.getloadavg()[0], "masks": masks,
              "decode": {"tokens": args.tokens, "repeats": args.repeats, "free_tok_s": free,
                         "constrained_tok_s": constrained, "ratio": constrained / free,
                         "free_each": runs[False], "constrained_each": runs[True]}}
    write_results(args.output, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
