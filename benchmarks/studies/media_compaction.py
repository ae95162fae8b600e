"""Media compaction over a long dialogue with pictures, on a random-weight LLaVA-shaped model (LLaVA-1.5's 576-token
pictures, a small text model, a tiny tower; random weights measure mechanics and memory, never answers): the same
dialogue at one KV budget with compaction on (``compact-media,drop-turns``) and off (``drop-turns`` alone). Per run:
the turns whose words the conversation still holds, the peak KV bytes, the tokens prefilled again, and the time to
the first token of a turn that compacts beside one that appends (from the call to the first text: the picture's
preprocessing, planning and compaction, the encoder, the prefill). One thread.

    python -m cabinllm.benchmarks.studies.media_compaction [--turns 30] [--picture-every 1] [--kv-budget-mb 5]

The model and its engine are written into ``--work`` once (kept, and reused by the next run). The budget's default,
5 MiB at fp16 (2,048 bytes a token: 2,560 tokens), holds four turns with a picture: the dialogue overflows from its
fifth turn on, and the words of all 30 turns (about 1,400 tokens) still fit beside a picture, so compaction can keep
every word where drop-turns alone keeps the last turn or two.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.random_vlm import image, write_random_vlm
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.cli.args import positive_float, positive_int
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.model.vision import FeatureCache
from cabinllm.runtime.sources.model_source import default_gguf_path
from cabinllm.runtime.sources.tokenizer_export import export_tokenizer

SHAPE = "llava-576"
KV_MODE = "fp16"
SYSTEM = "You are the car's assistant. Answer in one short sentence."
COMMANDS = Path(__file__).parent / "data" / "vehicle_commands_16.jsonl"  # the user's words, in turn
REPLY_TOKENS = 16
FRAME = 336  # the picture's side in pixels (LLaVA-1.5's crop)
RUNS = {"compaction on": "compact-media,drop-turns", "compaction off": "drop-turns"}
MEDIA = ("pictures", "audio")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.media_compaction",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("out/media_compaction"), help="where the model and engine go")
    parser.add_argument("--media", choices=MEDIA, default="pictures",
                        help="what the user's turns show: pictures (a vision-language engine) or audio clips")
    parser.add_argument("--turns", type=positive_int, default=30, help="user turns of the dialogue")
    parser.add_argument("--picture-every", type=positive_int, default=1, help="a picture every this many turns")
    parser.add_argument("--kv-budget-mb", type=positive_float, default=5.0, help=f"the KV budget ({KV_MODE}) in MiB")
    parser.add_argument("--output", type=Path, default=RESULTS / "voice" / "media_compaction",
                        help="results path, no suffix")
    args = parser.parse_args(argv)
    if args.media == "audio":
        parser.error("--media audio needs an audio-language engine (Qwen2-Audio's shape), which this study cannot "
                     "build yet; compaction of audio parts to their transcripts is tested in tests/test_compaction.py; "
                     "use --media pictures")
    return args


def prepare_model(work: Path) -> Engine:
    """The random LLaVA-shaped HF folder (the default model's tokenizer) and its engine, written once."""
    folder, engine = work / SHAPE, work / f"{SHAPE}-engine"
    if not (folder / "config.json").is_file():
        tokenizer = work / "tokenizer"
        tokenizer.mkdir(parents=True, exist_ok=True)
        export_tokenizer(default_gguf_path(), tokenizer)
        write_random_vlm(folder, SHAPE, tokenizer_json=tokenizer / "tokenizer.json")
    if not (engine / "manifest.json").is_file():
        build_engine(BuildRequest(str(folder), engine, kv_cache=KV_MODE, dtype="float32"), log=lambda _msg: None)
    return Engine.load(engine)


def frame(i: int) -> tuple[str, bytes]:
    """Camera frame ``i``: its name and PNG bytes (random pixels)."""
    buffer = io.BytesIO()
    image(FRAME, FRAME, seed=i).save(buffer, "PNG")
    return f"frame-{i:02d}.png", buffer.getvalue()


def kind_of(stats, held: int, picture: bool) -> str:
    """What a turn with or without a picture did to make room: appended, compacted (then dropped turns), dropped
    turns, or rebuilt."""
    if stats.reused_tokens >= held:
        kind = "appends"
    elif stats.compacted:
        kind = "compacts, then drops turns" if stats.evicted_tokens else "compacts"
    else:
        kind = "drops turns" if stats.evicted_tokens else "rebuilds"
    return f"{kind}, {'picture' if picture else 'text'} turn"


def run(engine: Engine, steps: str, commands: list[str], turns: int, every: int, budget: int) -> dict:
    """The dialogue on a fresh cache under the overflow ``steps``: each turn's figures."""
    engine.vision.features = FeatureCache(engine.vision.features.max_bytes)  # each run encodes its own pictures
    cache = engine.new_cache(KvCacheConfig(KV_MODE, budget))
    chat = DialogueSession(engine, cache, SamplingParams(REPLY_TOKENS, temperature=0, stop_token_ids=[]), SYSTEM,
                           OverflowPolicy.from_steps(steps))
    rows, start = [], time.perf_counter()
    for turn in range(turns):
        held = len(chat.seq)
        pictures = [frame(turn)] if turn % every == 0 else None
        first: list[float] = []
        called = time.perf_counter()
        stats = chat.chat(commands[turn % len(commands)], images=pictures,
                          on_text=lambda _piece: first or first.append(time.perf_counter()))
        ended = time.perf_counter()
        if stats.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"turn {turn + 1} ended {stats.finish_reason}: {stats.error}")
        asked = chat.messages[:-1]
        new = chat.tokenizer.frame_tokens(asked, chat.tokenizer.render(asked))[1]
        kind = kind_of(stats, held, bool(pictures))
        rows.append({"turn": turn + 1, "picture": bool(pictures), "kind": kind,
                     "ttft_s": (first[0] if first else ended) - called, "engine_ttft_s": stats.ttft_s,
                     "prefill_tokens": stats.prefill_tokens, "reused_tokens": stats.reused_tokens,
                     "re_prefilled_tokens": 0 if kind.startswith("appends") else max(stats.prefill_tokens - new, 0),
                     "evicted_tokens": stats.evicted_tokens, "kv_bytes_used": stats.kv_bytes_used,
                     "tokens_held": len(chat.seq), "compacted": [vars(c) for c in stats.compacted],
                     "turns_held": sum(m["role"] == "user" for m in chat.messages)})
    return {"steps": steps, "seconds": time.perf_counter() - start, "turns": rows,
            "bytes_per_token": cache.stats().bytes_per_token}


