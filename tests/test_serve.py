"""cabin-serve through the real openai client on loopback: the same greedy replies as a dialogue session,
streaming, prefix reuse reported as cached tokens, bad input answered 400 while others are served, and a
bounded load test under a 16 MiB INT8 KV budget."""
import json
import threading

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from cabinllm.cli.serve import main
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.server.app import ServeConfig, create_app
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig

from serve_helpers import metrics, running_server

SYSTEM = " ".join(["what does the light mean"] * 8)  # longer than a KV block: shared by conversations
TURNS = ["navigate to the nearest charging station", "set cabin temperature", "play some jazz"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    with running_server(tiny_engine_dir, "--kv-budget-mb", "16", "--kv-cache", "int8") as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def session_replies(engine):
    """Greedy replies of a dialogue session (what cabin-chat prints) to TURNS."""
    cache = engine.new_cache(KvCacheConfig("int8", 16 << 20))
    session = DialogueSession(engine, cache, SamplingParams(MAX_TOKENS, stop_token_ids=engine.stop_token_ids()),
                              SYSTEM)
    return [session.chat(text) for text in TURNS]


def test_replies_match_the_dialogue_session_and_reuse_the_prefix(client, tiny_engine):
    want = session_replies(tiny_engine)
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, (text, expected) in enumerate(zip(TURNS, want)):
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS)
        choice = reply.choices[0]
        assert choice.message.content == expected.reply
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert choice.finish_reason == ("stop" if expected.finish_reason == "stop" else "length")
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached < reply.usage.prompt_tokens and (turn == 0 or cached > 0)
        messages.append({"role": "assistant", "content": choice.message.content})


def test_streamed_reply_matches_and_ends_with_usage(client, tiny_engine):
    want = session_replies(tiny_engine)[0]
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}],
        temperature=0, max_completion_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.reply
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with httpx.Client() as http:
        assert http.get(f"{server}/health").json()["status"] == "ok"
        m = metrics(http, server)
    assert m["cabin_kv_bytes_budget"] == 16 << 20
    assert 0 < m["cabin_kv_bytes_reserved"] <= m["cabin_kv_bytes_budget"]


BAD = [
    (b"{not json", "not valid JSON"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8"),
    (json.dumps({"model": "tiny", "messages": []}).encode(), "messages must be a non-empty list"),
    (json.dumps({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}).encode(), "role must be one of"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": 5}]}).encode(), "must be a string"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "  "}]}).encode(), "is empty"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "play"}], "temperature": "hot"}).encode(),
     "temperature must be a number"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "play"}], "n": 0}).encode(),
     "n must be an integer from 1 to 128"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "play"}], "seed": 2**70}).encode(),
     "seed must be an integer from 0"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "play"}], "max_tokens": 0}).encode(),
     "max_tokens must be an integer >= 1"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "jazz " * 1100}]}).encode(),
     "shorten the message"),
]


@pytest.mark.parametrize("body, problem", BAD, ids=[problem for _, problem in BAD])
def test_bad_input_is_a_400_in_openai_shape_and_serving_goes_on(server, client, body, problem):
    response = httpx.post(f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert problem in error["message"] and error["type"] == "invalid_request_error"
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "play some jazz"}],
                                          temperature=0, max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_disconnected_stream_frees_its_blocks(server, client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "play some jazz"}],
                                            max_tokens=400, stream=True, temperature=1.0, seed=3)
    next(iter(stream))
    stream.close()
    with httpx.Client() as http:
        for _ in range(200):
            m = metrics(http, server)
            if m["cabin_active_sequences"] == 0:
                break
            threading.Event().wait(0.02)
    assert m["cabin_active_sequences"] == 0 and m["cabin_kv_blocks_in_use"] == 0


def test_load_four_zones_ten_turns_within_the_budget(tiny_engine_dir):
    """4 clients x 10 turns, one system prompt, 16 MiB INT8: every turn answered (after 429s at most), no 5xx,
    KV never over the budget, every block free or cached at the end."""
    statuses: list[int] = []
    cached: list[list[int]] = [[] for _ in range(4)]
    peak = []

    def zone(index: int, base: str) -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(10):
            messages.append({"role": "user", "content": TURNS[(index + turn) % len(TURNS)]})
            while True:
                try:
                    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                          max_tokens=6)
                    statuses.append(200)
                    break
                except (openai.RateLimitError, openai.InternalServerError) as err:
                    statuses.append(err.status_code)
                    threading.Event().wait(0.02)
            cached[index].append(reply.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})

    with running_server(tiny_engine_dir, "--kv-budget-mb", "16", "--kv-cache", "int8", "--max-sessions", "2",
                        "--max-queue", "1") as base:
        threads = [threading.Thread(target=zone, args=(i, base)) for i in range(4)]
        for t in threads:
            t.start()
        with httpx.Client() as http:
            while any(t.is_alive() for t in threads):
                m = metrics(http, base)
                peak.append(m["cabin_kv_bytes_used"])
                threading.Event().wait(0.01)
            for t in threads:
                t.join()
            end = metrics(http, base)
    assert statuses.count(200) == 40
    assert set(statuses) <= {200, 429, 503}
    assert max(peak) <= end["cabin_kv_bytes_budget"] and end["cabin_kv_bytes_used_peak"] <= end["cabin_kv_bytes_budget"]
    assert end["cabin_kv_blocks_in_use"] == 0
    assert end["cabin_kv_blocks_free"] + end["cabin_kv_blocks_cached"] == end["cabin_kv_blocks_total"]
    assert all(c > 0 for zone_cached in cached for c in zone_cached[1:])  # the shared system prompt and history


@pytest.mark.parametrize("policy", ["error", "sink-window", "drop-turns"])
def test_a_conversation_over_the_budget_follows_the_overflow_policy(tiny_engine_dir, policy):
    """128 tokens of KV (4 blocks of 32): a 150-token conversation is cut by the policy, or refused under error."""
    messages = [{"role": "system", "content": SYSTEM}]
    for text in TURNS * 3:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "play some jazz"}]
    messages.append({"role": "user", "content": TURNS[0]})
    with running_server(tiny_engine_dir, "--kv-budget-mb", "0.05", "--kv-cache", "int8", "--overflow", policy) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        if policy == "error":
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
            assert caught.value.code == "context_length_exceeded" and "choose --overflow" in caught.value.message
        else:
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            assert 0 < reply.usage.prompt_tokens + 8 <= 128


def test_a_full_queue_is_a_429_with_retry_after(tiny_engine):
    """No engine thread runs (the app's lifespan is not started), so one queued request fills a queue of one."""
    scheduler = tiny_engine.new_core(tiny_engine.new_cache(KvCacheConfig("int8", 1 << 20)),
                          SchedulerConfig(max_queue=1))
    scheduler.add_request(Request([1, 2, 3], SamplingParams(4), lambda *_: None))
    app = create_app(tiny_engine, scheduler, ServeConfig("tiny", OverflowPolicy("error")))
    response = TestClient(app).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "play"}]})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded" and "--max-queue 1" in response.json()["error"]["message"]


@pytest.mark.parametrize("argv, problem", [(["--engine", "missing-engine"], "build an engine first"),
                                           (["--engine", "x", "--port", "70000"], "--port"),
                                           (["--engine", "x", "--kv-budget-mb", "1e12"], "--kv-budget-mb")])
def test_cabin_serve_bad_flags_are_one_line_and_exit_2(argv, problem, capsys):
    with pytest.raises(SystemExit) as leaving:
        raise SystemExit(main(argv))
    assert leaving.value.code == 2 and problem in capsys.readouterr().err
