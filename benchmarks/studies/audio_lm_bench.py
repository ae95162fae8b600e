"""Speech in the dialogue of an audio-language model, on a tiny random Qwen2-Audio (random weights: mechanics and
the processor's cost, never answers) fed espeak-ng sentences: the tokens a second of speech takes, the time to prepare
a clip (the processor: 80 mel bins over the 30 s window and the placeholders) and that of the feature extractor
alone with Qwen2-Audio-7B's 128 mel bins, and per turn the tokens prefilled and reused
from the paged INT8 cache (a new clip, a text turn after it, the same clip in a new session on the same cache,
other speech of the same length). Then what that speech costs in KV at Qwen2-Audio-7B's text shape beside its
transcript (computed from the shape, not measured). One thread.

    python -m cabinllm.benchmarks.studies.audio_lm_bench [--work DIR] [--repeats N]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.random_audio_lm import write_random_audio_lm
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.builders.memory_model import kv_bytes_per_token
from cabinllm.cli.args import positive_int
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.sources.hf_names import config_from_hf
from cabinllm.runtime.speech.audio import SAMPLE_RATE, Clip, read_wav

SENTENCES = ("Turn on the seat heating.",
             "Navigate to the nearest charging station and avoid the motorway.",
             "Set the cabin to twenty one degrees, play some jazz and tell me when we reach the next exit.")
QUESTION = "Do what I asked."
FOLLOW_UP = "And how long will it take?"
SPEECH_SECONDS = 8
TRANSCRIPT_TOKENS_PER_SECOND = 3  # about what a transcript of speech takes (an estimate, not measured here)
# Qwen2-Audio-7B's text model (its config.json's text_config): a Qwen-7B shape without GQA
QWEN2_AUDIO_7B_TEXT = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 156032, "hidden_size": 4096,
                       "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                       "num_key_value_heads": 32, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.audio_lm_bench",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("out/audio_lm_bench"), help="where the model and engine go")
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs of each timed step")
    parser.add_argument("--output", type=Path, default=RESULTS / "voice" / "audio_lm_bench",
                        help="results path, no suffix")
    return parser.parse_args(argv)


def spoken(work: Path) -> list[Clip]:
    """Each sentence spoken by espeak-ng, as a clip."""
    clips = []
    for i, text in enumerate(SENTENCES):
        path = work / f"sentence-{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, timeout=60, capture_output=True)
        clips.append(read_wav(path.read_bytes(), path.name))
    return clips


def median_ms(call, repeats: int) -> float:
    """Median milliseconds of ``call()`` over ``repeats`` runs after one warm-up."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def features(engine: Engine, clips: list[Clip], repeats: int) -> list[dict]:
    """Per clip: its seconds, tokens, the milliseconds to prepare it (the processor, 80 mel bins) and those of the
    feature extractor alone at Qwen2-Audio-7B's 128 mel bins."""
    import transformers

    encoder = engine.audio
    large = transformers.WhisperFeatureExtractor(feature_size=128)
    rows = []
    for clip in clips:
        tokens = encoder.prepare(clip).tokens
        rows.append({"clip": clip.name, "seconds": round(clip.seconds, 3), "tokens": tokens,
                     "tokens_per_second": round(tokens / clip.seconds, 2),
                     "prepare_ms_80_mel": round(median_ms(lambda: encoder.prepare(clip), repeats), 2),
                     "features_ms_128_mel": round(median_ms(lambda: large(clip.pcm, sampling_rate=SAMPLE_RATE,
                                                                          return_tensors="pt"), repeats), 2)})
    return rows


