"""Soak test of cabin-serve: long streamed conversations of several clients, with faults, on one server.

C clients hold long conversations while some disconnect mid-stream, some give up before the first token and
bursts of extra requests overflow the queue; it measures TTFT and inter-token latency per client, the statuses the
server answers, its RSS over the run, the most KV it holds against the budget, and whether every KV block is back
(free or cached) once it is idle.

Starts ``cabin-serve`` as a subprocess on a free loopback port and talks to it with plain asyncio + httpx clients.
Every client's conversation starts with the same system prompt (a prefix shared by all); each turn appends a user
message drawn from ``random.Random`` seeded by ``--seed`` and the client's index, streams the reply (``stream:
true``, greedy unless ``--temperature``) and appends it. With probability ``--disconnect-rate`` a turn closes its
response after 1-3 content chunks (the partial reply is kept, as when the driver interrupts), with probability
``--cancel-rate`` it closes before the first content chunk (at a random moment within ``--cancel-window`` s of
sending, or when the response headers arrive, whichever is first; the turn is dropped). ``--bursts`` times during
the run, ``--max-sessions`` + ``--max-queue`` + ``--burst-extra`` one-turn requests are sent at once, so some get
429. A 429 or 503 is retried after its Retry-After; a 400 with code ``context_length_exceeded`` resets the
conversation. A client also resets its conversation every ``--reset-every`` turns (default 20): on the default
model a turn adds about 40 tokens, 60 at most (a user line, the chat template's markers, a reply of up to 32
tokens), so 20 turns and the system prompt stay under about 900 tokens (1,300 at most) and the histories of 4
clients fit together in the default 64 MiB INT8 pool (5,824 tokens), where one conversation may hold the whole
pool; the server's ``--overflow sink-window`` (the default: keep the system prompt and the recent turns, and carry
on) covers what goes over. The server runs on ``--threads 1`` by default: on a 2-core machine the other core is the
load generator's and the sampler's (this process parses every chunk), so the timings are the server's and not two
processes competing for one core.

A sampler polls the server process's RSS (psutil) and ``/metrics`` every ``--sample-interval`` s. Checks (exit
status 1 with a one-line reason when one fails): no 5xx other than 503 (an error event inside a stream counts as
500), no status other than 200, 429, 503 and the 400 context_length_exceeded, no connection error besides the
deliberate closes, KV bytes used never over the budget, and once idle no block in use and blocks free + cached ==
blocks total, no traceback in the server's log. Writes ``benchmarks/results/soak.json`` and ``.md``.

    python -m cabinllm.benchmarks.studies.soak --engine engines/smollm2-int8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from cabinllm.benchmarks.machine import machine_info
from cabinllm.benchmarks.studies import RESULTS, write_results
from cabinllm.benchmarks.studies.serve_bench import free_port
from cabinllm.cli.args import float_range, non_negative_float, non_negative_int, positive_float, positive_int
from cabinllm.runtime.dialogue.overflow import OVERFLOW_POLICIES
from cabinllm.runtime.kv.cache import DEFAULT_KV_BYTES

PROG = "python -m cabinllm.benchmarks.studies.soak"
MODEL = "soak"
MIB = 1 << 20
SYSTEM = ("You are the assistant of a car. You help the driver and the passengers with navigation, climate, media "
          "and questions about the vehicle. Keep answers short, friendly and safe to hear while driving.")
PLACES = ["the nearest charging station", "the airport", "a quiet cafe", "the office", "the next rest area",
          "a pharmacy that is open now", "the hotel", "the stadium"]
CITIES = ["Munich", "Lyon", "Turin", "Vienna", "Prague", "Zurich", "Hamburg", "Milan"]
GENRES = ["calm", "jazz", "classical", "rock", "folk", "electronic"]
TEMPLATES = ["Navigate to {place}.", "How far is it to {city}?", "Play some {genre} music.",
             "Set the temperature to {degrees} degrees.", "Is there traffic on the way to {city}?",
             "What does the orange light on the dashboard mean?", "How long will charging take?",
             "Turn on the seat heating for the passenger.", "Find a restaurant near {place}.",
             "Read my last message.", "Open the sunroof halfway.", "When do we arrive in {city}?",
             "Lower the volume a little.", "Is it going to rain in {city} today?"]
MAX_ATTEMPTS = 30  # tries of one turn answered 429 / 503 before the client gives the turn up
SERVER_STOP_S = 15  # seconds cabin-serve gets to stop after SIGTERM before it is killed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    rate = float_range(0, 1, low_included=True)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--clients", type=positive_int, default=4, help="concurrent conversations")
    parser.add_argument("--turns", type=positive_int, default=200, help="turns of each client")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="max_tokens of each reply")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="sampling temperature (0: greedy; above 0 each request carries a seed from --seed)")
    parser.add_argument("--reset-every", type=positive_int, default=20,
                        help="turns after which a client starts a new conversation (see the module docstring)")
    parser.add_argument("--max-sessions", type=positive_int, default=4, help="the server's --max-sessions")
    parser.add_argument("--max-queue", type=positive_int, default=8, help="the server's --max-queue")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="CPU threads of the server's engine (1 leaves a core of 2 to this load generator)")
    parser.add_argument("--kv-budget-mb", type=positive_float, default=DEFAULT_KV_BYTES / 2**20,
                        help="the server's KV budget")
    parser.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="sink-window",
                        help="the server's --overflow (sink-window and drop-turns cut a long conversation and go on; "
                             "error answers 400 context_length_exceeded, and the client resets)")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="one more cabin-serve argument, repeatable: --server-flag=--queue-timeout=20")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the messages and the faults")
    parser.add_argument("--disconnect-rate", type=rate, default=0.1,
                        help="probability that a turn closes its stream after 1-3 content chunks")
    parser.add_argument("--cancel-rate", type=rate, default=0.05,
                        help="probability that a turn closes its request before the first content chunk")
    parser.add_argument("--cancel-window", type=positive_float, default=0.05,
                        help="a cancelled turn closes at a random moment this many seconds after sending at most")
    parser.add_argument("--bursts", type=non_negative_int, default=2, help="bursts of extra concurrent requests")
    parser.add_argument("--burst-extra", type=positive_int, default=4,
                        help="requests of a burst beyond --max-sessions + --max-queue")
    parser.add_argument("--sample-interval", type=positive_float, default=0.5, help="seconds between samples")
    parser.add_argument("--request-timeout", type=positive_float, default=120.0,
                        help="seconds a client waits for the server before it counts a connection error")
    parser.add_argument("--idle-timeout", type=positive_float, default=10.0,
                        help="seconds the server gets after the run to drop every request")
    parser.add_argument("--output", type=Path, default=RESULTS / "soak", help="results path, without suffix")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.disconnect_rate + args.cancel_rate > 1:
        parser.error(f"--disconnect-rate {args.disconnect_rate:g} + --cancel-rate {args.cancel_rate:g} is over 1; "
                     "lower one of them")
    return args


class SoakError(Exception):
    """A problem with the setup (engine, server start), worded with its fix."""


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """The cabin-serve command line of this run."""
    return [sys.executable, "-m", "cabinllm.cli.serve", "--engine", str(args.engine), "--port", str(port),
            "--threads", str(args.threads), "--max-sessions", str(args.max_sessions),
            "--max-queue", str(args.max_queue), "--kv-budget-mb", f"{args.kv_budget_mb:g}",
            "--overflow", args.overflow, "--model-name", MODEL, *args.server_flag]


def start_server(command: list[str], threads: int, port: int, log) -> subprocess.Popen:
    """cabin-serve on 127.0.0.1:port, its stderr into ``log``, returned once /health answers; SoakError when it
    exits first or does not answer within 300 s (the process is stopped then)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SoakError(f"cabin-serve exited with code {process.returncode} before answering /health: "
                                f"{last_line(log.name) or 'no message'}; run it by hand to see why: "
                                f"{shlex.join(command)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise SoakError(f"cabin-serve did not answer /health within 300 s; run it by hand to see why: "
                        f"{shlex.join(command)}")
    except BaseException:
        stop_server(process)
        raise


