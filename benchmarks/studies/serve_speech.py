"""cabin-serve hearing spoken commands: what a spoken ``input_audio`` part adds to the time to first token, the
speech front end's real-time factor as ``/metrics`` reads it, the word error rate of the transcripts, and whether a
stream keeps decoding while another client's clip is transcribed.

Starts ``cabin-serve`` as a subprocess (its engine and its speech front end on ``--threads`` / ``--asr-threads``)
and speaks the in-car commands of tests/data/vehicle_commands.jsonl with espeak-ng. Each command is sent three
times, streamed, greedy, 16 tokens: spoken (the server transcribes it), spoken again (the transcript is kept by
the clip's digest: nothing heard again) and typed as its transcript. Decoding while hearing: a 96-token stream runs
alone, then again while another client posts a clip to ``/v1/audio/transcriptions`` once its first token arrived;
the gaps between its tokens are compared. Writes JSON and a markdown table to ``benchmarks/results/voice/``.

    python -m cabinllm.benchmarks.studies.serve_speech --engine DIR
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.benchmarks.studies.serve_bench import STORY_PROMPTS, free_port, launch_server, stream_once
from cabinllm.benchmarks.studies.tool_calls import COMMANDS, SYSTEM, read_commands
from cabinllm.cli.args import positive_int

ASR_MODEL = "whisper-tiny.en"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.serve_speech",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads of the server's engine")
    parser.add_argument("--asr-threads", type=positive_int, default=1, help="CPU threads of its speech front end")
    parser.add_argument("--commands", type=positive_int, default=10, help="spoken commands (every 4th of the 40)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of decoding alone / while hearing")
    parser.add_argument("--output", type=Path, default=RESULTS / "voice" / "serve_speech",
                        help="results path, without suffix")
    return parser.parse_args(argv)


def speak(text: str, path: Path, speed: int = 140) -> bytes:
    """``text`` as espeak-ng says it, a WAV file's bytes."""
    subprocess.run(["espeak-ng", "-s", str(speed), "-w", str(path), text], check=True, timeout=60,
                   capture_output=True)
    return path.read_bytes()


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """cabin-serve on 127.0.0.1:port with this study's threads, returned once /health answers."""
    return launch_server(["--engine", str(args.engine), "--threads", str(args.threads), "--asr-threads",
                          str(args.asr_threads), "--model-name", "bench"], args.threads, port)


