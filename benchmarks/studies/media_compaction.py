"""Media compaction over a long dialogue with pictures or speech, on random weights (they measure mechanics and
memory, never answers): the same dialogue at one KV budget with compaction on (``compact-media,drop-turns``) and off
(``drop-turns`` alone). Per run: the turns whose words the conversation still holds, the peak KV bytes, the tokens
prefilled again, and the time to the first token of a turn that compacts beside one that appends (from the call to
the first text, and the engine's: planning and compaction, the encoder, the prefill). One thread.

    python -m cabinllm.benchmarks.studies.media_compaction [--media pictures|audio] [--turns 30] [--picture-every 1]

``--media pictures``: a LLaVA-shaped model (LLaVA-1.5's 576-token pictures, a small text model, a tiny tower) and the
car's commands typed; the budget's default, 5 MiB at fp16 (2,048 bytes a token: 2,560 tokens), holds four turns with
a picture, and the words of all 30 turns (about 1,400 tokens) still fit beside a picture. ``--media audio``: a spoken
dialogue (two of the commands joined, spoken by espeak-ng, about 8 s: 200 audio tokens) on a Qwen2-Audio whose text
model has Qwen2-1.5B's KV shape (28 KiB a token at fp16); the default 64 MiB hold 2,340 tokens, about 9 spoken turns,
and the words of the 30 turns with their transcripts (from the speech front end, Whisper tiny.en) about 1,300. The
model and its engine are written into ``--work`` once (kept, and reused by the next run).
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.random_audio_lm import write_random_audio_lm
from cabinllm.benchmarks.random_vlm import image, write_random_vlm
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.cli.args import positive_float, positive_int
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.media import FeatureCache
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.sources.model_source import default_gguf_path
from cabinllm.runtime.sources.tokenizer_export import export_tokenizer
from cabinllm.runtime.speech.audio import Clip, read_wav

SHAPES = {"pictures": "llava-576", "audio": "qwen2-1.5b-kv"}  # random_vlm.SHAPES, random_audio_lm.TEXT_SHAPES
BUDGET_MB = {"pictures": 5.0, "audio": 64.0}
MEDIUM = {"pictures": "picture", "audio": "spoken"}  # what a turn with a medium is called
SPEECH_RATE = 100  # espeak-ng words a minute: two commands joined take about 8 s
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
    parser.add_argument("--picture-every", type=positive_int, default=1,
                        help="a picture (or clip) every this many turns; the others are typed")
    parser.add_argument("--kv-budget-mb", type=positive_float,
                        help=f"the KV budget ({KV_MODE}) in MiB (default: {BUDGET_MB})")
    parser.add_argument("--output", type=Path, help="results path, no suffix (default: media_compaction, with "
                                                    "_audio for audio, under benchmarks/results/voice)")
    args = parser.parse_args(argv)
    if args.media == "audio" and shutil.which("espeak-ng") is None:
        parser.error("--media audio speaks its turns with espeak-ng, which is not installed (apt-get install espeak-ng)")
    args.kv_budget_mb = args.kv_budget_mb or BUDGET_MB[args.media]
    args.output = args.output or RESULTS / "voice" / ("media_compaction_audio" if args.media == "audio"
                                                       else "media_compaction")
    return args


def prepare_model(work: Path, media: str) -> Engine:
    """The random HF folder of the medium's shape (the default model's tokenizer) and its engine, written once."""
    shape = SHAPES[media]
    folder, engine = work / shape, work / f"{shape}-engine"
    if not (folder / "config.json").is_file():
        tokenizer = work / "tokenizer"
        tokenizer.mkdir(parents=True, exist_ok=True)
        export_tokenizer(default_gguf_path(), tokenizer)
        if media == "audio":
            write_random_audio_lm(folder, text_shape=shape, tokenizer_json=tokenizer / "tokenizer.json")
        else:
            write_random_vlm(folder, shape, tokenizer_json=tokenizer / "tokenizer.json")
    if not (engine / "manifest.json").is_file():
        build_engine(BuildRequest(str(folder), engine, kv_cache=KV_MODE, dtype="float32"), log=lambda _msg: None)
    return Engine.load(engine)


def frame(i: int) -> tuple[str, bytes]:
    """Camera frame ``i``: its name and PNG bytes (random pixels)."""
    buffer = io.BytesIO()
    image(FRAME, FRAME, seed=i).save(buffer, "PNG")
    return f"frame-{i:02d}.png", buffer.getvalue()


def spoken(work: Path, commands: list[str], turns: int) -> list[Clip]:
    """Turn ``t``'s speech: commands ``t`` and ``t + 1 + t // n`` (of ``n``) joined, spoken by espeak-ng (so that no
    two turns say the same), as a clip named after the turn."""
    clips, n = [], len(commands)
    for turn in range(turns):
        path = work / "speech" / f"turn-{turn + 1:02d}.wav"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = f"{commands[turn % n]} {commands[(turn + 1 + turn // n) % n]}"
        subprocess.run(["espeak-ng", "-s", str(SPEECH_RATE), "-w", str(path), text], check=True, timeout=60,
                       capture_output=True)
        clips.append(read_wav(path.read_bytes(), path.name))
    return clips


def kind_of(stats, held: int, medium: str | None) -> str:
    """What a turn with a medium (``medium``: picture, spoken) or without did to make room: appended, compacted (then
    dropped turns), dropped turns, or rebuilt."""
    if stats.reused_tokens >= held:
        kind = "appends"
    elif stats.compacted:
        kind = "compacts, then drops turns" if stats.evicted_tokens else "compacts"
    else:
        kind = "drops turns" if stats.evicted_tokens else "rebuilds"
    return f"{kind}, {medium or 'text'} turn"


def run(engine: Engine, steps: str, commands: list[str], turns: int, every: int, budget: int,
        clips: list[Clip] | None = None) -> dict:
    """The dialogue on a fresh cache under the overflow ``steps``: each turn's figures. With ``clips`` (an
    audio-language engine) a turn with a medium is spoken (its clip, no typed words), else it shows a picture."""
    encoder = engine.audio if clips else engine.vision
    encoder.features = FeatureCache(encoder.features.max_bytes)  # each run encodes (and transcribes) its own media
    if clips:
        encoder.transcripts.clear()
    cache = engine.new_cache(KvCacheConfig(KV_MODE, budget))
    chat = DialogueSession(engine, cache, SamplingParams(REPLY_TOKENS, temperature=0, stop_token_ids=[]), SYSTEM,
                           OverflowPolicy.from_steps(steps))
    rows, start = [], time.perf_counter()
    for turn in range(turns):
        held = len(chat.seq)
        medium = MEDIUM["audio" if clips else "pictures"] if turn % every == 0 else None
        media = {"audio": [clips[turn]]} if clips else {"images": [frame(turn)]}
        first: list[float] = []
        called = time.perf_counter()
        stats = chat.chat("" if medium and clips else commands[turn % len(commands)], **(media if medium else {}),
                          on_text=lambda _piece: first or first.append(time.perf_counter()))
        ended = time.perf_counter()
        if stats.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"turn {turn + 1} ended {stats.finish_reason}: {stats.error}")
        asked = chat.messages[:-1]
        new = chat.tokenizer.frame_tokens(asked, chat.tokenizer.render(asked))[1]
        kind = kind_of(stats, held, medium)
        rows.append({"turn": turn + 1, "medium": medium, "kind": kind,
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
                       "median_engine_ttft_ms": statistics.median(r["engine_ttft_s"] for r in of) * 1e3,
                       "median_prefill_tokens": statistics.median(r["prefill_tokens"] for r in of),
                       "median_re_prefilled_tokens": statistics.median(r["re_prefilled_tokens"] for r in of)}
    return {"turns_held_at_end": rows[-1]["turns_held"],
            "mean_turns_held": statistics.mean(r["turns_held"] for r in rows),
            "peak_kv_bytes": max(r["kv_bytes_used"] for r in rows),
            "media_compacted": sum(len(r["compacted"]) for r in rows),
            "to_transcripts": sum(c["replacement"] == "transcript" for r in rows for c in r["compacted"]),
            "tokens_freed_by_compaction": sum(c["tokens"] for r in rows for c in r["compacted"]),
            "tokens_evicted": sum(r["evicted_tokens"] for r in rows),
            "tokens_prefilled": sum(r["prefill_tokens"] for r in rows),
            "tokens_re_prefilled": sum(r["re_prefilled_tokens"] for r in rows),
            "seconds": result["seconds"], "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    CPU_THREADS.use(1)
    engine = prepare_model(args.work, args.media)
    commands = [json.loads(line)["command"] for line in COMMANDS.read_text(encoding="utf-8").splitlines() if line]
    clips = spoken(args.work, commands, args.turns) if args.media == "audio" else None
    budget = int(args.kv_budget_mb * 2**20)
    warm = [Clip.from_pcm(clips[0].pcm[::-1].copy(), "warm-up.wav")] if clips else None  # none of the dialogue's
    run(engine, "drop-turns", commands, 1, 1, budget, warm)  # a warm-up turn: the first of a process pays one-time costs
    runs = {name: run(engine, steps, commands, args.turns, args.picture_every, budget, clips)
            for name, steps in RUNS.items()}
    medium = "audio" if clips else "pictures"
    tokens = [engine.audio.prepare(clip).tokens for clip in clips] if clips else \
        [engine.vision.prepare(frame(0)[1], "frame").image_tokens]
    result = {"machine": machine_info(),
              "command": " ".join(["python -m cabinllm.benchmarks.studies.media_compaction", *(argv or sys.argv[1:])]),
              "model": f"random weights, {SHAPES[medium]} shape", "media": medium, "kv_mode": KV_MODE,
              "budget_bytes": budget, "medium_tokens": round(statistics.mean(tokens)),
              "speech_seconds": round(statistics.mean(clip.seconds for clip in clips), 2) if clips else None,
              "text_config": {key: getattr(engine.config, key) for key in (
                  "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_size")},
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
    audio = result["media"] == "audio"
    medium = (f"a clip of {result['speech_seconds']:g} s ({result['medium_tokens']} audio tokens; means)" if audio
              else f"a {result['medium_tokens']}-token picture") + f" every {result['picture_every']}"
    text = result["text_config"]
    return "\n".join([
        f"# Media compaction ({result['model']}: random weights measure mechanics and memory, not answers; "
        f"{result['turns']} turns, {medium}, {result['reply_tokens']}-token replies, {result['kv_mode']} KV in "
        f"{result['budget_bytes'] / 2**20:g} MiB = {result['budget_bytes'] // per_token:,} tokens, 1 thread)", "",
        f"Text model: {text['num_hidden_layers']} layers of {text['hidden_size']}, {text['num_key_value_heads']} KV "
        f"heads of {text['head_size']}: {per_token:,} bytes of KV a token."
        + (" Transcripts by the speech front end (Whisper tiny.en); TTFT from the call includes preparing and "
           "transcribing the turn's clip, the engine's TTFT starts at planning." if audio else ""), "",
        f"Load average {result['machine']['load_average_1m']:.2f}. Command: `{result['command']}`.", "",
        "| | " + " | ".join(f"{name} ({result['runs'][name]['steps']})" for name in names) + " |",
        "|---|" + "---|" * len(names),
        line("turns whose words are held, at the end", lambda s: f"{s['turns_held_at_end']}"),
        line("turns held, mean over the dialogue", lambda s: f"{s['mean_turns_held']:.1f}"),
        line("peak KV MiB", lambda s: f"{s['peak_kv_bytes'] / 2**20:.2f}"),
        line("clips compacted, of them to transcripts (tokens freed)",
             lambda s: f"{s['media_compacted']}, {s['to_transcripts']} ({s['tokens_freed_by_compaction']:,})")
        if audio else line("pictures compacted (tokens freed)",
                           lambda s: f"{s['media_compacted']} ({s['tokens_freed_by_compaction']:,})"),
        line("tokens evicted by drop-turns", lambda s: f"{s['tokens_evicted']:,}"),
        line("tokens prefilled / of them again", lambda s: f"{s['tokens_prefilled']:,} / {s['tokens_re_prefilled']:,}"),
        line("dialogue seconds", lambda s: f"{s['seconds']:.1f}"), "",
        "| run | turn | turns | median TTFT ms (from the call / engine) | median prefilled | median prefilled again |",
        "|---|---|---|---|---|---|",
        *(f"| {name} | {kind} | {k['turns']} | {k['median_ttft_ms']:,.0f} / {k['median_engine_ttft_ms']:,.0f} | "
          f"{k['median_prefill_tokens']:,.0f} | {k['median_re_prefilled_tokens']:,.0f} |" for name, kind, k in kinds),
        "",
        *(["A turn that rebuilds met a previous reply whose text does not render back to it (a random reply ending "
           "inside a UTF-8 character): the session re-renders the conversation and prefills it again after the "
           "cached prefix, a random-weight artefact.", ""]
          if any(kind.startswith("rebuilds") for _, kind, _ in kinds) else [])])


if __name__ == "__main__":
    sys.exit(main())
