"""Long-dialogue benchmarks of the runtime: TTFT per turn, bounded memory over 200 turns, long-stream quality.

Usage: python -m cabinllm.benchmarks.studies.dialogue_bench --engine DIR [--part ttft budget capacity stream]
[--out DIR]

- ttft: a long ShareGPT dialogue played turn by turn with reuse of earlier turns, beside a
  runtime that re-prefills the whole history each turn (as an INT8-KV TensorRT-LLM engine must).
- budget: a 200-turn scripted dialogue under a 32 MiB INT8 KV budget with sink-window and
  with drop-turns; KV bytes and process RSS per turn (JSON + PNG).
- capacity: tokens a fixed budget holds per KV mode.
- stream: perplexity over a 20,000-token ShareGPT stream with a 2,048-token sink window (evicting
  down to half, then prefilling the kept window again), against full attention over each scored
  chunk's last 2,048 tokens (a sliding window recomputed from scratch), on the same tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import time
from pathlib import Path

import torch

from cabinllm.benchmarks.workload import long_sharegpt_dialogue, sharegpt_stream
from cabinllm.calibration.sources import open_source
from cabinllm.runtime.dialogue.overflow import OverflowPolicy, sink_window
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, sized_config

MIB = 1 << 20


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def bench_ttft(engine: Engine, turns: int = 20, mode: str = "int8") -> dict:
    """TTFT per turn with reuse, and of re-prefilling the same history from scratch."""
    users = long_sharegpt_dialogue(engine, turns, max_user_tokens=96)
    params = SamplingParams(max_new_tokens=32, stop_token_ids=engine.stop_token_ids())
    session = DialogueSession(engine, engine.new_cache(KvCacheConfig(mode)), params,
                              "You are a helpful assistant.")
    rows = []
    for turn, text in enumerate(users, start=1):
        stats = session.chat(text)
        history = session.fed[: stats.reused_tokens + stats.prefill_tokens]
        core = engine.new_core(engine.new_cache(KvCacheConfig(mode)), SchedulerConfig(prefill_chunk=len(history)))
        fresh = core.generate(Request(history, SamplingParams(max_new_tokens=1, stop_token_ids=[])))
        rows.append({"turn": turn, "context_tokens": len(history), "new_tokens": stats.prefill_tokens,
                     "ttft_reuse_s": stats.ttft_s, "ttft_reprefill_s": fresh.ttft_s})
    t2, t20 = rows[1], rows[-1]
    return {"mode": mode, "turns": rows, "reuse_ratio_last_vs_turn2": t20["ttft_reuse_s"] / t2["ttft_reuse_s"],
            "reprefill_ratio_last_vs_turn2": t20["ttft_reprefill_s"] / t2["ttft_reprefill_s"]}


def builtin_user_turns(count: int) -> list[str]:
    """``count`` user messages from the built-in cockpit dialogues, cycling through them."""
    dialogues, _ = open_source("builtin")
    users = [m["content"] for d in dialogues for m in d.messages if m["role"] == "user"]
    return [users[i % len(users)] for i in range(count)]


def bench_budget(engine: Engine, out: Path, turns: int = 200, budget_mib: int = 32) -> dict:
    """A long scripted dialogue under a fixed INT8 KV budget with each evicting policy."""
    users = builtin_user_turns(turns)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=engine.stop_token_ids())
    result = {}
    for policy in ("sink-window", "drop-turns"):
        session = DialogueSession(engine, engine.new_cache(KvCacheConfig("int8", budget_mib * MIB)), params,
                                  "You are the in-car assistant. Keep answers short.", OverflowPolicy(policy))
        curve = []
        for text in users:
            stats = session.chat(text)
            curve.append({"turn": stats.turn, "finish": stats.finish_reason, "kv_bytes_used": stats.kv_bytes_used,
                          "kv_tokens": len(session.fed), "evicted": stats.evicted_tokens, "rss_bytes": rss_bytes(),
                          "ttft_s": stats.ttft_s})
        first_full = next((c["turn"] for c in curve if c["evicted"]), None)
        after = [c["rss_bytes"] for c in curve if first_full and c["turn"] >= first_full]
        result[policy] = {"completed": sum(c["finish"] in ("stop", "length") for c in curve), "turns": turns,
                          "first_eviction_turn": first_full,
                          "rss_growth_after_first_eviction_mib": (max(after) - min(after)) / MIB if after else None,
                          "curve": curve}
    plot_budget(result, budget_mib, out / "dialogue_budget.png")
    return result


def plot_budget(result: dict, budget_mib: int, path: Path) -> None:
    """KV bytes in use and process RSS per turn, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(11, 4), sharey=True)
    for ax, (policy, data) in zip(axes, result.items()):
        turns = [c["turn"] for c in data["curve"]]
        ax.plot(turns, [c["kv_bytes_used"] / MIB for c in data["curve"]], label="KV in use (MiB)")
        ax.plot(turns, [c["rss_bytes"] / MIB / 10 for c in data["curve"]], label="process RSS (MiB / 10)")
        ax.axhline(budget_mib, color="grey", linestyle="--", label=f"KV budget {budget_mib} MiB")
        ax.set_title(f"{policy}: {data['completed']}/{data['turns']} turns completed")
        ax.set_xlabel("turn")
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_ylabel("MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench_capacity(engine: Engine, budget_mib: int = 32) -> dict:
    """Tokens the same budget holds in each KV mode, and the ratio to FP16."""
    tokens = {m: engine.new_cache(KvCacheConfig(m, budget_mib * MIB)).stats().tokens_capacity
              for m in ("fp16", "int8", "int8-dynamic")}
    return {"budget_mib": budget_mib, "tokens": tokens,
            "ratio_vs_fp16": {m: t / tokens["fp16"] for m, t in tokens.items()}}


def _nll(logits: torch.Tensor, targets: list[int]) -> float:
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets), reduction="sum"))