def stop_server(process: subprocess.Popen) -> int:
    """Stop cabin-serve: SIGTERM, then SIGKILL after SERVER_STOP_S; its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(SERVER_STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def last_line(path: str) -> str:
    """The last non-empty line of a text file ('' for none)."""
    lines = [line for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    return float(np.percentile(values, q)) if values else None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name: value}, for the samples without labels."""
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if not sample.labels}


def user_message(rng: random.Random) -> str:
    """A varied in-car request."""
    return rng.choice(TEMPLATES).format(place=rng.choice(PLACES), city=rng.choice(CITIES), genre=rng.choice(GENRES),
                                        degrees=rng.randint(16, 26))


@dataclass
class ClientStats:
    """What one client saw."""

    client: int
    completed: int = 0
    disconnected: int = 0
    cancelled: int = 0
    cancelled_before_headers: int = 0
    gave_up: int = 0
    context_resets: int = 0
    scheduled_resets: int = 0
    connection_errors: int = 0
    statuses: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    max_prompt_tokens: int = 0


@dataclass
class Turn:
    """One request's answer: the HTTP status, and for a 200 how the stream went."""

    status: int
    outcome: str = ""  # completed, disconnected, cancelled, stream-error; "" for a non-200
    code: str | None = None  # the error code of a non-200 (or of an error event in the stream)
    message: str = ""
    retry_after_s: float = 1.0
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    usage: dict | None = None


