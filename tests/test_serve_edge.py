"""cabin-serve under hostile or unlucky clients: nested JSON, bodies over the limit (declared and streamed), too
many messages, slow heads and bodies, missing or wrong API keys, an open bind without a key, a fault inside a
handler, a Unix socket; and SIGTERM during a live stream (a cabin-serve process). Each answers its status in
OpenAI's error shape, and the server still serves the next request."""
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from fastapi.testclient import TestClient

from cabinllm.cli.serve import build, main, parse_args, server
from cabinllm.server.edge import API_KEY_ENV, is_loopback

from serve_helpers import free_port, running_server

PLAY = {"messages": [{"role": "user", "content": "play some jazz"}], "max_tokens": 2}
KEY = "cabin-test-key"


def new_client(engine_dir, *flags: str) -> TestClient:
    return TestClient(build(parse_args(["--engine", str(engine_dir), "--model-name", "tiny", *flags])))


@pytest.fixture(scope="module")
def client(tiny_engine_dir):
    with new_client(tiny_engine_dir, "--max-body-bytes", "1000000", "--max-messages", "100") as test_client:
        yield test_client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"]
    return response.json()["error"]


def still_serves(client) -> None:
    reply = client.post("/v1/chat/completions", json=PLAY)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("depth", [33, 100_000])
def test_nested_json_is_a_400(client, depth):
    body = '{"messages": ' + "[" * depth + "]" * depth + "}"
    error = error_of(client.post("/v1/chat/completions", content=body), 400)
    assert "deeper than 32 levels" in error["message"] and "--max-json-depth" in error["message"]
    still_serves(client)


def test_a_body_over_the_limit_is_a_413_declared_or_streamed(client):
    big = json.dumps({**PLAY, "user": "x" * 1_200_000}).encode()
    error = error_of(client.post("/v1/chat/completions", content=big), 413)
    assert error["code"] == "request_too_large" and "1,000,000 bytes" in error["message"]
    chunks = (big[i:i + 100_000] for i in range(0, len(big), 100_000))  # no Content-Length: chunked
    assert error_of(client.post("/v1/chat/completions", content=chunks), 413)["code"] == "request_too_large"
    still_serves(client)


def test_ten_thousand_messages_are_a_400_naming_the_limit(client):
    body = {"messages": [{"role": "user", "content": "hi"}] * 10_000}
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages" and "10,000 messages" in error["message"] and "--max-messages" in error[
        "message"]
    still_serves(client)


