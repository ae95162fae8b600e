"""A cabin-serve app run by uvicorn on a free loopback port in a thread of the test process."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

from cabinllm.cli.serve import build, parse_args, server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(engine_dir, *flags: str):
    """Start cabin-serve with these flags; yields its base URL and stops it at the end."""
    port = free_port()
    args = parse_args(["--engine", str(engine_dir), "--port", str(port), "--model-name", "tiny", *flags])
    uvicorn_server = server(build(args), args)  # in a thread: uvicorn leaves the signals alone
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uvicorn_server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uvicorn_server.should_exit = True
        thread.join(10)


def metrics(client, base: str) -> dict[str, float]:
    """The /metrics gauges and counters by name."""
    text = client.get(f"{base}/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