async def stream_turn(http: httpx.AsyncClient, url: str, body: dict, close_after: int | None = None) -> Turn:
    """POST one streamed completion and read it; ``close_after``: close the response after that many content chunks
    (0: as soon as the headers are in)."""
    sent = time.perf_counter()
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            try:
                error = json.loads(raw).get("error", {})
            except ValueError:
                error = {"message": raw[:200].decode("utf-8", "replace")}
            return Turn(response.status_code, code=error.get("code"), message=str(error.get("message", "")),
                        retry_after_s=float(response.headers.get("retry-after", 1)), sent=sent)
        turn = Turn(200, "completed", sent=sent)
        if close_after == 0:
            turn.outcome = "cancelled"
            return turn
        pieces = []
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                turn.outcome, turn.code = "stream-error", event["error"].get("code")
                turn.message = str(event["error"].get("message", ""))
                break
            choices = event.get("choices") or []
            content = choices[0].get("delta", {}).get("content") if choices else None
            if content:
                turn.arrivals.append(time.perf_counter())
                pieces.append(content)
                if close_after is not None and len(turn.arrivals) >= close_after:
                    turn.outcome = "disconnected"
                    break
            if event.get("usage"):
                turn.usage = event["usage"]
        turn.text = "".join(pieces)
        return turn  # leaving the block closes the response: mid-stream, that drops the connection


async def cancelled_turn(http: httpx.AsyncClient, url: str, body: dict, delay_s: float) -> Turn:
    """A request closed before its first content chunk: after ``delay_s`` or when the headers arrive."""
    try:
        return await asyncio.wait_for(stream_turn(http, url, body, close_after=0), delay_s)
    except TimeoutError:
        return Turn(200, "cancelled", code="before-headers")


