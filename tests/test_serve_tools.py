"""Tools and structured replies through cabin-serve with the real openai client, on the tiny random model with a
tokenizer of every byte: each reply is a valid call or valid JSON (the grammar's doing, not the weights'),
streamed as OpenAI streams calls, a tool result follows up on the cached prefix, and every bad tool, schema or
choice is a 400 naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from cabinllm.cli.chat import BUILTIN_TOOLS
from cabinllm.runtime.generation import grammar as grammar_module
from cabinllm.runtime.model.tools import HERMES

from serve_helpers import metrics, running_server

CHOSEN = ("set_temperature", "set_window", "play_media")  # a byte per token: the whole catalogue is 5,000 tokens
TOOLS = [tool for tool in json.loads(BUILTIN_TOOLS.read_text(encoding="utf-8")) if tool["function"]["name"] in CHOSEN]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "system", "content": "You control the car."}, {"role": "user", "content": "Open the rear window."}]
WINDOW = {"type": "object", "properties": {"action": {"enum": ["open", "close"]},
                                           "window": {"type": "string", "maxLength": 12}},
          "required": ["action", "window"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "window", "schema": WINDOW, "strict": True}}


@pytest.fixture(scope="module")
def server(bytes_engine_dir):
    with running_server(bytes_engine_dir, "--kv-budget-mb", "32") as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_calls_are_valid_calls_of_the_catalogue(client, seed):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=400, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _valid_calls(choice.message.tool_calls)


def test_a_named_tool_choice_calls_that_function(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=400, seed=0,
                                           parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "set_window"}})
    calls = reply.choices[0].message.tool_calls
    _valid_calls(calls)
    assert {call.function.name for call in calls} == {"set_window"}


def test_streamed_calls_arrive_as_openai_deltas_and_match_the_whole_reply(client):
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400,
                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls: dict[int, dict] = {}
    for part in chunks:
        for delta in part.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
        assert not part.choices[0].delta.content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_call_s_tokens_come_with_their_log_probabilities_whole_and_streamed(client):
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400,
                  parallel_tool_calls=False, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, (call,) = whole.logprobs.content, whole.message.tool_calls
    assert whole.message.content is None and b"".join(bytes(t.bytes) for t in content).startswith(b"<tool_call>")
    (probability,) = HERMES.name_probabilities([bytes(t.bytes) for t in content], [t.logprob for t in content],
                                               [call.function.name])
    assert 0 < probability <= 1
    streamed = [token for part in client.chat.completions.create(**kwargs, stream=True)
                if part.choices and part.choices[0].logprobs for token in part.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_a_tool_result_follows_up_on_the_cached_conversation(client, bytes_engine):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=400, parallel_tool_calls=False)
    message = first.choices[0].message
    follow_up = ASK + [message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"done": true}'}]
    second = client.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=8)
    assert second.choices[0].message.tool_calls is None
    # the prompt and the call, rendered again from the client's copy, are found in the cache: only the result is new
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the stop token is never fed
    block = bytes_engine.kv_cache_config().tokens_per_block
    assert second.usage.prompt_tokens_details.cached_tokens == held // block * block


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_validate(client, stream):
    for seed in range(2):
        kwargs = dict(model="tiny", messages=ASK, response_format=JSON_SCHEMA, temperature=1.0, seed=seed,
                      max_tokens=200)
        if stream:
            text = "".join(part.choices[0].delta.content or "" for part in
                           client.chat.completions.create(**kwargs, stream=True) if part.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), WINDOW)


def test_guided_choice_and_regex_replies_are_whole(client):
    for seed in range(3):
        choice = client.chat.completions.create(model="tiny", messages=ASK, seed=seed, max_tokens=50,
                                                extra_body={"guided_choice": ["open", "close", "leave it"]})
        assert choice.choices[0].message.content in ("open", "close", "leave it")
        regex = client.chat.completions.create(model="tiny", messages=ASK, seed=seed, max_tokens=50,
                                               extra_body={"guided_regex": "[0-9]{1,3} ?%"})
        assert re.fullmatch("[0-9]{1,3} ?%", regex.choices[0].message.content)


def test_json_object_replies_are_objects(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                           seed=0, max_tokens=300)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def _streamed(client, **kwargs) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed reply's content, its calls (name, arguments) and its finish reason."""
    content, calls, finish = "", {}, None
    for part in client.chat.completions.create(**kwargs, stream=True):
        choice = part.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, [delta.function.name, ""])
            call[1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(call) for call in calls.values()], finish


def test_a_reply_cut_after_a_whole_call_returns_it_in_tool_calls_with_no_markup(client, monkeypatch):
    monkeypatch.setattr(grammar_module, "ENDING_DEPTH", 0)  # unsteered: the token limit cuts the reply mid-call
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0)
    for seed in range(30):  # a reply of two calls or more, the first of fixed length (a token a byte)
        whole = client.chat.completions.create(**kwargs, seed=seed, max_tokens=600).choices[0].message.tool_calls
        assert 1 <= len(whole) <= grammar_module.MAX_TOOL_CALLS
        if len(whole) >= 2 and whole[0].function.name != "play_media":
            break
    assert len(whole) >= 2, "no seed gave two calls"
    first = (whole[0].function.name, whole[0].function.arguments)
    cut = len(HERMES.call_text(*first)) + 30  # inside the second call
    choice = client.chat.completions.create(**kwargs, seed=seed, max_tokens=cut).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(call.function.name, call.function.arguments) for call in choice.message.tool_calls] == [first]
    assert _streamed(client, **kwargs, seed=seed, max_tokens=cut) == ("", [first], "length")
    choice = client.chat.completions.create(**kwargs, seed=seed, max_tokens=20).choices[0]  # cut in the first call
    assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_close_within_small_token_limits(client, stream):
    schema = {"type": "object", "properties": {"note": {"type": "string"}}}
    for seed, limit in enumerate((8, 13, 21, 34)):
        kwargs = dict(model="tiny", messages=ASK, temperature=1.0, seed=seed, max_tokens=limit,
                      response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
        if stream:
            text, _, finish = _streamed(client, **kwargs)
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        assert finish in ("stop", "length")
        jsonschema.validate(json.loads(text), schema)


def test_a_max_tokens_below_the_shortest_answer_is_a_400_naming_it(client):
    asks = [dict(response_format=JSON_SCHEMA), dict(tools=TOOLS, tool_choice="required"),
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_window"}})]
    for ask in asks:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=10, **ask)
        error = err.value.body
        assert error["param"] == "max_tokens" and error["message"].startswith("max_tokens 10 is too small")
        assert "raise max_tokens to " in error["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, max_completion_tokens=10, **asks[0])
    assert err.value.body["param"] == "max_completion_tokens"


def test_the_server_s_cap_on_calls(bytes_engine_dir):
    with running_server(bytes_engine_dir, "--kv-budget-mb", "16", "--max-tool-calls", "1") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for seed in range(3):
            reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                   temperature=1.0, seed=seed, max_tokens=300)
            assert len(reply.choices[0].message.tool_calls) == 1 and reply.choices[0].finish_reason == "tool_calls"


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "self_destruct"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["on", "off"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"n": 5}, "n"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[param for _, param in BAD])
def test_a_bad_tool_schema_or_choice_is_a_400_naming_the_field(client, server, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=fields)
    error = err.value.body
    assert err.value.status_code == 400 and error["param"] == param and error["message"].startswith(param)
    assert client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices[0].message.content \
        is not None  # the server goes on
    assert metrics(__import__("httpx"), server)["cabin_active_sequences"] == 0