def summary(result: dict) -> dict:
    """A run's totals and its turns by kind (median time to the first token)."""
    rows = result["turns"]
    kinds = {}
    for kind in dict.fromkeys(row["kind"] for row in rows):
        of = [row for row in rows if row["kind"] == kind]
        kinds[kind] = {"turns": len(of), "median_ttft_ms": statistics.median(r["ttft_s"] for r in of) * 1e3,
                       "median_prefill_tokens": statistics.median(r["prefill_tokens"] for r in of),
                       "median_re_prefilled_tokens": statistics.median(r["re_prefilled_tokens"] for r in of)}
    return {"turns_held_at_end": rows[-1]["turns_held"],
            "mean_turns_held": statistics.mean(r["turns_held"] for r in rows),
            "peak_kv_bytes": max(r["kv_bytes_used"] for r in rows),
            "pictures_compacted": sum(len(r["compacted"]) for r in rows),
            "tokens_freed_by_compaction": sum(c["tokens"] for r in rows for c in r["compacted"]),
            "tokens_evicted": sum(r["evicted_tokens"] for r in rows),
            "tokens_prefilled": sum(r["prefill_tokens"] for r in rows),
            "tokens_re_prefilled": sum(r["re_prefilled_tokens"] for r in rows),
            "seconds": result["seconds"], "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    CPU_THREADS.use(1)
    engine = prepare_model(args.work)
    commands = [json.loads(line)["command"] for line in COMMANDS.read_text(encoding="utf-8").splitlines() if line]
    budget = int(args.kv_budget_mb * 2**20)
    run(engine, "drop-turns", commands, 1, 1, budget)  # a warm-up turn: the first of a process pays one-time costs
    runs = {name: run(engine, steps, commands, args.turns, args.picture_every, budget) for name, steps in RUNS.items()}
    result = {"machine": machine_info(),
              "command": " ".join(["python -m cabinllm.benchmarks.studies.media_compaction", *(argv or sys.argv[1:])]),
              "model": f"random weights, {SHAPE} shape", "kv_mode": KV_MODE, "budget_bytes": budget,
              "picture_tokens": engine.vision.prepare(frame(0)[1], "frame").image_tokens,
              "turns": args.turns, "picture_every": args.picture_every, "reply_tokens": REPLY_TOKENS,
              "summary": {name: summary(r) for name, r in runs.items()}, "runs": runs}
    write_results(args.output, result, table(result))
    return 0


def table(result: dict) -> str:
    """The results as a short Markdown page."""
    runs = result["summary"]
    names = list(runs)
    per_token = next(iter(result["runs"].values()))["bytes_per_token"]

    def line(label: str, value) -> str:
        return f"| {label} | " + " | ".join(value(runs[name]) for name in names) + " |"

    kinds = [(name, kind, k) for name in names for kind, k in runs[name]["kinds"].items()]
    return "\n".join([
        f"# Media compaction ({result['model']}: random weights measure mechanics and memory, not answers; "
        f"{result['turns']} turns, a {result['picture_tokens']}-token picture every {result['picture_every']}, "
        f"{result['reply_tokens']}-token replies, {result['kv_mode']} KV in {result['budget_bytes'] / 2**20:g} MiB "
        f"= {result['budget_bytes'] // per_token:,} tokens, 1 thread)", "",
        f"Load average {result['machine']['load_average_1m']:.2f}. Command: `{result['command']}`.", "",
        "| | " + " | ".join(f"{name} ({result['runs'][name]['steps']})" for name in names) + " |",
        "|---|" + "---|" * len(names),
        line("turns whose words are held, at the end", lambda s: f"{s['turns_held_at_end']}"),
        line("turns held, mean over the dialogue", lambda s: f"{s['mean_turns_held']:.1f}"),
        line("peak KV MiB", lambda s: f"{s['peak_kv_bytes'] / 2**20:.2f}"),
        line("pictures compacted (tokens freed)",
             lambda s: f"{s['pictures_compacted']} ({s['tokens_freed_by_compaction']:,})"),
        line("tokens evicted by drop-turns", lambda s: f"{s['tokens_evicted']:,}"),
        line("tokens prefilled / of them again", lambda s: f"{s['tokens_prefilled']:,} / {s['tokens_re_prefilled']:,}"),
        line("dialogue seconds", lambda s: f"{s['seconds']:.1f}"), "",
        "| run | turn | turns | median TTFT ms | median prefilled | median prefilled again |",
        "|---|---|---|---|---|---|",
        *(f"| {name} | {kind} | {k['turns']} | {k['median_ttft_ms']:,.0f} | {k['median_prefill_tokens']:,.0f} | "
          f"{k['median_re_prefilled_tokens']:,.0f} |" for name, kind, k in kinds), "",
        *(["A turn that rebuilds met a previous reply whose text does not render back to it (a random reply ending "
           "inside a UTF-8 character): the session re-renders the conversation and prefills it again after the "
           "cached prefix, a random-weight artefact.", ""]
          if any(kind.startswith("rebuilds") for _, kind, _ in kinds) else [])])


if __name__ == "__main__":
    sys.exit(main())