def counters(base: str) -> dict[str, float]:
    """The speech counters of /metrics."""
    import httpx

    text = httpx.get(f"{base}/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(("cabin_asr_", "cabin_audio_")) and "_created" not in line}


def spoken_commands(client, commands: list[dict], clips: list[bytes]) -> list[dict]:
    """TTFT of each command spoken, spoken again and typed, with the server's transcript."""
    import base64
    import jiwer

    rows = []
    for command, clip in tqdm(list(zip(commands, clips)), desc="commands", unit="command"):
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}}
        spoken = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [part]}]
        first, again = stream_once(client, spoken, 16), stream_once(client, spoken, 16)
        heard = client.audio.transcriptions.create(model=ASR_MODEL, file=("command.wav", clip)).text
        typed = stream_once(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": heard}], 16)
        rows.append({"command": command["command"], "transcript": heard,
                     "wer": jiwer.wer(_words(command["command"]), _words(heard)),
                     "ttft_spoken_s": first["arrivals"][0] - first["sent"],
                     "ttft_spoken_again_s": again["arrivals"][0] - again["sent"],
                     "ttft_typed_s": typed["arrivals"][0] - typed["sent"],
                     "same_prompt": first["prompt_tokens"] == typed["prompt_tokens"] == again["prompt_tokens"]})
    return rows


def _words(text: str) -> str:
    return " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace() or c == "'").split())


def decode_while_hearing(client, clip: bytes | None, delay_s: float = 0.5) -> dict:
    """Gaps between the tokens of a 96-token stream; with a ``clip``, another client posts it for transcription
    ``delay_s`` after the stream was sent (its tokens flowing by then) and the gaps inside that window are kept."""
    run: dict = {}
    thread = threading.Thread(target=lambda: run.update(stream_once(client, [
        {"role": "user", "content": STORY_PROMPTS[0]}], 96)))
    thread.start()
    window = None
    if clip is not None:
        time.sleep(delay_s)
        started = time.perf_counter()
        client.audio.transcriptions.create(model=ASR_MODEL, file=("other.wav", clip))
        window = (started, time.perf_counter())
    thread.join()
    gaps = [(b - a, b) for a, b in zip(run["arrivals"], run["arrivals"][1:])]
    inside = [gap for gap, at in gaps if window and window[0] <= at <= window[1]]
    return {"tokens": len(run["arrivals"]), "gap_median_s": statistics.median(g for g, _ in gaps),
            "gap_max_s": max(g for g, _ in gaps), "asr_window_s": window[1] - window[0] if window else None,
            "gaps_in_window": len(inside), "gap_median_in_window_s": statistics.median(inside) if inside else None,
            "gap_max_in_window_s": max(inside) if inside else None}


def markdown(result: dict) -> str:
    """The results as a markdown table."""
    s = result["summary"]
    alone, heard = s["decode_alone"], s["decode_while_hearing"]
    rows = [("spoken commands (espeak-ng, 140 wpm)", f"{s['commands']}, {s['audio_s']:.1f} s of audio"),
            ("ASR s per s of audio (/metrics: cabin_asr_seconds / cabin_audio_seconds)", f"{s['rtf']:.3f}"),
            ("word error rate of the transcripts (jiwer, lower case, no punctuation)", f"{s['wer']:.3f}"),
            ("spoken and typed as its transcript: the same prompt tokens", f"{s['same_prompt']} of {s['commands']}"),
            ("TTFT spoken, first time (median)", f"{s['ttft_spoken_ms']:.0f} ms"),
            ("TTFT spoken again: transcript kept (median)", f"{s['ttft_spoken_again_ms']:.0f} ms"),
            ("TTFT typed (median)", f"{s['ttft_typed_ms']:.0f} ms"),
            ("token gap of a stream decoding alone: median / max",
             f"{alone['median_ms']:.1f} / {alone['max_ms']:.1f} ms"),
            ("token gap while another client's clip is transcribed: median / max (inside the ASR window)",
             f"{heard['median_ms']:.1f} / {heard['max_ms']:.1f} ms ({heard['gaps']} gaps in {heard['window_ms']:.0f} "
             "ms)")]
    machine = result["machine"]
    lines = [f"# cabin-serve hearing ({result['engine']}; engine {result['threads']} thread, speech front end "
             f"{result['asr_threads']} thread)", "",
             f"`python -m cabinllm.benchmarks.studies.serve_speech --engine engines/{result['engine']}` on "
             f"{machine['cpu']} ({machine['cores']} vCPUs, shared), load average {result['load_average_before']:.2f} "
             f"before / {result['load_average_after']:.2f} after.", "", "| measure | value |", "|---|---|"]
    return "\n".join(lines + [f"| {name} | {value} |" for name, value in rows]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    import openai

    commands = read_commands(COMMANDS)[::4][:args.commands]
    with tempfile.TemporaryDirectory() as folder:
        clips = [speak(c["command"], Path(folder) / f"{i}.wav") for i, c in enumerate(commands)]
        others = [speak(c["command"], Path(folder) / f"other{i}.wav", 150)
                  for i, c in enumerate(read_commands(COMMANDS)[1::4][:args.rounds])]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(args, port)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        load_before = os.getloadavg()[0]
        stream_once(client, [{"role": "user", "content": "Hello."}], 8)  # warm-up: kernels built, caches touched
        client.audio.transcriptions.create(model=ASR_MODEL, file=("warm.wav", others[-1]))  # the model loaded
        before = counters(base)
        rows = spoken_commands(client, commands, clips)
        after = counters(base)
        rounds = [{"alone": decode_while_hearing(client, None), "hearing": decode_while_hearing(client, clip)}
                  for clip in tqdm(others[:args.rounds], desc="decode rounds", unit="round")]
        load_after = os.getloadavg()[0]
    finally:
        server.terminate()
        server.wait(30)
    asr_s = after["cabin_asr_seconds_total"] - before["cabin_asr_seconds_total"]
    audio_s = after["cabin_audio_seconds_total"] - before["cabin_audio_seconds_total"]
    median_ms = lambda key: statistics.median(r[key] for r in rows) * 1000  # noqa: E731
    hearing = [r["hearing"] for r in rounds]
    summary = {"commands": len(rows), "audio_s": audio_s, "asr_s": asr_s, "rtf": asr_s / audio_s,
               "clips_transcribed": after["cabin_audio_clips_transcribed_total"]
               - before["cabin_audio_clips_transcribed_total"],
               "clips_reused": after["cabin_audio_clips_reused_total"] - before["cabin_audio_clips_reused_total"],
               "wer": statistics.mean(r["wer"] for r in rows), "same_prompt": sum(r["same_prompt"] for r in rows),
               "ttft_spoken_ms": median_ms("ttft_spoken_s"), "ttft_spoken_again_ms": median_ms("ttft_spoken_again_s"),
               "ttft_typed_ms": median_ms("ttft_typed_s"),
               "decode_alone": {"median_ms": statistics.median(r["alone"]["gap_median_s"] for r in rounds) * 1000,
                                "max_ms": max(r["alone"]["gap_max_s"] for r in rounds) * 1000},
               "decode_while_hearing": {
                   "median_ms": statistics.median(r["gap_median_in_window_s"] for r in hearing
                                                  if r["gap_median_in_window_s"] is not None) * 1000,
                   "max_ms": max(r["gap_max_in_window_s"] or 0.0 for r in hearing) * 1000,
                   "gaps": sum(r["gaps_in_window"] for r in hearing),
                   "window_ms": sum(r["asr_window_s"] for r in hearing) * 1000}}
    result = {"engine": args.engine.name, "threads": args.threads, "asr_threads": args.asr_threads,
              "machine": machine_info(), "load_average_before": load_before, "load_average_after": load_after,
              "summary": summary, "commands": rows, "decode_rounds": rounds}
    write_results(args.output, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
