"""The speech front end on in-car commands: word error rate and real-time factor, and whether a spoken command gives
the default model the same tool call as the typed one.

Each of 40 commands (``data/voice_commands.jsonl``: the text and the call it means against the car's functions,
cli/data/vehicle_functions.json) is spoken by espeak-ng in two voices, then heard clean and with pink noise (sox)
mixed in at 10 dB SNR (noise RMS scaled to the RMS of the speech's active 20 ms frames, those within 30 dB of the
loudest). Each clip is transcribed by the speech front end (Whisper tiny.en, int8, ``--asr-threads``, the car's
words as its initial prompt unless ``--asr-prompt ""``): WER (jiwer) after ``normalize`` (lowercase, punctuation out,
number words as digits, % as "percent") and the real-time factor (ASR seconds per second of audio, the model loaded
beforehand, each clip's least of ``--repeats`` runs). Then the default model's greedy call
(tool_choice "required", one request at a time on the batched scheduler, as the tool_calls study runs them) is taken
for the typed text and for each transcript, and the two compared: function name and arguments (JSON) equal.

    taskset -c 0 python -m cabinllm.benchmarks.studies.speech_wer --engine engines/smollm2-int8
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jiwer
import numpy as np
import torch
from tqdm import tqdm

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.benchmarks.studies.tool_calls import read_commands, run_requests
from cabinllm.cli.args import positive_int
from cabinllm.cli.chat import BUILTIN_TOOLS
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.model.tools import read_tools
from cabinllm.runtime.speech.asr import AsrConfig, front_end
from cabinllm.runtime.speech.audio import SAMPLE_RATE, Clip, read_wav

COMMANDS = Path(__file__).parent / "data" / "voice_commands.jsonl"
VOICES = {"en-us": ("-v", "en-us"), "en-gb+m3 slow": ("-v", "en-gb+m3", "-s", "150")}  # espeak-ng's arguments
SNR_DB = 10.0
FRAME = SAMPLE_RATE // 50  # 20 ms, the frames whose RMS tells speech from the pauses
ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen").split()
TENS = dict(zip("twenty thirty forty fifty sixty seventy eighty ninety".split(), range(20, 100, 10)))
NUMBER_WORDS = {**{word: value for value, word in enumerate(ONES)}, **TENS, "hundred": 100}


def speak(text: str, voice: tuple[str, ...], folder: Path) -> Clip:
    """``text`` spoken by espeak-ng in ``voice`` as a 16 kHz clip."""
    wav = folder / "speech.wav"
    subprocess.run(["espeak-ng", *voice, "-w", str(wav), text], check=True, timeout=60)
    return read_wav(wav.read_bytes(), text)


def pink_noise(seconds: float, folder: Path) -> np.ndarray:
    """``seconds`` of pink noise from sox (its repeatable seed: the same noise every run)."""
    wav = folder / "noise.wav"
    subprocess.run(["sox", "-R", "-n", "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", str(wav), "synth",
                    f"{seconds:.3f}", "pinknoise"], check=True, timeout=60)
    return read_wav(wav.read_bytes(), "noise").pcm


def speech_rms(pcm: np.ndarray) -> float:
    """RMS of a clip's active speech: its 20 ms frames within 30 dB of the loudest."""
    frames = pcm[: len(pcm) // FRAME * FRAME].reshape(-1, FRAME)
    power = (frames.astype(np.float64) ** 2).mean(axis=1)
    return float(np.sqrt(power[power >= power.max() * 10 ** (-30 / 10)].mean()))


def with_noise(clip: Clip, noise: np.ndarray, snr_db: float) -> Clip:
    """The clip with ``noise`` mixed in at ``snr_db`` below its speech's RMS."""
    noise = noise[: len(clip.pcm)]
    scale = speech_rms(clip.pcm) / 10 ** (snr_db / 20) / float(np.sqrt((noise.astype(np.float64) ** 2).mean()))
    return Clip.from_pcm(clip.pcm + scale * noise, f"{clip.name} + noise {snr_db:g} dB")


def normalize(text: str) -> str:
    """Words as WER compares them: lowercase, % as "percent", punctuation out, number words (0-999) as digits."""
    words = re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("%", " percent").replace("-", " ")).replace("'", "")
    out: list[str] = []
    number: int | None = None
    for word in words.split():
        if word in NUMBER_WORDS:
            value = NUMBER_WORDS[word]
            number = (number or 0) * 100 if word == "hundred" else (number or 0) + value
            continue
        if number is not None:
            out.append(str(number))
            number = None
        out.append(word)
    return " ".join(out + ([str(number)] if number is not None else []))