class Soak:
    """The clients, the bursts and the sampler of one run against the server at ``base``."""

    def __init__(self, args: argparse.Namespace, base: str, pid: int) -> None:
        self.args, self.base, self.url = args, base, f"{base}/v1/chat/completions"
        self.process = psutil.Process(pid)
        self.timeout = httpx.Timeout(args.request_timeout, connect=10.0)
        self.total = args.clients * args.turns
        self.done = 0
        self.burst_points = [self.total * (i + 1) // (args.bursts + 1) for i in range(args.bursts)]
        self.burst_size = args.max_sessions + args.max_queue + args.burst_extra
        self.bursts: list[dict] = []
        self.burst_tasks: list[asyncio.Task] = []
        self.samples: list[dict] = []
        self.sampler_errors: list[str] = []
        self.progress: tqdm | None = None

    def body(self, messages: list[dict], rng: random.Random) -> dict:
        """A streamed request of these messages."""
        body = {"model": MODEL, "messages": messages, "max_tokens": self.args.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.args.temperature}
        if self.args.temperature > 0:
            body["seed"] = rng.randrange(2**31)
        return body

    def turn_done(self) -> None:
        """Count a finished turn; start a burst where the run reaches one of its points."""
        self.done += 1
        if self.progress is not None:
            self.progress.update()
        while self.burst_points and self.done >= self.burst_points[0]:
            self.burst_points.pop(0)
            self.burst_tasks.append(asyncio.create_task(self.burst(self.done)))

    async def client(self, index: int) -> ClientStats:
        """One conversation after another for ``--turns`` turns, with the faults drawn per turn."""
        args, stats = self.args, ClientStats(index)
        rng = random.Random(f"soak-{args.seed}-{index}")
        messages = [{"role": "system", "content": SYSTEM}]
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            for turn_index in range(args.turns):
                if turn_index and turn_index % args.reset_every == 0:
                    messages, stats.scheduled_resets = messages[:1], stats.scheduled_resets + 1
                messages.append({"role": "user", "content": user_message(rng)})
                draw = rng.random()
                close_after = rng.randint(1, 3) if draw < args.disconnect_rate else None
                cancel = args.disconnect_rate <= draw < args.disconnect_rate + args.cancel_rate
                delay = rng.uniform(0.0, args.cancel_window)
                turn = await self.attempt(http, messages, rng, stats, close_after, cancel, delay)
                if turn is not None and turn.outcome in ("completed", "disconnected"):
                    messages.append({"role": "assistant", "content": turn.text})
                else:
                    messages.pop()  # the turn never happened: the conversation goes on without it
                self.turn_done()
        return stats

    async def attempt(self, http: httpx.AsyncClient, messages: list[dict], rng: random.Random, stats: ClientStats,
                      close_after: int | None, cancel: bool, delay: float) -> Turn | None:
        """Send one turn until it is answered (429 / 503 retried after Retry-After; a 400 context_length_exceeded
        resets the conversation); counts it in ``stats``; None where it got no answer to go on with."""
        for _ in range(MAX_ATTEMPTS):
            try:
                if cancel:
                    turn = await cancelled_turn(http, self.url, self.body(messages, rng), delay)
                else:
                    turn = await stream_turn(http, self.url, self.body(messages, rng), close_after)
            except (httpx.TransportError, ValueError) as err:
                stats.connection_errors += 1
                stats.unexpected.append(f"{type(err).__name__}: {err}")
                return None
            stats.statuses[str(turn.status) if turn.outcome != "stream-error" else "500 (in stream)"] += 1
            if turn.status in (429, 503):
                await asyncio.sleep(min(turn.retry_after_s, 5.0))
                continue
            if turn.status == 400 and turn.code == "context_length_exceeded":
                del messages[1:-1]
                stats.context_resets += 1
                continue
            if turn.status != 200 or turn.outcome == "stream-error":
                stats.unexpected.append(f"{turn.status} {turn.code}: {turn.message[:200]}")
                return None
            if turn.outcome == "cancelled":
                stats.cancelled += 1
                stats.cancelled_before_headers += turn.code == "before-headers"
                return turn
            if turn.arrivals:
                stats.ttft_s.append(turn.arrivals[0] - turn.sent)
                stats.itl_s += [b - a for a, b in zip(turn.arrivals, turn.arrivals[1:])]
            if turn.outcome == "disconnected":
                stats.disconnected += 1
                return turn
            stats.completed += 1
            if turn.usage:
                stats.prompt_tokens += turn.usage["prompt_tokens"]
                stats.completion_tokens += turn.usage["completion_tokens"]
                stats.cached_tokens += (turn.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                stats.max_prompt_tokens = max(stats.max_prompt_tokens, turn.usage["prompt_tokens"])
            return turn
        stats.gave_up += 1
        return None

    async def burst(self, at_turn: int) -> None:
        """``burst_size`` one-turn requests at once, each read to its end; their statuses."""
        rng = random.Random(f"soak-burst-{self.args.seed}-{at_turn}")
        statuses: Counter = Counter()
        unexpected: list[str] = []
        errors: list[str] = []
        limits = httpx.Limits(max_connections=self.burst_size, max_keepalive_connections=0)

        async def one(http: httpx.AsyncClient, messages: list[dict], body: dict) -> None:
            try:
                turn = await stream_turn(http, self.url, body)
            except (httpx.TransportError, ValueError) as err:
                errors.append(f"{type(err).__name__}: {err}")
                return
            statuses[str(turn.status) if turn.outcome != "stream-error" else "500 (in stream)"] += 1
            if turn.status not in (200, 429, 503) or turn.outcome == "stream-error":
                unexpected.append(f"{turn.status} {turn.code}: {turn.message[:200]}")

        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as http:
            requests = []
            for _ in range(self.burst_size):
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(rng)}]
                requests.append(one(http, messages, self.body(messages, rng)))
            await asyncio.gather(*requests)
        self.bursts.append({"at_turn": at_turn, "size": self.burst_size, "statuses": dict(statuses),
                            "unexpected": unexpected, "connection_errors": errors})

    async def metrics(self, http: httpx.AsyncClient) -> dict[str, float]:
        """The server's /metrics now."""
        response = await http.get(f"{self.base}/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    async def sampler(self, stop: asyncio.Event) -> None:
        """RSS and KV gauges every ``--sample-interval`` s until ``stop`` is set."""
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    rss = self.process.memory_info().rss
                    m = await self.metrics(http)
                    self.samples.append({"t": t, "rss_bytes": rss, "kv_bytes_used": m["cabin_kv_bytes_used"],
                                         "kv_blocks_in_use": m["cabin_kv_blocks_in_use"],
                                         "active": m["cabin_active_sequences"], "waiting": m["cabin_queue_length"]})
                except (httpx.HTTPError, psutil.Error) as err:
                    self.sampler_errors.append(f"{type(err).__name__}: {err}")
                try:
                    await asyncio.wait_for(stop.wait(), max(0.0, self.args.sample_interval - (time.perf_counter() - t)))
                except TimeoutError:
                    pass

    async def idle(self) -> tuple[dict[str, float], float]:
        """/metrics once nothing runs, waits or holds blocks (or after ``--idle-timeout`` s), and how long that
        took."""
        start = time.perf_counter()
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            while True:
                m = await self.metrics(http)
                quiet = (m["cabin_kv_blocks_in_use"] == 0 and m["cabin_active_sequences"] == 0
                         and m["cabin_queue_length"] == 0)
                if quiet or time.perf_counter() - start > self.args.idle_timeout:
                    return m, time.perf_counter() - start
                await asyncio.sleep(0.1)

    async def run(self) -> dict:
        """Warm up, run the clients, the bursts and the sampler; the raw figures."""
        async with httpx.AsyncClient(timeout=self.timeout) as http:  # kernels built, caches touched
            hello = [{"role": "user", "content": "Hello."}]
            warm = await stream_turn(http, self.url, self.body(hello, random.Random(self.args.seed)))
            if warm.status != 200:
                raise SoakError(f"the warm-up request got {warm.status} {warm.code}: {warm.message}")
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(stop))
        started = time.perf_counter()
        with tqdm(total=self.total, desc="soak", unit="turn", disable=self.args.no_progress, mininterval=1) as bar:
            self.progress = bar
            clients = await asyncio.gather(*(self.client(i) for i in range(self.args.clients)))
            await asyncio.gather(*self.burst_tasks)
        load_s = time.perf_counter() - started
        stop.set()
        await sampler
        final, idle_s = await self.idle()
        return {"clients": clients, "load_s": load_s, "final": final, "idle_s": idle_s}


