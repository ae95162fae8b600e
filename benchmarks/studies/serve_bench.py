"""cabin-serve under several zones: decode throughput of 4 concurrent streams against 1, and the time to first
token of a returning conversation's 10th turn against its 1st, with the cached tokens of every turn.

Starts ``cabin-serve`` as a subprocess on a free loopback port (its engine on ``--threads`` threads) and talks
to it with the ``openai`` client, streaming. Decode throughput counts the content chunks (one per token) that
arrive while every stream of a run is decoding: from the last stream's first token to the first stream's
last token. Each round runs 1 stream, then the concurrent streams; the ratio is paired within a round and the
medians over the rounds are reported (one stream's run lasts a second or two, so a single one drifts with the
machine). Writes JSON and a markdown table to ``benchmarks/results/``.

    python -m cabinllm.benchmarks.studies.serve_bench --engine DIR
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.cli.args import positive_int
from cabinllm.runtime.kv.cache import DEFAULT_KV_BYTES

SYSTEM = ("You are the assistant of a car. You help the driver and the passengers with navigation, climate, media "
          "and questions about the vehicle. Keep answers short, friendly and safe to hear while driving.")
STORY_PROMPTS = ["Tell a long story about a road trip along the coast.",
                 "Describe in detail how an electric car charges its battery.",
                 "Write a long poem about driving through the mountains at night.",
                 "Explain step by step how to plan a long family holiday by car."]
TURNS = ["Where is the nearest charging station?", "How long will charging take?", "Play some calm music.",
         "Set the temperature to 21 degrees.", "What does the orange light on the dashboard mean?",
         "Find a restaurant near the next exit.", "How far is it to Munich?", "Call my sister.",
         "Is there traffic ahead?", "Turn on the seat heating for the passenger."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.serve_bench",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads of the server's engine")
    parser.add_argument("--streams", type=positive_int, default=4, help="concurrent streams of the batched run")
    parser.add_argument("--decode-tokens", type=positive_int, default=96, help="max_tokens of each throughput stream")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="throughput rounds (1 stream, then --streams); medians of the rates and paired ratios")
    parser.add_argument("--turns", type=positive_int, default=10, help="turns of the returning conversation")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="conversations played (each with its own system prompt); TTFT is the median per turn")
    parser.add_argument("--kv-budget-mb", type=float, default=DEFAULT_KV_BYTES / 2**20,
                        help="the server's KV budget")
    parser.add_argument("--tokens-per-block", type=positive_int, default=None,
                        help="the server's KV block size (None: the engine's target's)")
    parser.add_argument("--output", type=Path, default=RESULTS / "serve_bench", help="results path, without suffix")
    return parser.parse_args(argv)


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """cabin-serve on 127.0.0.1:port for this study's streams, returned once /health answers."""
    flags = ["--engine", str(args.engine), "--threads", str(args.threads), "--max-sessions", str(args.streams),
             "--kv-budget-mb", str(args.kv_budget_mb), "--model-name", "bench"]
    return launch_server(flags + (["--tokens-per-block", str(args.tokens_per_block)] if args.tokens_per_block else []),
                         args.threads, port)