def test_a_fault_in_a_handler_is_a_json_500_with_the_request_id(client, monkeypatch, caplog):
    def broken(*_args, **_kwargs):
        raise RuntimeError("prompt planner broke")

    monkeypatch.setattr("cabinllm.server.app.plan_prompt", broken)
    response = client.post("/v1/chat/completions", json=PLAY)
    error = error_of(response, 500)
    assert error["code"] == "internal_error" and response.headers["x-request-id"] in error["message"]
    lines = [r for r in caplog.records if "prompt planner broke" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None  # one line, no traceback
    monkeypatch.undo()
    still_serves(client)


def test_an_api_key_guards_every_endpoint_but_health(tiny_engine_dir, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    with new_client(tiny_engine_dir) as keyed:
        assert keyed.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            error = error_of(keyed.get(path), 401)
            assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
        wrong = keyed.post("/v1/chat/completions", json=PLAY, headers={"Authorization": "Bearer nope"})
        assert "not this server's" in error_of(wrong, 401)["message"]
        assert wrong.headers["www-authenticate"] == "Bearer"
        good = keyed.post("/v1/chat/completions", json=PLAY, headers={"Authorization": f"Bearer {KEY}"})
        assert good.status_code == 200
        counts = keyed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert 'cabin_http_requests_total{status="401"} 4.0' in counts.text
        assert 'cabin_http_requests_total{status="200"} 2.0' in counts.text


def test_the_key_comes_from_a_file_and_an_empty_one_is_refused(tiny_engine_dir, tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text(f"\n{KEY}\n")
    with new_client(tiny_engine_dir, "--api-key-file", str(key_file)) as keyed:
        assert keyed.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    key_file.write_text("  \n")
    assert main(["--engine", str(tiny_engine_dir), "--api-key-file", str(key_file)]) == 2
    assert "the API key is empty" in capsys.readouterr().err


def test_an_open_bind_without_a_key_refuses_to_start(tiny_engine_dir, capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert main(["--engine", str(tiny_engine_dir), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 serves other machines and there is no API key" in err and "Traceback" not in err
    args = parse_args(["--engine", str(tiny_engine_dir), "--host", "0.0.0.0", "--allow-unauthenticated"])
    assert build(args) is not None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20") and not is_loopback("cabin.local")


def test_a_slow_head_or_body_is_cut_off_and_others_are_served(tiny_engine_dir):
    with running_server(tiny_engine_dir, "--read-timeout", "1") as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as silent, \
                socket.create_connection(("127.0.0.1", port)) as slow_body:
            silent.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            with httpx.Client() as http:
                assert http.post(f"{base}/v1/chat/completions", json=PLAY).status_code == 200
            silent.settimeout(5)
            slow_body.settimeout(5)
            assert silent.recv(100) == b""  # closed, nothing sent
            answer = b"".join(iter(lambda: slow_body.recv(4096), b"")).decode()  # until the server closes
            assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer


def test_a_unix_socket_serves_local_clients(tiny_engine_dir, tmp_path):
    path = tmp_path / "cabin.sock"
    args = parse_args(["--engine", str(tiny_engine_dir), "--uds", str(path), "--host", "0.0.0.0"])
    uvicorn_server = server(build(args), args)  # a socket reaches this machine only: no key needed
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uvicorn_server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as http:
            assert http.post("http://cabin/v1/chat/completions", json=PLAY).status_code == 200
    finally:
        uvicorn_server.should_exit = True
        thread.join(10)


@contextmanager
def serve_process(engine_dir, *flags: str):
    """cabin-serve as its own process (signals reach it as they would on the board); yields it and its base URL,
    and kills it if a test left it running."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "cabinllm.cli.serve", "--engine", str(engine_dir), "--port",
                                str(port), "--model-name", "tiny", *flags], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(base):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"cabin-serve did not start: {process.stderr.read()}")
            time.sleep(0.2)
        yield process, base
    finally:
        process.kill()
        process.wait()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health").status_code == 200
    except httpx.TransportError:
        return False


def stream_lines(base: str, max_tokens: int):
    """The lines of a streamed reply of ``max_tokens`` bytes (a grammar keeps the random model from stopping)."""
    body = {"messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "guided_regex": f"[a-z]{{{max_tokens}}}"}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base}/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        yield from (line for line in reply.iter_lines() if line)


@pytest.mark.slow
def test_sigterm_lets_a_short_stream_finish_ends_a_long_one_and_exits_0(bytes_engine_dir):
    with serve_process(bytes_engine_dir, "--shutdown-grace", "1") as (process, base):  # 4,096 positions
        short, long = stream_lines(base, 8), stream_lines(base, 3000)
        first_short, first_long = next(short), next(long)  # both streaming
        process.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.TransportError):  # no new connections
            for _ in range(50):
                httpx.get(f"{base}/health", timeout=1)
                time.sleep(0.1)
        rest_short, rest_long = [first_short, *short], [first_long, *long]
        assert rest_short[-1] == "data: [DONE]"  # finished within the grace
        assert json.loads(rest_long[-1].removeprefix("data: "))["error"]["code"] == "server_stopping"
        assert process.wait(30) == 0
        log = process.stderr.read()
        assert "stopped: 0 of" in log and "Traceback" not in log


@pytest.mark.slow
def test_a_second_signal_exits_at_once(bytes_engine_dir):
    with serve_process(bytes_engine_dir, "--shutdown-grace", "60") as (process, base):
        long = stream_lines(base, 3000)
        next(long)  # a stream running: the first signal waits for it
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.monotonic()
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == 128 + signal.SIGINT and time.monotonic() - t0 < 5
        assert "exiting now" in process.stderr.read()


def test_a_client_that_leaves_the_queue_frees_its_place(bytes_engine_dir):
    with running_server(bytes_engine_dir, "--max-sessions", "1") as base, httpx.Client(timeout=30) as http:
        long = stream_lines(base, 3000)
        next(long)  # holds the one session
        with pytest.raises(httpx.TimeoutException):
            http.post(f"{base}/v1/chat/completions", json=PLAY, timeout=0.5)  # waits in the queue, then leaves
        deadline = time.monotonic() + 5
        while http.get(f"{base}/health").json()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = http.get(f"{base}/health").json()
        assert health["waiting"] == 0 and health["running"] == 1
        long.close()


def test_a_grammar_on_a_tokenizer_llguidance_cannot_read_is_a_400(client):
    body = {**PLAY, "response_format": {"type": "json_object"}}  # the tiny tokenizer: a word-level decoder
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert "cannot drive a grammar" in error["message"] and error["param"].startswith("response_format")
    still_serves(client)
