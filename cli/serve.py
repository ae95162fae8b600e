"""``cabin-serve``: an OpenAI-compatible chat server for several cabin zones on one engine and one KV budget."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import uvicorn

from cabinllm.cli.args import entry_point, int_range, kv_budget_bytes, positive_float, positive_int
from cabinllm.runtime.dialogue.overflow import OVERFLOW_POLICIES, OverflowPolicy
from cabinllm.runtime.engine import Engine
from cabinllm.runtime.errors import CabinError
from cabinllm.runtime.kv.modes import REFERENCE_KV_MODES
from cabinllm.server.app import ServeConfig, create_app
from cabinllm.server.scheduler import Scheduler, SchedulerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-serve."""
    parser = argparse.ArgumentParser(prog="cabin-serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Serve a CabinLLM engine over OpenAI's chat completions API: "
                                                 "batched decode of all clients, prefix reuse across requests.")
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int_range(1, 65535), default=8000, help="TCP port")
    parser.add_argument("--kv-budget-mb", type=positive_float, default=64.0, help="KV cache budget in MiB, "
                        "shared by every conversation")
    parser.add_argument("--kv-cache", choices=REFERENCE_KV_MODES, default=None,
                        help="KV storage (None: what the engine was built for)")
    parser.add_argument("--tokens-per-block", type=positive_int, default=None,
                        help="tokens per KV block, the unit of prefix reuse (None: the engine's target's)")
    parser.add_argument("--max-sessions", type=positive_int, default=4, help="requests decoding together")
    parser.add_argument("--max-queue", type=positive_int, default=16,
                        help="requests waiting for a session or KV blocks before new ones get 429")
    parser.add_argument("--queue-timeout", type=positive_float, default=60.0,
                        help="seconds a request may wait before it gets 503")
    parser.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="sink-window",
                        help="when a conversation does not fit one sequence's budget: keep the system prompt and "
                             "the most recent tokens, drop the oldest turns, or answer 400 (error)")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="reply limit of a request that sets no max_tokens")
    parser.add_argument("--prefill-chunk", type=positive_int, default=256,
                        help="prompt tokens computed per step, so decoding clients are not stalled by a long prompt")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads of the reference engine (None: torch's default)")
    parser.add_argument("--model-name", default=None, help="model id clients send (None: the engine folder's name)")
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
