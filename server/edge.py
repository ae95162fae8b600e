"""Where the server meets the network: request limits, API keys, request ids, errors, and a graceful stop.

Every HTTP request passes ``Edge`` (an ASGI middleware inside FastAPI's error handling) before any route:

- it gets a request id, answered as ``x-request-id`` and named in the server's log line of a failure;
- every endpoint but ``/health`` asks for ``Authorization: Bearer KEY`` when the server has a key (401 otherwise);
- the body is read whole before anything parses it, refused with 413 as soon as ``Content-Length`` or the bytes
  received pass ``max_body_bytes``, and with 408 when it does not arrive within ``read_timeout_s``;
- an exception no route expected becomes a JSON 500 in OpenAI's shape with the request id and one log line.

The request head has the same ``read_timeout_s`` (``TimedH11Protocol``; uvicorn itself only times idle keep-alive
connections), so a client that opens connections and sends nothing holds none of them. ``CabinServer`` runs
uvicorn with a graceful stop: the first SIGTERM or SIGINT stops accepting, lets running requests finish for
``shutdown_grace_s``, then ends what still runs (a stream gets a final error event) and exits 0; a second signal
exits at once.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Awaitable, Callable

import h11
import uvicorn
from prometheus_client import Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

from cabinllm.server.openai_api import ApiError

log = logging.getLogger("cabinllm.server")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
OPEN_PATHS = ("/health",)  # answered without a key: a supervisor's liveness check
API_KEY_ENV = "CABIN_API_KEY"
MAX_HEADER_BYTES = 16 * 1024  # of a request head (h11's own default, stated)


@dataclass(frozen=True)
class ServeLimits:
    """What one request may send, and how long the server waits for it."""

    max_body_bytes: int = field(default=4 << 20, metadata={"help": "largest request body in bytes"})
    max_json_depth: int = field(default=32, metadata={"help": "deepest nesting of arrays and objects in a body"})
    max_messages: int = field(default=1024, metadata={"help": "most messages in one request"})
    max_request_audio_s: float = field(default=300.0, metadata={"help": "seconds of audio one request may send, all "
                                                                       "its clips together"})
    read_timeout_s: float = field(default=30.0, metadata={"help": "seconds a client has to send a request's head, "
                                                                 "and again its body"})
    keep_alive_s: float = field(default=5.0, metadata={"help": "seconds an idle keep-alive connection stays open"})
    shutdown_grace_s: float = field(default=30.0, metadata={"help": "seconds running requests may take to finish "
                                                                   "after SIGTERM or SIGINT"})


def is_loopback(host: str) -> bool:
    """Whether an address to listen on reaches this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


class Edge:
    """The ASGI middleware of the module docstring."""

    def __init__(self, app: Callable, limits: ServeLimits, api_key: str | None, requests: Counter) -> None:
        self.app, self.limits, self.requests = app, limits, requests
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.requests.labels(status=str(message["status"])).inc()
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            refusal = self._refusal(scope)
            body = await self._body(scope, receive) if refusal is None else None
        except ApiError as err:
            refusal = err
        except ClientGone:
            return
        if refusal is not None:
            await _answer(send_with_id, refusal)
            return
        try:
            await self.app(scope, _replay(body, receive), send_with_id)
        except Exception as err:  # the boundary: a fault of ours must not reach the client as a traceback
            log.error("request %s %s %s failed: %s: %s", request_id, scope["method"], scope["path"],
                      type(err).__name__, err)
            if not started:
                await _answer(send_with_id, ApiError(500, f"the server failed on this request (request id "
                                                          f"{request_id}); it goes on serving, retry the request",
                                                     kind="server_error", code="internal_error"))

    def _refusal(self, scope: Scope) -> ApiError | None:
        """The 401 for a missing or wrong key, the 413 for a declared body over the limit."""
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in OPEN_PATHS:
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not key.strip():
                return ApiError(401, "this server needs an API key: send it as 'Authorization: Bearer KEY' (the key "
                                     "cabin-serve was started with)", code="invalid_api_key")
            if not hmac.compare_digest(key.strip(), self.api_key):
                return ApiError(401, "the API key is not this server's; send the key cabin-serve was started with",
                                code="invalid_api_key")
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            return _too_large(self.limits)
        return None

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body, within the size limit and the read timeout."""
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > self.limits.max_body_bytes:
                    raise _too_large(self.limits)
                if not message.get("more_body"):
                    return

        try:
            await asyncio.wait_for(read(), self.limits.read_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.read_timeout_s:g} s; send it "
                                "whole and promptly", code="request_timeout") from None
        return b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def _too_large(limits: ServeLimits) -> ApiError:
    return ApiError(413, f"the request body is over {limits.max_body_bytes:,} bytes (--max-body-bytes); send less, "
                         "e.g. fewer or shorter messages", code="request_too_large")


def _replay(body: bytes | None, receive: Receive) -> Receive:
    """A receive that gives the body read already, then the client's own messages (a disconnect stays visible)."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body or b"", "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, error: ApiError) -> None:
    """A whole JSON error response."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers().items())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if error.status in (408, 413):  # the rest of the body may still come: this connection is done
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def timed_h11(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol that closes a connection whose request head is not whole within ``read_timeout_s``."""

    class TimedH11Protocol(H11Protocol):
        timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.timer:
                self.timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.timer:
                self.timer.cancel()
            self.timer = self.loop.call_later(read_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no whole request head in time: nothing to answer

    return TimedH11Protocol


@dataclass
class Shutdown:
    """The server's stop: ``draining`` refuses new requests; ``stop`` ends the engine thread and what still runs."""

    draining: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)

    def begin(self, grace_s: float) -> None:
        """Refuse new requests now and stop everything after ``grace_s``."""
        self.draining.set()
        timer = threading.Timer(grace_s, self.stop.set)
        timer.daemon = True
        timer.start()


class CabinServer(uvicorn.Server):
    """uvicorn with the graceful stop of the module docstring (exit 0 after the first signal, at once on the
    second)."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown, grace_s: float) -> None:
        super().__init__(config)
        self.shutdown_state, self.grace_s = shutdown, grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain; second: exit now."""
        if self.should_exit:
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(128 + sig)
        log.warning("%s: finishing running requests for up to %g s, then stopping", signal.Signals(sig).name,
                    self.grace_s)
        self.shutdown_state.begin(self.grace_s)
        self.should_exit = True  # uvicorn stops accepting and waits for the connections to close
