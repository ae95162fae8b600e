"""Forked choices and log-probabilities: ``n`` choices from one prefill on shared KV blocks (the scheduler, and
cabin-serve through the real openai client, streamed and not), ``logprobs`` / ``top_logprobs`` in OpenAI's shape
and equal to the model's own, and the limits answered 400 naming the field."""
import math

import openai
import pytest
from core_helpers import beam_search
import torch

from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence, cdiv
from cabinllm.runtime.engine.core import EngineCore
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.kv.cache import KvCacheConfig

from serve_helpers import running_server

ASK = [{"role": "user", "content": "suggest three songs for the drive"}]


@pytest.fixture(scope="module")
def client(tiny_engine_dir):
    with running_server(tiny_engine_dir, "--max-sessions", "4") as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def run(scheduler: EngineCore, requests: list[Request]) -> int:
    """Step until every request is done; the most KV blocks in use at once."""
    peak = 0
    while any(r.finish_reason is None for r in requests):
        scheduler.step()
        peak = max(peak, scheduler.cache.stats().blocks_in_use)
    return peak


def group(prompt: list[int], n: int, max_new: int, temperature: float = 0.0, logprobs: int | None = None):
    params = [SamplingParams(max_new, temperature=temperature, seed=i, stop_token_ids=[]) for i in range(n)]
    requests = [Request(prompt, p, lambda *_: None, logprobs=logprobs) for p in params]
    requests[0].followers = requests[1:]
    return requests


def test_n_choices_prefill_once_and_share_the_prompt_blocks(bytes_engine):
    prompt = torch.randint(0, 200, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    tpb = 32
    cache = bytes_engine.new_cache(KvCacheConfig("int8", 16 << 20, tpb))
    scheduler = bytes_engine.new_core(cache, SchedulerConfig(max_sessions=4, prefill_chunk=2048))
    forked = group(prompt, 4, 64)
    scheduler.add_request(forked[0])
    peak = run(scheduler, forked)
    assert peak <= cdiv(len(prompt), tpb) + 4 * (cdiv(64, tpb) + 1)
    assert scheduler.stats()[0].prompt_tokens == len(prompt)  # one prefill
    assert len({tuple(r.token_ids) for r in forked}) == 1 and all(len(r.token_ids) == 64 for r in forked)

    separate = [Request(prompt, SamplingParams(64, stop_token_ids=[]), lambda *_: None) for _ in range(4)]
    alone = bytes_engine.new_core(bytes_engine.new_cache(KvCacheConfig("int8", 64 << 20, tpb)),
                      SchedulerConfig(max_sessions=4, prefill_chunk=2048))
    for request in separate:
        alone.add_request(request)
    run(alone, separate)
    assert separate[0].token_ids == forked[0].token_ids  # a choice is the reply a lone request gets
    assert cache.stats().blocks_in_use == 0
    cache.blocks.check_invariants()


def test_greedy_logprobs_are_the_models_own(bytes_engine):
    prompt = [72, 101, 108, 108, 111]
    cache = bytes_engine.new_cache(KvCacheConfig("fp32", 4 << 20, 16))
    scheduler = bytes_engine.new_core(cache)
    request = group(prompt, 1, 3, logprobs=5)[0]
    scheduler.add_request(request)
    run(scheduler, [request])
    seq = Sequence()
    reference = bytes_engine.new_cache(KvCacheConfig("fp32", 4 << 20, 16))
    reference.allocate(seq, prompt + request.token_ids[:-1])
    logits = bytes_engine.model.forward(prompt + request.token_ids[:-1], 0, reference, seq, all_logits=True)
    want = torch.log_softmax(logits[len(prompt) - 1:], dim=-1)
    for place, (token, logprob) in enumerate(zip(request.token_ids, request.token_logprobs)):
        assert logprob.token == token and logprob.top[0][0] == token  # greedy: the likeliest
        assert math.isclose(logprob.logprob, float(want[place, token]), abs_tol=1e-4)
        assert [i for i, _ in logprob.top] == torch.topk(want[place], 5).indices.tolist()


def test_n_at_temperature_0_gives_identical_greedy_choices(client):
    one = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=8)
    four = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=8, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert {c.message.content for c in four.choices} == {one.choices[0].message.content}
    assert four.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens


