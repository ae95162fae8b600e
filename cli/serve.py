"""``cabin-serve``: an OpenAI-compatible chat server for several cabin zones on one engine and one KV budget."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import uvicorn

from cabinllm.cli.args import add_cache_flags, entry_point, int_range, kv_budget_bytes, positive_float, positive_int
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.engine import Engine
from cabinllm.runtime.errors import CabinError
from cabinllm.server.app import ServeConfig, create_app
from cabinllm.server.scheduler import Scheduler, SchedulerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-serve."""
    parser = argparse.ArgumentParser(prog="cabin-serve",
                                     description="Serve a CabinLLM engine over OpenAI's chat completions API: "
                                                 "batched decode of all clients, prefix reuse across requests.")
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int_range(1, 65535), default=8000, help="TCP port (default 8000)")
    add_cache_flags(parser, ", shared by every conversation")
    parser.add_argument("--max-sessions", type=positive_int, default=4, help="requests decoding together (default 4)")
    parser.add_argument("--max-queue", type=positive_int, default=16,
                        help="requests waiting for a session or KV blocks before new ones get 429 (default 16)")
    parser.add_argument("--queue-timeout", type=positive_float, default=60.0,
                        help="seconds a request may wait before it gets 503 (default 60)")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="reply limit of a request that sets no max_tokens (default 256)")
    parser.add_argument("--prefill-chunk", type=positive_int, default=256,
                        help="prompt tokens computed per step, so decoding clients are not stalled by a long prompt "
                             "(default 256)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads of the reference engine (default: torch's)")
    parser.add_argument("--model-name", default=None, help="model id clients send (default: the engine folder's name)")
    return parser.parse_args(argv)


def build(args: argparse.Namespace):
    """The engine, scheduler and app for these options; ValueError and engine errors on bad ones."""
    budget = kv_budget_bytes(args.kv_budget_mb)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(args.engine)
    cache = engine.new_cache(engine.kv_cache_config(args.kv_cache, budget, args.tokens_per_block))
    scheduler = Scheduler(engine, cache, SchedulerConfig(args.max_sessions, args.max_queue, args.prefill_chunk,
                                                         args.queue_timeout))
    config = ServeConfig(args.model_name or Path(args.engine).resolve().name, OverflowPolicy(args.overflow),
                         args.max_tokens)
    return create_app(engine, scheduler, config)


@entry_point("cabin-serve")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    try:
        app = build(args)
    except (CabinError, OSError) as err:
        print(f"cabin-serve: error: {err}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