def bench_stream(engine: Engine, length: int = 20_000, window: int = 2048, chunk: int = 256, sink: int = 4,
                 mode: str = "int8") -> dict:
    """Sink-window streaming perplexity vs sliding-window full attention, on the same scored tokens."""
    ids = sharegpt_stream(engine, length)
    model = engine.model
    reference_nll, scored = 0.0, 0
    for start in range(0, length - 1, chunk):  # full attention over the last window tokens, recomputed per chunk
        new = ids[start:min(start + chunk, length - 1)]
        context = ids[max(0, start - (window - chunk)):start] + new
        cache = engine.new_cache(sized_config(model.kv_layout, mode, window + 64))
        logits = run_tokens(model, context, all_logits=True, cache=cache).logits[-len(new):]
        reference_nll += _nll(logits, ids[start + 1:start + 1 + len(new)])
        scored += len(new)
    stream_nll, held, seq = 0.0, [], Sequence()
    cache = engine.new_cache(sized_config(model.kv_layout, mode, window + 2 * chunk))
    keep = OverflowPolicy("sink-window").keep_fraction
    for start in range(0, length - 1, chunk):
        new = ids[start:min(start + chunk, length - 1)]
        if len(held) + len(new) > window:  # the policy: keep the sinks and the recent tokens, prefill them again
            held = sink_window(held, sink, int(window * keep))[0]
            cache.free(seq)
            cache.allocate(seq, held)
            model.forward(held, 0, cache, seq)
            cache.append(seq, new)
        elif held:
            cache.append(seq, new)
        else:
            cache.allocate(seq, new)
        logits = model.forward(new, len(held), cache, seq, all_logits=True)
        stream_nll += _nll(logits, ids[start + 1:start + 1 + len(new)])
        held = held + new
    ppl_stream, ppl_ref = math.exp(stream_nll / scored), math.exp(reference_nll / scored)
    return {"tokens": length, "window": window, "chunk": chunk, "sink_tokens": sink, "mode": mode,
            "ppl_sink_window": ppl_stream, "ppl_full_attention_last_window": ppl_ref,
            "ratio": ppl_stream / ppl_ref}


def main(argv: list[str] | None = None) -> dict:
    """Run the chosen parts; print a short table and write JSON (+ PNG) to --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, type=Path)
    parser.add_argument("--part", nargs="+", default=["capacity", "ttft", "budget", "stream"],
                        choices=["capacity", "ttft", "budget", "stream"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine.load(args.engine)
    results: dict = {"engine": args.engine.name, "torch_threads": torch.get_num_threads()}
    for part in args.part:
        started = time.perf_counter()
        if part == "capacity":
            results[part] = bench_capacity(engine)
            r = results[part]
            print(f"capacity in {r['budget_mib']} MiB: " + ", ".join(
                f"{m} {t} tokens ({r['ratio_vs_fp16'][m]:.2f}x fp16)" for m, t in r["tokens"].items()))
        elif part == "ttft":
            results[part] = r = bench_ttft(engine)
            print(f"{'turn':>4} {'context':>8} {'new':>5} {'TTFT reuse ms':>14} {'TTFT re-prefill ms':>19}")
            for row in r["turns"]:
                print(f"{row['turn']:>4} {row['context_tokens']:>8} {row['new_tokens']:>5} "
                      f"{row['ttft_reuse_s'] * 1000:>14.0f} {row['ttft_reprefill_s'] * 1000:>19.0f}")
            print(f"TTFT turn {len(r['turns'])} / turn 2: reuse {r['reuse_ratio_last_vs_turn2']:.2f}x, "
                  f"re-prefill {r['reprefill_ratio_last_vs_turn2']:.2f}x")
        elif part == "budget":
            results[part] = r = bench_budget(engine, args.out)
            for policy, data in r.items():
                print(f"{policy}: {data['completed']}/{data['turns']} turns completed, first eviction at turn "
                      f"{data['first_eviction_turn']}, RSS growth after it {data['rss_growth_after_first_eviction_mib']} MiB")
        else:
            results[part] = r = bench_stream(engine)
            print(f"stream of {r['tokens']} tokens: sink-window {r['window']} ppl {r['ppl_sink_window']:.3f} vs "
                  f"full attention over the last {r['window']} tokens {r['ppl_full_attention_last_window']:.3f} "
                  f"(ratio {r['ratio']:.3f})")
        results[f"{part}_seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "dialogue_bench.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(json.dumps({k: v for k, v in results.items() if k != "budget"})[:4000])
    return results


if __name__ == "__main__":
    main()