def milliseconds(seconds: float | None) -> float | None:
    """Seconds as milliseconds to 0.01 ms (None stays None)."""
    return None if seconds is None else round(seconds * 1000, 2)


def client_row(stats: ClientStats) -> dict:
    """One client's counts and latency percentiles (ms)."""
    return {"client": stats.client, "completed": stats.completed, "disconnected": stats.disconnected,
            "cancelled": stats.cancelled, "cancelled_before_headers": stats.cancelled_before_headers,
            "rejected_429": stats.statuses["429"], "rejected_503": stats.statuses["503"], "gave_up": stats.gave_up,
            "context_resets": stats.context_resets, "scheduled_resets": stats.scheduled_resets,
            "connection_errors": stats.connection_errors, "statuses": dict(stats.statuses),
            "unexpected": stats.unexpected[:20],
            "ttft_ms_p50": milliseconds(percentile(stats.ttft_s, 50)),
            "ttft_ms_p95": milliseconds(percentile(stats.ttft_s, 95)),
            "itl_ms_p50": milliseconds(percentile(stats.itl_s, 50)),
            "itl_ms_p95": milliseconds(percentile(stats.itl_s, 95)),
            "prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
            "completion_tokens": stats.completion_tokens, "max_prompt_tokens": stats.max_prompt_tokens}