def hear_all(commands: list[dict], config: AsrConfig, folder: Path, repeats: int) -> tuple[list[dict], float]:
    """Every command in every voice, clean and noisy, transcribed: one row per clip (its ASR seconds the least of
    ``repeats`` runs, the machine being shared); and the model's load time."""
    start = time.perf_counter()
    asr = front_end(config)
    load_s = time.perf_counter() - start
    rows = []
    with tqdm(total=len(commands) * len(VOICES) * 2, desc="speak and hear", unit="clip") as progress:
        for voice, voice_args in VOICES.items():
            for command in commands:
                clean = speak(command["text"], voice_args, folder)
                noisy = with_noise(clean, pink_noise(clean.seconds + 0.1, folder), SNR_DB)
                for noise, clip in (("clean", clean), (f"pink {SNR_DB:g} dB", noisy)):
                    heard = asr.transcribe(clip)
                    asr_s = min([heard.asr_s] + [asr.transcribe(clip).asr_s for _ in range(repeats - 1)])
                    rows.append({"voice": voice, "noise": noise, "text": command["text"], "heard": heard.text,
                                 "audio_s": heard.audio_s, "asr_s": asr_s,
                                 "wer": jiwer.wer(normalize(command["text"]), normalize(heard.text) or "<none>")})
                    progress.update()
    return rows, load_s


def calls_of(engine: Engine, tools_path: Path, texts: list[str], max_new_tokens: int) -> dict[str, dict | None]:
    """The default model's greedy call for each distinct text (name and parsed arguments; None: no whole call)."""
    tools = read_tools(tools_path)
    tool_format = engine.tokenizer.with_tools(tools).tool_format
    distinct = list(dict.fromkeys(texts))
    requests = run_requests(engine, tools, [{"command": text} for text in distinct], "tools", max_new_tokens,
                            sessions=1)
    calls = {}
    for text, request in zip(distinct, requests):
        parsed = tool_format.parse(request.text) or []
        try:
            calls[text] = {"name": parsed[0][0], "arguments": json.loads(parsed[0][1])} if parsed else None
        except ValueError:
            calls[text] = None
    return calls


def same_call(a: dict | None, b: dict | None) -> bool:
    """Whether two calls are one: the same function with equal arguments (strings compared as ``normalize``s)."""
    def canonical(call: dict) -> tuple:
        return call["name"], {k: normalize(v) if isinstance(v, str) else v for k, v in call["arguments"].items()}
    return a is not None and b is not None and canonical(a) == canonical(b)


def summarize(rows: list[dict]) -> dict:
    """One condition's figures: WER over its clips, RTF, and the calls that agree with the typed command's."""
    refs, hyps = [normalize(r["text"]) for r in rows], [normalize(r["heard"]) or "<none>" for r in rows]
    exact = [r for r in rows if normalize(r["text"]) == normalize(r["heard"])]
    return {"clips": len(rows), "wer": jiwer.wer(refs, hyps),
            "exact_transcripts": len(exact), "same_call_when_exact": sum(r["agrees"] for r in exact),
            "rtf": sum(r["asr_s"] for r in rows) / sum(r["audio_s"] for r in rows),
            "rtf_max": max(r["asr_s"] / r["audio_s"] for r in rows),
            "audio_s_mean": sum(r["audio_s"] for r in rows) / len(rows),
            "same_call_as_typed": sum(r["agrees"] for r in rows),
            "same_call_strict": sum(r["call"] is not None and r["call"] == r["typed_call"] for r in rows),
            "meant_call": sum(r["meant"] for r in rows)}


