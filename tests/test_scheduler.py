"""The serving scheduler without HTTP: chunked prefill and batched decode give the single-sequence tokens,
prefixes are reused across requests, the queue is bounded, waits expire, cancellation frees blocks."""
import asyncio
import threading
import time

import pytest
from core_helpers import generate

from cabinllm.runtime.errors import QueueFull
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.server.app import SERVER_WORDS, Output, Reply, _stream
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.server.edge import Shutdown
from cabinllm.server.openai_api import ChatCompletionRequest
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig

VOCAB = 20
PROMPTS = [[(7 * i + 3) % VOCAB or 1 for i in range(70)], [(5 * i + 1) % VOCAB or 2 for i in range(9)],
           [(3 * i + 4) % VOCAB or 3 for i in range(41)]]


def params(n=10):
    return SamplingParams(max_new_tokens=n)  # no stop token: every reply runs to n tokens


def new_scheduler(engine, budget=1 << 20, **config):
    cache = engine.new_cache(KvCacheConfig("int8", budget, 8))
    return engine.new_core(cache, SchedulerConfig(**config))


def drain(scheduler, limit=500):
    for _ in range(limit):
        if not scheduler.step():
            return
    raise AssertionError("the scheduler did not finish")


def collect():
    done = []
    return done, lambda request, text, finished: done.append(request) if finished else None


def test_chunked_prefill_and_batched_decode_give_the_single_sequence_tokens(tiny_engine):
    want = []
    for prompt in PROMPTS:
        cache = tiny_engine.new_cache(KvCacheConfig("int8", 1 << 20, 8))
        want.append(generate(tiny_engine, cache, prompt, params()).token_ids)
    scheduler = new_scheduler(tiny_engine, max_sessions=3, prefill_chunk=16)
    done, on_output = collect()
    requests = [Request(prompt, params(), on_output) for prompt in PROMPTS]
    for request in requests:
        scheduler.add_request(request)
    drain(scheduler)
    assert [r.token_ids for r in requests] == want
    assert all(r.finish_reason == "length" for r in requests) and len(done) == 3
    assert scheduler.cache.stats().blocks_in_use == 0
    scheduler.cache.blocks.check_invariants()


def test_a_returning_conversation_prefills_only_its_new_tokens(tiny_engine):
    scheduler = new_scheduler(tiny_engine)
    _, on_output = collect()
    first = Request(PROMPTS[0], params(), on_output)
    scheduler.add_request(first)
    drain(scheduler)
    follow_up = PROMPTS[0] + first.token_ids + PROMPTS[1]
    second = Request(follow_up, params(), on_output)
    scheduler.add_request(second)
    drain(scheduler)
    fed = len(PROMPTS[0]) + len(first.token_ids) - 1  # the last reply token was never fed
    assert second.cached_tokens == fed // 8 * 8 > 0
    stats, _ = scheduler.stats()
    assert stats.cached_tokens == second.cached_tokens and stats.prompt_tokens == len(PROMPTS[0]) + len(follow_up)


def test_queue_is_bounded_and_a_long_wait_expires(tiny_engine):
    scheduler = new_scheduler(tiny_engine, max_sessions=1, max_queue=1, queue_timeout_s=0.05)
    done, on_output = collect()
    running, waiting = Request(PROMPTS[0], params(50), on_output), Request(PROMPTS[1], params(), on_output)
    scheduler.add_request(running)
    scheduler.step()  # admitted: the queue is empty again
    scheduler.add_request(waiting)
    with pytest.raises(QueueFull) as full:
        scheduler.add_request(Request(PROMPTS[2], params(), on_output))
    assert "max-queue 1" in full.value.words(SERVER_WORDS)  # as the server words it
    time.sleep(0.06)
    scheduler.step()
    assert waiting.finish_reason == "expired" and running.finish_reason is None


def test_cancelling_frees_the_blocks(tiny_engine):
    scheduler = new_scheduler(tiny_engine, max_sessions=2)
    _, on_output = collect()
    requests = [Request(PROMPTS[0], params(100), on_output), Request(PROMPTS[2], params(100), on_output)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(5):
        scheduler.step()
    assert scheduler.cache.stats().blocks_in_use > 0
    for request in requests:
        request.cancel()
    scheduler.step()
    assert [r.finish_reason for r in requests] == ["cancelled", "cancelled"]
    assert scheduler.cache.stats().blocks_in_use == 0 and scheduler.stats()[0].running == 0
    scheduler.cache.blocks.check_invariants()


def test_a_stream_closed_by_its_client_cancels_the_request(tiny_engine):
    request = Request([1, 2], params(), lambda *_: None)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "go"}], "stream": True})

    async def read_one_then_close():
        outputs = asyncio.Queue()
        stream = _stream([request], outputs, Output(0, "navigate", False), "id", "tiny", chat,
                         Reply(chat, tiny_engine), Shutdown(), tiny_engine)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(read_one_then_close())
    assert request.cancelled


def test_a_failed_step_ends_the_running_requests_and_serving_goes_on(tiny_engine, monkeypatch):
    scheduler = new_scheduler(tiny_engine)
    _, on_output = collect()
    failed = Request(PROMPTS[0], params(), on_output)
    scheduler.add_request(failed)
    monkeypatch.setattr(tiny_engine.model, "step", lambda *_, **__: (_ for _ in ()).throw(RuntimeError("boom")))
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,))
    thread.start()
    try:
        for _ in range(200):
            if failed.finish_reason:
                break
            time.sleep(0.01)
        monkeypatch.undo()
        assert failed.finish_reason == "error" and "boom" in failed.error
        served = Request(PROMPTS[1], params(), on_output)
        scheduler.add_request(served)
        for _ in range(200):
            if served.finish_reason:
                break
            time.sleep(0.01)
        assert served.finish_reason == "length"
        assert scheduler.cache.stats().blocks_in_use == 0
    finally:
        stop.set()
        thread.join()
