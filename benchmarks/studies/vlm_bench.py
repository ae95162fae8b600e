"""Pictures in the dialogue on a random-weight model of SmolVLM-256M's shape (a SigLIP-B/16 tower at 512 px, 64
tokens a tile, on SmolLM2-135M's text shape and the default model's tokenizer): the vision encoder's time per
picture, the time to the first token of a turn with a new picture, of a text turn after it, of the identical
request again and of the same picture sent again later, beside transformers' ``generate`` on the same weights and
messages; KV bytes per picture and the turns with a picture a 64 MiB budget holds, fp16 and INT8. Random weights
measure speed and memory, never answers. One thread.

    python -m cabinllm.benchmarks.studies.vlm_bench [--work DIR] [--repeats N]

The model and its engine are written into ``--work`` (about 1.4 GB; kept, and reused by the next run). A turn's
time is the wall time of a call that writes one reply token, preprocessing included, on either side.
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.random_vlm import image, write_random_vlm
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.cli.args import positive_int
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import DEFAULT_KV_BYTES, KvCacheConfig
from cabinllm.runtime.model.threads import CPU_THREADS
from cabinllm.runtime.model.vision import FeatureCache
from cabinllm.runtime.sources.model_source import default_gguf_path
from cabinllm.runtime.sources.tokenizer_export import export_tokenizer

SHAPE = "smolvlm-256m"
FRAME = (1280, 720)  # a cabin camera's frame
SYSTEM = "You are the car's assistant. Answer in one short sentence."
FIRST = "What is behind the car in this camera picture?"
SECOND = "Is it safe to change into the left lane now?"
LATER = "Look at the camera again: has anything changed?"
REPLY_TOKENS = 16  # each reply in the capacity run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.vlm_bench",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("out/vlm_bench"), help="where the model and engine go")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs of each timed turn")
    parser.add_argument("--output", type=Path, default=RESULTS / "vlm_bench", help="results path, no suffix")
    return parser.parse_args(argv)


def prepare_model(work: Path) -> tuple[Path, Engine]:
    """The random SmolVLM-256M-shaped HF folder and its engine (float32 weights, INT8 KV), written once."""
    folder, engine = work / SHAPE, work / f"{SHAPE}-engine"
    if not (folder / "config.json").is_file():
        tokenizer = work / "tokenizer"
        tokenizer.mkdir(parents=True, exist_ok=True)
        export_tokenizer(default_gguf_path(), tokenizer)
        write_random_vlm(folder, SHAPE, tokenizer_json=tokenizer / "tokenizer.json")
    if not (engine / "manifest.json").is_file():
        build_engine(BuildRequest(str(folder), engine, kv_cache="int8", dtype="float32"), log=lambda _msg: None)
    return folder, Engine.load(engine)


def picture(seed: int) -> bytes:
    """A random camera frame as PNG bytes."""
    buffer = io.BytesIO()
    image(*FRAME, seed=seed).save(buffer, "PNG")
    return buffer.getvalue()


def timed(call) -> tuple[float, object]:
    """Wall seconds of ``call()`` and what it returned."""
    t0 = time.perf_counter()
    out = call()
    return time.perf_counter() - t0, out


def new_session(engine: Engine, mode: str, cache=None, reply_tokens: int = 1,
                overflow: OverflowPolicy | None = None) -> DialogueSession:
    """A greedy session (``reply_tokens`` a reply) on a ``mode`` KV cache of the budget, or on ``cache``."""
    cache = cache or engine.new_cache(KvCacheConfig(mode), max_sequences=2)
    return DialogueSession(engine, cache, SamplingParams(reply_tokens, temperature=0, stop_token_ids=[]), SYSTEM,
                           overflow)


def ours(engine: Engine, data: bytes) -> dict:
    """One run of the four turns on the reference engine, the encoder's cache empty at the start."""
    engine.vision.features = FeatureCache(engine.vision.features.max_bytes)
    session = new_session(engine, "int8")
    rows = {}
    for name, call in (("new picture", lambda: session.chat(FIRST, images=[("cam.png", data)])),
                       ("text turn after it", lambda: session.chat(SECOND)),
                       ("identical request again", lambda: new_session(engine, "int8", session.cache).chat(
                           FIRST, images=[("cam.png", data)])),
                       ("same picture, later turn", lambda: session.chat(LATER, images=[("cam.png", data)]))):
        seconds, stats = timed(call)
        rows[name] = {"s": seconds, "prefill_tokens": stats.prefill_tokens, "reused_tokens": stats.reused_tokens}
    return rows


def theirs(folder: Path, model, processor, data: bytes) -> dict:
    """transformers' generate (one new token) on the same messages: the first turn and the second."""
    from PIL import Image

    picture_part = [{"type": "image"}, {"type": "text", "text": FIRST}]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": picture_part}]
    second = first + [{"role": "assistant", "content": "A car."}, {"role": "user", "content": SECOND}]

    def run(messages: list[dict]) -> None:
        text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        pixels = Image.open(io.BytesIO(data)).convert("RGB")
        inputs = processor(text=[text], images=[[pixels]], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)

    return {"new picture": timed(lambda: run(first))[0], "text turn after it": timed(lambda: run(second))[0]}