def markdown(result: dict) -> str:
    """The figures as a markdown table."""
    typed = result["typed"]
    lines = [f"# Speech front end on {result['commands']} in-car commands ({result['asr']}, {result['asr_threads']} "
             f"thread(s), {'with' if result['asr_prompt'] else 'no'} initial prompt; calls: {result['engine']}, "
             f"greedy, {result['threads']} thread(s); load "
             f"{result['machine']['load_average_1m']:.2f})", "",
             f"Typed: the model's call is the one meant for {typed['meant_call']}/{result['commands']} commands. "
             f"ASR model load {result['asr_load_s']:.2f} s (not in the RTF); a clip's ASR seconds: the least of "
             f"{result['asr_repeats']} runs. RTF all: ASR seconds over audio seconds of the 40 clips.", "",
             "| voice | noise | WER | exact transcripts | RTF (all / max) | same call as typed | same call, exact "
             "transcripts | call meant |", "|---|---|---|---|---|---|---|---|"]
    for c in result["conditions"]:
        lines.append(f"| {c['voice']} | {c['noise']} | {c['wer']:.1%} | {c['exact_transcripts']}/{c['clips']} | "
                     f"{c['rtf']:.3f} / {c['rtf_max']:.3f} | {c['same_call_as_typed']}/{c['clips']} | "
                     f"{c['same_call_when_exact']}/{c['exact_transcripts']} | {c['meant_call']}/{c['clips']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.speech_wer",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder of the default model (cabin-build)")
    parser.add_argument("--commands", type=Path, default=COMMANDS, help="JSONL of {text, call: {name, arguments}}")
    parser.add_argument("--tools", type=Path, default=BUILTIN_TOOLS, help="JSON file of OpenAI tool definitions")
    parser.add_argument("--asr-threads", type=positive_int, default=1, help="CPU threads of the speech front end")
    parser.add_argument("--asr-prompt", default=AsrConfig.prompt, help="the front end's initial prompt (\"\": none)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="transcriptions of each clip timed; the least counts (the machine is shared)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads of the model")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96, help="longest call")
    parser.add_argument("--output", type=Path, default=RESULTS / "voice" / "speech_wer",
                        help="results path, without suffix")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    commands = read_commands(args.commands)
    config = AsrConfig(threads=args.asr_threads, prompt=args.asr_prompt)
    with tempfile.TemporaryDirectory(prefix="speech-wer-") as folder:
        rows, load_s = hear_all(commands, config, Path(folder), args.repeats)
    engine = Engine.load(args.engine)
    calls = calls_of(engine, args.tools, [c["text"] for c in commands] + [r["heard"] for r in rows],
                     args.max_new_tokens)
    meant = {c["text"]: c["call"] for c in commands}
    for row in rows:
        row["typed_call"], row["call"] = calls[row["text"]], calls[row["heard"]]
        row["agrees"], row["meant"] = same_call(row["call"], row["typed_call"]), same_call(row["call"],
                                                                                          meant[row["text"]])
    conditions = []
    for voice in VOICES:
        for noise in dict.fromkeys(r["noise"] for r in rows):
            chosen = [r for r in rows if r["voice"] == voice and r["noise"] == noise]
            conditions.append({"voice": voice, "noise": noise, **summarize(chosen)})
    result = {"commands": len(commands), "asr": "Whisper tiny.en int8 (faster-whisper)",
              "asr_threads": args.asr_threads, "asr_prompt": args.asr_prompt, "asr_repeats": args.repeats,
              "asr_load_s": load_s, "engine": args.engine.name, "threads": args.threads,
              "normalization": normalize.__doc__, "snr_db": SNR_DB, "voices": {k: list(v) for k, v in VOICES.items()},
              "machine": machine_info(),
              "typed": {"meant_call": sum(same_call(calls[c["text"]], c["call"]) for c in commands),
                        "calls": {c["text"]: calls[c["text"]] for c in commands}},
              "conditions": conditions, "clips": rows}
    write_results(args.output, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