def turns(engine: Engine, clip: Clip) -> list[dict]:
    """Tokens prefilled and reused per turn on one INT8 cache, and whether the encoder ran."""
    cache = engine.new_cache(KvCacheConfig("int8"), max_sequences=3)

    def session() -> DialogueSession:
        return DialogueSession(engine, cache, SamplingParams(1, temperature=0, stop_token_ids=[]))

    other = Clip.from_pcm(np.resize(clip.pcm[::-1].copy(), len(clip.pcm)), "reversed.wav")
    first, rows = session(), []
    for name, call in (("new clip", lambda: first.chat(QUESTION, audio=[clip])),
                       ("text turn after it", lambda: first.chat(FOLLOW_UP)),
                       ("same clip, new session, same cache", lambda: session().chat(QUESTION, audio=[clip])),
                       ("other speech, same length", lambda: session().chat(QUESTION, audio=[other]))):
        misses = engine.audio.features.misses
        stats = call()
        rows.append({"turn": name, "prefill_tokens": stats.prefill_tokens, "reused_tokens": stats.reused_tokens,
                     "encoder_ran": engine.audio.features.misses > misses})
    return rows


def kv_cost() -> dict:
    """KV bytes of SPEECH_SECONDS of speech and of its transcript at Qwen2-Audio-7B's text shape, fp16 and INT8."""
    config = config_from_hf(QWEN2_AUDIO_7B_TEXT, "Qwen2-Audio-7B text_config")
    speech, transcript = 25 * SPEECH_SECONDS, TRANSCRIPT_TOKENS_PER_SECOND * SPEECH_SECONDS
    out = {"seconds": SPEECH_SECONDS, "speech_tokens": speech, "transcript_tokens": transcript}
    for dtype in ("fp16", "int8"):
        per_token = kv_bytes_per_token(config, dtype, 64)
        out[dtype] = {"bytes_per_token": per_token, "speech_mib": round(speech * per_token / 2**20, 2),
                      "transcript_mib": round(transcript * per_token / 2**20, 2)}
    return out


def table(result: dict) -> str:
    """The figures as markdown."""
    m = result["machine"]
    lines = ["# Speech on a tiny random Qwen2-Audio (mechanics only)", "",
             f"`{result['command']}`; {m['cpu']}, {m['cores']} cores, load {m['load_average_1m']:.2f}, "
             f"{m['torch_threads']} torch thread.", "",
             "| clip | seconds | tokens | tokens/s | prepare ms (processor, 80 mel) | features ms (128 mel) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['clip']} | {r['seconds']} | {r['tokens']} | {r['tokens_per_second']} | {r['prepare_ms_80_mel']} "
              f"| {r['features_ms_128_mel']} |" for r in result["clips"]]
    lines += ["", "| turn (INT8 KV, one cache) | prefilled | reused | encoder ran |", "|---|---|---|---|"]
    lines += [f"| {r['turn']} | {r['prefill_tokens']} | {r['reused_tokens']} | {r['encoder_ran']} |"
              for r in result["turns"]]
    kv = result["kv_qwen2_audio_7b"]
    lines += ["", f"KV of {kv['seconds']} s of speech at Qwen2-Audio-7B's text shape (computed): "
              f"{kv['speech_tokens']} tokens = {kv['fp16']['speech_mib']} MiB fp16, {kv['int8']['speech_mib']} MiB "
              f"INT8; its transcript (~{kv['transcript_tokens']} tokens) {kv['int8']['transcript_mib']} MiB INT8.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the study and write its results."""
    args = parse_args(argv)
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install espeak-ng)")
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    folder, engine_dir = args.work / "qwen2-audio-tiny", args.work / "qwen2-audio-tiny-engine"
    if not (folder / "config.json").is_file():
        write_random_audio_lm(folder)
    if not (engine_dir / "manifest.json").is_file():
        build_engine(BuildRequest(str(folder), engine_dir, kv_cache="int8", dtype="float32"), log=lambda _msg: None)
    engine, clips = Engine.load(engine_dir), spoken(args.work)
    result = {"command": "python -m cabinllm.benchmarks.studies.audio_lm_bench"
                         + (f" --repeats {args.repeats}" if args.repeats != 5 else ""),
              "machine": machine_info(), "weights": "random (mechanics only)",
              "clips": features(engine, clips, args.repeats), "turns": turns(engine, clips[1]),
              "kv_qwen2_audio_7b": kv_cost()}
    write_results(args.output, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