def overall(clients: list[ClientStats]) -> ClientStats:
    """Every client's figures pooled as one."""
    pooled = ClientStats(-1)
    for stats in clients:
        for name, value in vars(stats).items():
            if name == "client":
                continue
            if name == "max_prompt_tokens":
                pooled.max_prompt_tokens = max(pooled.max_prompt_tokens, value)
            elif isinstance(value, Counter):
                pooled.statuses.update(value)
            else:
                setattr(pooled, name, getattr(pooled, name) + value)
    return pooled


def rss_summary(samples: list[dict]) -> dict:
    """Median RSS (MB) of the first and the last quartile of the samples, their ratio, the maximum, the series."""
    rss = [s["rss_bytes"] / MIB for s in samples]
    if not rss:
        return {"samples": 0, "first_quartile_median_mb": None, "last_quartile_median_mb": None, "ratio": None,
                "max_mb": None, "series_mb": []}
    quarter = max(1, len(rss) // 4)
    first, last = statistics.median(rss[:quarter]), statistics.median(rss[-quarter:])
    return {"samples": len(rss), "first_quartile_median_mb": round(first, 1), "last_quartile_median_mb": round(last, 1),
            "ratio": round(last / first, 4), "max_mb": round(max(rss), 1), "series_mb": [round(r, 1) for r in rss]}


def summarize(args: argparse.Namespace, argv: list[str], soak: Soak, raw: dict, command: list[str], server: dict,
              load_before: tuple, load_after: tuple, info: dict) -> dict:
    """The study's JSON: settings, per-client figures, statuses, RSS, KV, idle state and the checks."""
    clients: list[ClientStats] = raw["clients"]
    pooled = overall(clients)
    final = raw["final"]
    statuses = Counter(pooled.statuses)
    for burst in soak.bursts:
        statuses.update(burst["statuses"])
    budget = final["cabin_kv_bytes_budget"]
    used_max = max([s["kv_bytes_used"] for s in soak.samples] + [final["cabin_kv_bytes_used_peak"]])
    blocks = {name: int(final[f"cabin_kv_blocks_{name}"]) for name in ("total", "free", "cached", "in_use")}
    expected = {"200", "429", "503"}
    unexpected_5xx = {k: n for k, n in statuses.items() if k.startswith("5") and k != "503"}
    unexpected_status = {k: n for k, n in statuses.items() if k not in expected and k not in unexpected_5xx
                         and not (k == "400" and n <= pooled.context_resets)}
    connection_errors = (pooled.connection_errors + len(soak.sampler_errors)
                         + sum(len(b["connection_errors"]) for b in soak.bursts))
    checks = {
        "no_unexpected_5xx": not unexpected_5xx,
        "no_unexpected_status": not unexpected_status,
        "no_connection_errors": connection_errors == 0,
        "kv_within_budget": used_max <= budget,
        "blocks_back_when_idle": (blocks["in_use"] == 0 and blocks["free"] + blocks["cached"] == blocks["total"]
                                  and final["cabin_active_sequences"] == 0 and final["cabin_queue_length"] == 0),
        "server_log_clean": server["log_tracebacks"] == 0,
    }
    reasons = {
        "no_unexpected_5xx": f"the server answered 5xx other than 503: {unexpected_5xx}",
        "no_unexpected_status": f"the server answered statuses the run does not expect: {unexpected_status}",
        "no_connection_errors": f"{connection_errors} connection errors besides the deliberate closes",
        "kv_within_budget": f"KV bytes used reached {used_max:.0f}, over the budget of {budget:.0f}",
        "blocks_back_when_idle": (f"{raw['idle_s']:.1f} s after the run {blocks['in_use']} blocks were in use, "
                                  f"{blocks['free']} free + {blocks['cached']} cached of {blocks['total']}, "
                                  f"{final['cabin_active_sequences']:.0f} sequences active, "
                                  f"{final['cabin_queue_length']:.0f} waiting"),
        "server_log_clean": f"the server logged {server['log_tracebacks']} tracebacks (see server.log_tail)",
    }
    turns_done = pooled.completed + pooled.disconnected
    return {
        "study": "soak", "command": shlex.join([*PROG.split(), *argv]),
        "server_command": shlex.join(["cabin-serve", *command[3:]]), "engine": args.engine.resolve().name,
        "seed": args.seed, "clients": args.clients, "turns": args.turns, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "reset_every": args.reset_every, "max_sessions": args.max_sessions,
        "max_queue": args.max_queue, "threads": args.threads, "kv_budget_mb": args.kv_budget_mb,
        "overflow": args.overflow, "disconnect_rate": args.disconnect_rate, "cancel_rate": args.cancel_rate,
        "bursts": args.bursts, "burst_size": soak.burst_size, "machine": info,
        "load_average_before": list(load_before), "load_average_after": list(load_after),
        "duration_s": round(raw["load_s"], 2),
        "turns_per_s": round((pooled.completed + pooled.disconnected + pooled.cancelled) / raw["load_s"], 3),
        "per_client": [client_row(c) for c in clients], "overall": client_row(pooled),
        "cached_token_fraction": (round(pooled.cached_tokens / pooled.prompt_tokens, 4) if pooled.prompt_tokens
                                  else None),
        "statuses": dict(sorted(statuses.items())), "burst_runs": soak.bursts,
        "rss": rss_summary(soak.samples),
        "kv": {"budget_bytes": budget, "reserved_bytes": final["cabin_kv_bytes_reserved"],
               "used_max_bytes": used_max, "used_peak_bytes_server": final["cabin_kv_bytes_used_peak"],
               "used_max_sampled_bytes": max([s["kv_bytes_used"] for s in soak.samples], default=0.0),
               "used_max_fraction": round(used_max / budget, 4) if budget else None},
        "idle": {"seconds_to_idle": round(raw["idle_s"], 2), "blocks": blocks,
                 "active_sequences": final["cabin_active_sequences"], "queue_length": final["cabin_queue_length"],
                 "requests_finished": final.get("cabin_requests_finished_total"),
                 "prefix_hit_blocks": final.get("cabin_prefix_hit_blocks_total")},
        "sampler_errors": soak.sampler_errors[:20], "server": server,
        "turns_answered": turns_done, "checks": checks,
        "failures": [reasons[name] for name, ok in checks.items() if not ok],
        "passed": all(checks.values()),
    }


def markdown(result: dict) -> str:
    """The results as markdown tables."""
    def num(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rss, kv, idle = result["rss"], result["kv"], result["idle"]
    lines = [f"# cabin-serve soak ({result['engine']}, {result['clients']} clients x {result['turns']} turns, "
             f"max_tokens {result['max_tokens']}, {result['threads']} thread(s), seed {result['seed']}, load average "
             f"{result['load_average_before'][0]:.2f} before / {result['load_average_after'][0]:.2f} after, "
             f"{result['duration_s']:.0f} s)", "",
             "| client | completed | disconnected | cancelled | 429 | 503 | TTFT ms p50 / p95 | ITL ms p50 / p95 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["per_client"] + [result["overall"]]:
        name = "all" if row["client"] < 0 else str(row["client"])
        lines.append(f"| {name} | {row['completed']} | {row['disconnected']} | {row['cancelled']} "
                     f"| {row['rejected_429']} | {row['rejected_503']} "
                     f"| {num(row['ttft_ms_p50'])} / {num(row['ttft_ms_p95'])} "
                     f"| {num(row['itl_ms_p50'], 1)} / {num(row['itl_ms_p95'], 1)} |")
    bursts = "; ".join(f"{b['size']} at turn {b['at_turn']}: "
                       + ", ".join(f"{k} x{n}" for k, n in sorted(b["statuses"].items())) for b in result["burst_runs"])
    lines += ["", "| measure | value |", "|---|---|",
              f"| statuses | {', '.join(f'{k} x{n}' for k, n in result['statuses'].items())} |",
              f"| bursts | {bursts or '-'} |",
              f"| cached prompt tokens | {num((result['cached_token_fraction'] or 0) * 100, 1)} % |",
              f"| server RSS MB, first / last quartile median | {num(rss['first_quartile_median_mb'], 1)} / "
              f"{num(rss['last_quartile_median_mb'], 1)} ({num(rss['ratio'], 3)}x, max "
              f"{num(rss['max_mb'], 1)}, {rss['samples']} samples) |",
              f"| KV bytes used, most / budget | {kv['used_max_bytes'] / MIB:.1f} / {kv['budget_bytes'] / MIB:.1f} MiB "
              f"({num((kv['used_max_fraction'] or 0) * 100, 1)} %) |",
              f"| idle after {idle['seconds_to_idle']:.1f} s: blocks free + cached / total, in use | "
              f"{idle['blocks']['free']} + {idle['blocks']['cached']} / {idle['blocks']['total']}, "
              f"{idle['blocks']['in_use']} |",
              f"| checks | {'all passed' if result['passed'] else 'FAILED: ' + '; '.join(result['failures'])} |"]
    return "\n".join(lines) + "\n"


def server_log(path: str) -> dict:
    """Tracebacks and the last lines of the server's stderr."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    return {"log_tracebacks": sum(line.startswith("Traceback") for line in lines),
            "log_errors": sum(" ERROR" in line or line.startswith("ERROR") for line in lines),
            "log_tail": lines[-30:]}


def interrupt(_signum: int, _frame: object) -> None:
    """SIGTERM handled as Ctrl-C, so the server is stopped on the way out."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 when every check passes, 1 when one fails, 2 for a setup problem, 130 on Ctrl-C."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if not args.engine.is_dir():
        print(f"soak: error: no engine folder at {args.engine}; build one with `cabin-build --model default "
              f"--kv-cache int8 --output {args.engine}` or pass --engine an existing folder", file=sys.stderr)
        return 2
    if not (args.engine / "manifest.json").is_file():
        print(f"soak: error: {args.engine} has no manifest.json, so it is no engine folder; pass --engine a folder "
              "written by cabin-build", file=sys.stderr)
        return 2
    info = machine_info()
    port = free_port()
    command = server_command(args, port)
    handle, log_path = tempfile.mkstemp(prefix="cabin-serve-", suffix=".log")
    os.close(handle)
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            process = start_server(command, args.threads, port, log)
            lost = None
            try:
                load_before = os.getloadavg()
                soak = Soak(args, f"http://127.0.0.1:{port}", process.pid)
                raw = asyncio.run(soak.run())
                load_after = os.getloadavg()
            except httpx.HTTPError as err:  # /metrics unanswered: the server is gone or broken
                lost = f"{type(err).__name__}: {err}"
            finally:
                exit_code = stop_server(process)
        if lost:
            raise SoakError(f"cabin-serve stopped answering during the run ({lost}; exit code {exit_code}, its log "
                            f"ends: {last_line(log_path) or 'nothing'}); rerun with the same --seed to reproduce")
        server = {"exit_code": exit_code, **server_log(log_path)}
    except SoakError as err:
        print(f"soak: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("soak: interrupted; cabin-serve stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.unlink(log_path)
    result = summarize(args, argv, soak, raw, command, server, load_before, load_after, info)
    write_results(args.output, result, markdown(result))
    if not result["passed"]:
        print(f"soak: FAILED: {'; '.join(result['failures'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