def launch_server(flags: list[str], threads: int, port: int) -> subprocess.Popen:
    """cabin-serve with ``flags`` on 127.0.0.1:port (``threads`` for OpenMP), returned once /health answers."""
    import httpx

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen([sys.executable, "-m", "cabinllm.cli.serve", *flags, "--port", str(port)], env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"cabin-serve exited with code {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.5)
    process.terminate()
    raise RuntimeError("cabin-serve did not answer /health within 300 s")


def stream_once(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy completion: send time, arrival time of each content chunk, usage."""
    sent = time.perf_counter()
    arrivals, text, usage = [], [], None
    for chunk in client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    return {"sent": sent, "arrivals": arrivals, "text": "".join(text), "completion_tokens": usage.completion_tokens,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def overlap_rate(runs: list[dict]) -> tuple[float, float, int]:
    """Chunks per second while every run was decoding: (rate, window seconds, chunks in the window)."""
    start = max(r["arrivals"][0] for r in runs)
    end = min(r["arrivals"][-1] for r in runs)
    chunks = sum(sum(start < t <= end for t in r["arrivals"]) for r in runs)
    return (chunks / (end - start) if end > start else 0.0), end - start, chunks


def throughput(client, streams: int, max_tokens: int) -> dict:
    """Decode rate of ``streams`` concurrent streams of distinct prompts after one shared system prompt."""
    runs: list[dict] = [{} for _ in range(streams)]
    barrier = threading.Barrier(streams)

    def one(index: int) -> None:
        barrier.wait()
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": STORY_PROMPTS[index % len(STORY_PROMPTS)]}]
        runs[index] = stream_once(client, messages, max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate, window, chunks = overlap_rate(runs)
    return {"streams": streams, "decode_tok_s": rate, "window_s": window, "tokens_in_window": chunks,
            "completion_tokens": [r["completion_tokens"] for r in runs]}


def returning_conversation(client, turns: int, repeats: int) -> list[dict]:
    """Median TTFT and the cached tokens of each turn of conversations re-sent in full every turn; each
    conversation has its own system prompt, so its first turn finds nothing cached."""
    runs = []
    with tqdm(total=turns * repeats, desc="turns", unit="turn") as progress:
        for repeat in range(repeats):
            messages = [{"role": "system", "content": f"Conversation {repeat + 1}. {SYSTEM}"}]
            rows = []
            for turn in range(turns):
                messages.append({"role": "user", "content": TURNS[turn % len(TURNS)]})
                run = stream_once(client, messages, 32)
                messages.append({"role": "assistant", "content": run["text"]})
                rows.append({"ttft_s": run["arrivals"][0] - run["sent"], "prompt_tokens": run["prompt_tokens"],
                             "cached_tokens": run["cached_tokens"]})
                progress.update()
            runs.append(rows)
    return [{"turn": turn + 1, "ttft_s": statistics.median(run[turn]["ttft_s"] for run in runs),
             "ttft_s_each": [run[turn]["ttft_s"] for run in runs],
             "prompt_tokens": [run[turn]["prompt_tokens"] for run in runs],
             "cached_tokens": [run[turn]["cached_tokens"] for run in runs]} for turn in range(turns)]


def markdown(result: dict) -> str:
    """The results as markdown tables."""
    streams = result["streams"]
    lines = [f"# cabin-serve benchmark ({result['engine']}, {result['threads']} thread(s), load average "
             f"{result['load_average_before']:.2f} before / {result['load_average_after']:.2f} after)", "",
             f"| round | 1 stream, decode tok/s | {streams} concurrent streams, tok/s (aggregate) | ratio |",
             "|---|---|---|---|"]
    lines += [f"| {i + 1} | {r['single_stream']['decode_tok_s']:.1f} | {r['concurrent_streams']['decode_tok_s']:.1f} "
              f"| {r['ratio']:.2f}x |" for i, r in enumerate(result["rounds"])]
    lines += [f"| median | {result['single_stream_tok_s']:.1f} | {result['concurrent_tok_s']:.1f} "
              f"| {result['throughput_ratio']:.2f}x |", "",
              "| turn | prompt tokens | cached tokens | TTFT ms (median) | TTFT ms (each) |", "|---|---|---|---|---|"]
    lines += [f"| {r['turn']} | {', '.join(map(str, r['prompt_tokens']))} | {', '.join(map(str, r['cached_tokens']))} "
              f"| {r['ttft_s'] * 1000:.0f} | {', '.join(f'{t * 1000:.0f}' for t in r['ttft_s_each'])} |"
              for r in result["turns"]]
    lines += ["", f"TTFT of turn {result['turns'][-1]['turn']} / turn 1: {result['ttft_ratio']:.2f}x"]
    return "\n".join(lines) + "\n"


def throughput_rounds(client, rounds: int, streams: int, max_tokens: int) -> list[dict]:
    """Rounds of 1 stream then ``streams`` concurrent ones, each with its paired ratio."""
    out = []
    for _ in tqdm(range(rounds), desc="throughput rounds", unit="round"):
        single, batched = throughput(client, 1, max_tokens), throughput(client, streams, max_tokens)
        out.append({"single_stream": single, "concurrent_streams": batched,
                    "ratio": batched["decode_tok_s"] / single["decode_tok_s"] if single["decode_tok_s"] else 0.0})
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    import openai

    port = free_port()
    server = start_server(args, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        load_before = os.getloadavg()[0]
        stream_once(client, [{"role": "user", "content": "Hello."}], 8)  # warm-up: kernels built, caches touched
        turns = returning_conversation(client, args.turns, args.repeats)
        rounds = throughput_rounds(client, args.rounds, args.streams, args.decode_tokens)
        load_after = os.getloadavg()[0]
    finally:
        server.terminate()
        server.wait(30)
    result = {"engine": args.engine.name, "threads": args.threads, "tokens_per_block": args.tokens_per_block, "machine": machine_info(),
              "load_average_before": load_before, "load_average_after": load_after,
              "streams": args.streams, "rounds": rounds,
              "single_stream_tok_s": statistics.median(r["single_stream"]["decode_tok_s"] for r in rounds),
              "concurrent_tok_s": statistics.median(r["concurrent_streams"]["decode_tok_s"] for r in rounds),
              "throughput_ratio": statistics.median(r["ratio"] for r in rounds),
              "turns": turns, "ttft_ratio": turns[-1]["ttft_s"] / turns[0]["ttft_s"]}
    write_results(args.output, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