def test_n_3_with_logprobs_round_trips_streamed_and_not(client):
    asked = dict(model="tiny", messages=ASK, temperature=1.0, seed=7, max_tokens=6, n=3, logprobs=True,
                 top_logprobs=5)
    whole = client.chat.completions.create(**asked)
    texts, logprobs = {}, {}
    for part in client.chat.completions.create(**asked, stream=True):
        for choice in part.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.logprobs:
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.content)
    assert texts == {c.index: c.message.content for c in whole.choices}  # the same seeds: the same replies
    for choice in whole.choices:
        content = choice.logprobs.content
        assert [t.token for t in content] == [t.token for t in logprobs.get(choice.index, [])]
        spaced = "".join(t.token for t in content)  # the tiny tokenizer is word-level: its decoder adds the spaces
        assert spaced == choice.message.content.replace(" ", "")
        for token in content:
            assert token.logprob <= 0 and bytes(token.bytes).decode() == token.token
            assert 1 <= len(token.top_logprobs) <= 5
            assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs),
                                                                     reverse=True)
    assert len({c.message.content for c in whole.choices}) > 1  # sampled with different seeds


@pytest.mark.parametrize("fields, param, words", [({"n": 5}, "n", "n must be at most 4"),
                                                  ({"logprobs": True, "top_logprobs": 21}, "top_logprobs",
                                                   "from 0 to 20")])
def test_limits_are_a_400_naming_the_field(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=fields)
    assert err.value.body["param"] == param and words in err.value.body["message"]


def test_beam_width_gives_the_best_beam(client, tiny_engine):
    prompt_reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=10,
                                                  extra_body={"beam_width": 3, "length_penalty": 0.5})
    tok = tiny_engine.tokenizer
    prompt = tok.encode(tok.render(ASK))
    cache = tiny_engine.new_cache(KvCacheConfig(None, 8 << 20))
    best = beam_search(tiny_engine, cache, prompt, BeamParams(3, 10, 0.5, False, tuple(tiny_engine.stop_token_ids())))
    assert prompt_reply.choices[0].message.content == tok.decode_reply(best[0])
    assert prompt_reply.usage.completion_tokens == len(best[0])


@pytest.mark.parametrize("fields, words", [({"stream": True}, "cannot be combined with stream"),
                                           ({"temperature": 0.7}, "cannot be combined with temperature"),
                                           ({"beam_width": 5, "stream": False}, "5 beams need 5 sessions")])
def test_a_beam_search_that_cannot_be_done_as_asked_is_a_400(client, fields, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                       extra_body={"beam_width": 3, **fields})
    assert err.value.body["param"] == "beam_width" and words in err.value.body["message"]


def test_a_group_that_can_never_fit_is_named_before_it_is_queued(tiny_engine):
    cache = tiny_engine.new_cache(KvCacheConfig("fp32", 20 * 4 * 1536, 4))  # 20 blocks of 4 tokens
    scheduler = tiny_engine.new_core(cache, SchedulerConfig(max_sessions=4))
    assert scheduler.never_fits(group(list(range(1, 9)), 2, 12)[0]) is None  # 2 + 3 + 4 blocks
    problem = scheduler.never_fits(group(list(range(1, 9)), 4, 24)[0])
    assert problem == "the prompt and 4 choices of up to 24 tokens need 29 KV blocks of 4 tokens and the whole pool " \
                      "holds 20"
    assert "5 choices need 5 sessions" in scheduler.never_fits(group([1, 2], 5, 4)[0])
