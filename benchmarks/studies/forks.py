"""n = 4 replies of one prompt as forked sequences (one prefill, shared blocks) against 4 separate requests of the
same prompt, on the server's scheduler in this process: KV blocks in use at the peak, prompt tokens computed,
time until all four have their first token, and aggregate tokens/s. Separate requests share the prompt's full
blocks too, through the prefix cache, where one's prefill is in before another's starts. Greedy, no stop token
(every reply ``--reply-tokens`` long), one thread, seeded random prompt tokens; medians of interleaved repeats.

    python -m cabinllm.benchmarks.studies.forks --engine engines/smollm2-135m-int8-eq
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.cache import DEFAULT_KV_BYTES, KvCacheConfig
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig

WAYS = ("forked", "separate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.forks",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--prompt-tokens", type=positive_int, default=1024, help="tokens of the shared prompt")
    parser.add_argument("--reply-tokens", type=positive_int, default=64, help="tokens of each reply")
    parser.add_argument("--n", type=positive_int, default=4, help="replies")
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs of each way")
    parser.add_argument("--kv-budget-mb", type=float, default=DEFAULT_KV_BYTES / 2**20,
                        help="the scheduler's KV budget")
    parser.add_argument("--output", type=Path, default=RESULTS / "forks", help="results path, without suffix")
    return parser.parse_args(argv)


def run(engine: Engine, args: argparse.Namespace, way: str, prompt: list[int]) -> dict:
    """One run of ``way`` on a fresh cache: its figures."""
    cache = engine.new_cache(KvCacheConfig(None, int(args.kv_budget_mb * 2**20)))
    scheduler = engine.new_core(cache, SchedulerConfig(max_sessions=args.n, prefill_chunk=args.prompt_tokens))
    params = SamplingParams(args.reply_tokens, temperature=0.0, stop_token_ids=[])
    requests = [Request(list(prompt), params, lambda *_: None) for _ in range(args.n)]
    if way == "forked":
        requests[0].followers = requests[1:]
        scheduler.add_request(requests[0])
    else:
        for request in requests:
            scheduler.add_request(request)
    fed, step = 0, engine.model.step

    def counted(spans, kv, *rest):
        nonlocal fed
        fed += sum(len(span.token_ids) for span in spans)
        return step(spans, kv, *rest)

    engine.model.step = counted  # tokens run through the model: prompt chunks and decode tokens
    t0, peak = time.perf_counter(), 0
    try:
        while any(r.finish_reason is None for r in requests):
            scheduler.step()
            peak = max(peak, cache.stats().blocks_in_use)
    finally:
        del engine.model.step
    wall = time.perf_counter() - t0
    first_all = max(r.first_token_at for r in requests) - min(r.queued_at for r in requests)
    tokens = sum(len(r.token_ids) for r in requests)
    assert cache.stats().blocks_in_use == 0
    decoded = sum(len(r.token_ids) - 1 for r in requests)  # each reply's first token comes from its prefill
    return {"peak_blocks": peak, "prompt_tokens_computed": fed - decoded, "ttft_all_s": first_all, "wall_s": wall,
            "tokens_per_s": tokens / wall, "tokens": tokens, "same_replies": len({tuple(r.token_ids)
                                                                                  for r in requests}) == 1}


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    if not (args.engine / "manifest.json").is_file():
        print(f"forks: {args.engine} is no engine folder; build one with cabin-build", file=sys.stderr)
        return 2
    CPU_THREADS.use(1)
    engine = Engine.load(args.engine)
    prompt = torch.randint(100, engine.config.vocab_size - 100, (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    tpb = engine.new_cache(KvCacheConfig(None, 1 << 20)).tokens_per_block
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    run(engine, args, "forked", prompt)  # warm-up
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(run(engine, args, way, prompt))
    medians = {way: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "same_replies"}
               for way, rs in runs.items()}
    bound = cdiv(args.prompt_tokens, tpb) + args.n * (cdiv(args.reply_tokens, tpb) + 1)
    naive = args.n * cdiv(args.prompt_tokens + args.reply_tokens, tpb)
    result = {"machine": machine_info(), "command": " ".join(["python -m cabinllm.benchmarks.studies.forks",
                                                               *(argv or sys.argv[1:])]),
              "tokens_per_block": tpb, "bound_blocks": bound, "separate_blocks_naive": naive, "medians": medians,
              "runs": runs}
    f, s = medians["forked"], medians["separate"]
    table = "\n".join([
        f"# n = {args.n} replies of one {args.prompt_tokens}-token prompt: forked vs separate requests "
        f"({args.engine.name}, {args.reply_tokens} greedy tokens each, 1 thread, median of {args.repeats})", "",
        f"Load average {result['machine']['load_average_1m']:.2f}; blocks of {tpb} tokens. Bound for the forked "
        f"run: prompt blocks + n x (reply blocks + 1) = {bound}; n x (prompt + reply) = {naive}.", "",
        "| way | peak KV blocks | prompt tokens computed | TTFT of all n (s) | aggregate tok/s |",
        "|---|---|---|---|---|",
        *(f"| {way} | {m['peak_blocks']:.0f} | {m['prompt_tokens_computed']:.0f} | {m['ttft_all_s']:.2f} | "
          f"{m['tokens_per_s']:.1f} |" for way, m in medians.items()),
        "", f"Forked / separate: peak blocks {f['peak_blocks'] / s['peak_blocks']:.2f}x, TTFT of all "
            f"{f['ttft_all_s'] / s['ttft_all_s']:.2f}x, aggregate tok/s {f['tokens_per_s'] / s['tokens_per_s']:.2f}x.",
        ""])
    write_results(args.output, result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
