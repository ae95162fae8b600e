"""``cabin-serve``: an OpenAI-compatible chat server for several cabin zones on one engine and one KV budget."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from cabinllm.cli.args import (add_cache_flags, add_device_flag, add_image_flags, add_speech_flags, add_thread_flag,
                               cli_message, entry_point, help_of, image_limits, int_range, kv_cache_config,
                               positive_float, positive_int, speech_settings, use_threads)
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import CabinError, ConfigError
from cabinllm.runtime.generation.grammar import MAX_TOOL_CALLS
from cabinllm.server.app import ServeConfig, create_app
from cabinllm.server.edge import API_KEY_ENV, MAX_HEADER_BYTES, CabinServer, ServeLimits, is_loopback, timed_h11
from cabinllm.runtime.engine.scheduler import SchedulerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-serve."""
    parser = argparse.ArgumentParser(prog="cabin-serve",
                                     description="Serve a CabinLLM engine over OpenAI's chat completions API: "
                                                 "batched decode of all clients, prefix reuse across requests.")
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1); any other than loopback needs an API key or "
                             "--allow-unauthenticated")
    parser.add_argument("--port", type=int_range(1, 65535), default=8000, help="TCP port (default 8000)")
    parser.add_argument("--uds", type=Path, help="listen on this Unix domain socket instead of TCP (clients on the "
                                                 "same SoC; the socket file's permissions decide who may connect)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help=f"clients must send 'Authorization: Bearer KEY' on every endpoint but "
                                        f"/health (default: ${API_KEY_ENV} if set, else none); visible in the process "
                                        "list, so prefer --api-key-file")
    keys.add_argument("--api-key-file", type=Path, help="read the API key from this file (its first line)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve a non-loopback --host without an API key (anyone who reaches it may use it)")
    add_cache_flags(parser, ", shared by every conversation")
    add_image_flags(parser)
    add_speech_flags(parser)
    parser.add_argument("--max-sessions", type=positive_int, default=4, help="requests decoding together (default 4)")
    parser.add_argument("--max-queue", type=positive_int, default=16,
                        help="requests waiting for a session or KV blocks before new ones get 429 (default 16)")
    parser.add_argument("--queue-timeout", type=positive_float, default=60.0,
                        help="seconds a request may wait before it gets 503 (default 60)")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="reply limit of a request that sets no max_tokens (default 256)")
    parser.add_argument("--max-n", type=positive_int, default=4,
                        help="most choices (n) one request may ask for, each decoded as one of --max-sessions; they "
                             "share the prompt's prefill and KV blocks (default 4)")
    parser.add_argument("--max-tool-calls", type=positive_int, default=MAX_TOOL_CALLS,
                        help="most calls one reply makes with parallel_tool_calls (false: one; a call repeated in "
                             f"one reply ends it) (default {MAX_TOOL_CALLS})")
    parser.add_argument("--prefill-chunk", type=positive_int, default=256,
                        help="prompt tokens computed per step, so decoding clients are not stalled by a long prompt "
                             "(default 256)")
    for limit in dataclasses.fields(ServeLimits):
        kind = positive_float if limit.type == "float" else positive_int
        flag = "--" + limit.name.removesuffix("_s").replace("_", "-")
        parser.add_argument(flag, dest=limit.name, type=kind, default=limit.default,
                            help=f"{help_of(ServeLimits, limit.name)} (default {limit.default:,})")
    add_thread_flag(parser)
    add_device_flag(parser)
    parser.add_argument("--model-name", default=None, help="model id clients send (default: the engine folder's name)")
    return parser.parse_args(argv)


def api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key, --api-key-file or the environment; ConfigError for an empty one or an open bind."""
    key = args.api_key
    if args.api_key_file:
        try:
            key = next((line for line in args.api_key_file.read_text(encoding="utf-8").splitlines() if line.strip()),
                       "")
        except OSError as err:
            raise ConfigError(f"--api-key-file {args.api_key_file}: {err.strerror or err}") from err
    elif key is None:
        key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ConfigError("the API key is empty; give a key of some characters (or none: leave it out)")
    if key is None and args.uds is None and not is_loopback(args.host) and not args.allow_unauthenticated:
        raise ConfigError(f"--host {args.host} serves other machines and there is no API key: give --api-key-file "
                          f"FILE (or --api-key, or ${API_KEY_ENV}), or --allow-unauthenticated to serve anyone who "
                          "reaches it")
    return key.strip() if key else None


def limits(args: argparse.Namespace) -> ServeLimits:
    """The request limits of the flags."""
    return ServeLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeLimits)})


def build(args: argparse.Namespace) -> FastAPI:
    """The engine, its core and the app for these options; CabinError and OSError on bad ones."""
    key = api_key(args)
    kv_cache = kv_cache_config(args)
    asr, audio_limits, _ = speech_settings(args)
    use_threads(args)
    engine = Engine.load(args.engine, args.device)
    if engine.vision is not None:
        engine.vision.limits = image_limits(args)
    cache = engine.new_cache(kv_cache, args.max_sessions)
    core = engine.new_core(cache, SchedulerConfig(args.max_sessions, args.max_queue, args.prefill_chunk,
                                                  args.queue_timeout))
    config = ServeConfig(args.model_name or Path(args.engine).resolve().name, args.overflow,
                         args.max_tokens, args.max_n, args.max_tool_calls, asr, audio_limits)
    return create_app(engine, core, config, limits(args), key)


def server(app: FastAPI, args: argparse.Namespace) -> CabinServer:
    """uvicorn for the app on the flags' address, with the request-head timeout and the graceful stop."""
    serve = limits(args)
    where = {"uds": str(args.uds)} if args.uds else {"host": args.host, "port": args.port}
    config = uvicorn.Config(app, **where, log_level="warning", http=timed_h11(serve.read_timeout_s),
                            timeout_keep_alive=serve.keep_alive_s, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_graceful_shutdown=serve.shutdown_grace_s + 5)  # after the grace: a backstop
    return CabinServer(config, app.state.shutdown, serve.shutdown_grace_s)


@entry_point("cabin-serve")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    logging.basicConfig(format="cabin-serve: %(message)s", level=logging.INFO)
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # not a line per clip heard
    try:
        app = build(args)
    except (CabinError, OSError) as err:
        print(f"cabin-serve: error: {cli_message(err)}", file=sys.stderr)
        return 2
    server(app, args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