def encoder_ms(engine: Engine, data: bytes, repeats: int) -> dict:
    """The vision encoder's milliseconds (median of ``repeats`` after a warm-up) and the tokens of one frame,
    detail auto and low."""
    vision, out = engine.vision, {}
    for detail in ("auto", "low"):
        prepared = vision.prepare(data, "cam.png", detail)
        with torch.inference_mode():  # as Vision.encode runs it
            vision._features(prepared.inputs)
            seconds = statistics.median(timed(lambda: vision._features(prepared.inputs))[0] for _ in range(repeats))
        out[detail] = {"ms": seconds * 1e3, "tokens": prepared.image_tokens, "image_rows": len(prepared.offsets)}
    return out


def capacity(engine: Engine, data: bytes) -> dict:
    """Per KV dtype: a picture's KV bytes and the turns with a picture that the budget holds (the same frame each
    turn: encoded once, its KV computed at each turn's place; the overflow policy "error" ends the run)."""
    out = {}
    for mode in ("fp16", "int8"):
        session = new_session(engine, mode, reply_tokens=REPLY_TOKENS,
                              overflow=OverflowPolicy("error", compact_media=False))
        turns = 0
        while session.chat(LATER, images=[("cam.png", data)]).finish_reason != "capacity":
            turns += 1
        per_token = session.cache.stats().bytes_per_token
        tokens = engine.vision.prepare(data, "cam.png").image_tokens
        out[mode] = {"bytes_per_token": per_token, "kv_bytes_per_picture": per_token * tokens,
                     "picture_turns_in_budget": turns, "tokens_held": len(session.seq)}
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    import transformers

    args = parse_args(argv)
    CPU_THREADS.use(1)
    folder, engine = prepare_model(args.work)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).float().eval()
    processor, data = engine.vision.processor, picture(1)
    runs, peer = [], []
    encoder = encoder_ms(engine, data, args.repeats)
    for _ in range(args.repeats):
        runs.append(ours(engine, data))
        peer.append(theirs(folder, model, processor, data))
    rows = {name: {key: statistics.median(run[name][key] for run in runs) for key in runs[0][name]}
            for name in runs[0]}
    for name in peer[0]:
        rows[name]["transformers_s"] = statistics.median(run[name] for run in peer)
    fits = capacity(engine, data)
    first = rows["new picture"]["s"]
    result = {"machine": machine_info(), "command": " ".join(["python -m cabinllm.benchmarks.studies.vlm_bench",
                                                               *(argv or sys.argv[1:])]),
              "model": f"random weights, {SHAPE} shape", "frame": list(FRAME), "repeats": args.repeats,
              "encoder": encoder, "turns": rows, "capacity": fits, "budget_bytes": DEFAULT_KV_BYTES,
              "ratios_to_the_new_picture_turn": {name: row["s"] / first for name, row in rows.items()},
              "int8_over_fp16_picture_turns": fits["int8"]["picture_turns_in_budget"]
              / max(fits["fp16"]["picture_turns_in_budget"], 1), "runs": runs, "transformers_runs": peer}
    write_results(args.output, result, table(result))
    return 0


def table(result: dict) -> str:
    """The results as a short Markdown page."""
    enc, fits, rows = result["encoder"], result["capacity"], result["turns"]
    ratios = result["ratios_to_the_new_picture_turn"]
    return "\n".join([
        f"# Pictures in the dialogue ({result['model']}: random weights measure speed and memory, not answers; a "
        f"{FRAME[0]}x{FRAME[1]} camera frame, 1 thread, median of {result['repeats']})", "",
        f"Load average {result['machine']['load_average_1m']:.2f}. Command: `{result['command']}`.", "",
        "| vision encoder | tokens | image rows | ms |", "|---|---|---|---|",
        *(f"| detail {d} | {e['tokens']} | {e['image_rows']} | {e['ms']:,.0f} |" for d, e in enc.items()), "",
        "| turn (INT8 KV) | time to first token s | / new picture | prefilled | reused | transformers generate s |",
        "|---|---|---|---|---|---|",
        *(f"| {name} | {row['s']:.2f} | {ratios[name]:.3f}x | {row['prefill_tokens']:.0f} | "
          f"{row['reused_tokens']:.0f} | {row['transformers_s']:.2f} |" if "transformers_s" in row else
          f"| {name} | {row['s']:.2f} | {ratios[name]:.3f}x | {row['prefill_tokens']:.0f} | "
          f"{row['reused_tokens']:.0f} | - |" for name, row in rows.items()), "",
        f"| KV dtype | bytes/token | KV MiB per picture | turns with a picture in {result['budget_bytes'] >> 20} MiB "
        f"({REPLY_TOKENS}-token replies) |", "|---|---|---|---|",
        *(f"| {mode} | {f['bytes_per_token']:,} | {f['kv_bytes_per_picture'] / (1 << 20):.2f} | "
          f"{f['picture_turns_in_budget']} |" for mode, f in fits.items()), "",
        f"INT8 / fp16 turns with a picture: {result['int8_over_fp16_picture_turns']:.2f}x.", ""])


if __name__ == "__main__":
    sys.exit(main())
