"""Constrained decoding: every reply of a random-weight model under a grammar is a sentence of it (JSON that
validates, calls of the given tools, one of a choice), in the token loop, the batched scheduler and a dialogue
session, with prefix reuse as without a grammar."""
from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from core_helpers import generate
import torch

from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.errors import GrammarError
from cabinllm.runtime.generation.grammar import choice_grammar, json_schema_grammar, regex_grammar, tool_call_grammar
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.model.tools import HERMES, LLAMA3_JSON, Tool
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig

WINDOW = {"type": "object", "properties": {"action": {"enum": ["open", "close"]}, "window": {"type": "string",
          "maxLength": 12}, "percent": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["action", "window", "percent"], "additionalProperties": False}
TOOLS = [Tool("set_temperature", "", {"type": "object", "properties": {"zone": {"enum": ["driver", "all"]},
                                                                         "celsius": {"type": "integer", "minimum": 16,
                                                                                     "maximum": 30}},
                                       "required": ["zone", "celsius"], "additionalProperties": False}),
         Tool("open_window", "", {"type": "object", "properties": {"window": {"enum": ["front-left", "rear-right"]}},
                                  "required": ["window"], "additionalProperties": False})]


def _reply(engine, grammar: str, seed: int, prompt: str = "open the window", max_new_tokens: int = 200,
           whole: bool = True) -> str:
    """A sampled reply under ``grammar``; ``whole``: it must have ended by the grammar, not by its length."""
    cache = engine.new_cache()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed,
                            stop_token_ids=engine.stop_token_ids())
    result = generate(engine, cache, engine.tokenizer.encode_prompt(prompt), params, engine.vocabulary.start(grammar))
    assert result.finish_reason == "stop" or not whole, result
    return result.text


@pytest.mark.parametrize("seed", range(4))
def test_sampled_json_validates_against_the_schema(bytes_engine, seed):
    reply = json.loads(_reply(bytes_engine, json_schema_grammar(WINDOW), seed))
    jsonschema.validate(reply, WINDOW)


def test_json_object_regex_and_choice(bytes_engine):
    assert isinstance(json.loads(_reply(bytes_engine, json_schema_grammar({"type": "object"}), 0)), dict)
    assert _reply(bytes_engine, choice_grammar(["open", "close", "vent (a bit)"]), 1) in ("open", "close",
                                                                                           "vent (a bit)")
    reply = _reply(bytes_engine, regex_grammar(r"[0-9]{2}:[0-5][0-9]"), 2)
    assert len(reply) == 5 and reply[2] == ":"


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA3_JSON])
@pytest.mark.parametrize("choice", ["required", "open_window"])
def test_required_calls_are_calls_of_the_tools(bytes_engine, tool_format, choice):
    for seed in range(3):
        calls = tool_format.parse(_reply(bytes_engine, tool_call_grammar(tool_format, TOOLS, choice, parallel=False),
                                         seed))
        assert calls
        for name, arguments in calls:
            assert choice in ("required", name)
            jsonschema.validate(json.loads(arguments), next(t for t in TOOLS if t.name == name).parameters)


def test_tool_choice_none_never_writes_a_call_and_auto_texts_are_whole(bytes_engine):
    for seed in range(3):
        assert HERMES.opener not in _reply(bytes_engine, tool_call_grammar(HERMES, TOOLS, "none"), seed, whole=False)
        reply = _reply(bytes_engine, tool_call_grammar(HERMES, TOOLS, "auto", parallel=False), seed, whole=False)
        assert HERMES.parse(reply) or HERMES.opener[:-1] not in reply  # a whole call, or text with no call begun


def test_parallel_calls_follow_one_another_and_parse_back(bytes_engine):
    text = HERMES.separator.join([HERMES.call_text("open_window", '{"window": "rear-right"}'),
                                  HERMES.call_text("set_temperature", '{"zone": "all", "celsius": 21}')])
    for parallel, accepted in ((True, True), (False, False)):
        state = bytes_engine.vocabulary.start(tool_call_grammar(HERMES, TOOLS, "required", parallel))
        try:
            for token in bytes_engine.tokenizer.encode(text):
                state.push(token)
        except GrammarError:
            assert not accepted
        else:
            assert accepted and state.complete
    assert HERMES.parse(text) == [("open_window", '{"window": "rear-right"}'),
                                  ("set_temperature", '{"zone": "all", "celsius": 21}')]


def test_a_grammar_the_tokens_cannot_follow_is_refused(bytes_engine):
    with pytest.raises(GrammarError, match="cannot be used"):
        bytes_engine.vocabulary.start(regex_grammar("(unclosed"))


def test_each_sequence_of_a_batch_follows_its_own_grammar_and_reuses_the_prefix(bytes_engine):
    scheduler = bytes_engine.new_core(bytes_engine.new_cache(), SchedulerConfig(max_sessions=4))
    prompt = bytes_engine.tokenizer.encode_prompt("set the cabin temperature " * 8)
    grammars = [json_schema_grammar(WINDOW), choice_grammar(["yes", "no"]),
                tool_call_grammar(HERMES, TOOLS, "required", parallel=False), None]
    done = threading.Event()
    finished: list[Request] = []

    def on_output(request: Request, _text: str, last: bool) -> None:
        if last:
            finished.append(request)
            if len(finished) == len(grammars):
                done.set()

    requests = []
    for i, grammar in enumerate(grammars):
        params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=i,
                                stop_token_ids=bytes_engine.stop_token_ids())
        requests.append(Request(prompt, params, on_output,
                                grammar=bytes_engine.vocabulary.start(grammar) if grammar else None))
        scheduler.add_request(requests[-1])
    while not done.is_set():
        scheduler.step()
    jsonschema.validate(json.loads(requests[0].text), WINDOW)
    assert requests[1].text in ("yes", "no")
    assert HERMES.parse(requests[2].text)
    again = Request(prompt, SamplingParams(max_new_tokens=200, temperature=1.0, seed=9,
                                           stop_token_ids=bytes_engine.stop_token_ids()), on_output,
                    grammar=bytes_engine.vocabulary.start(json_schema_grammar(WINDOW)))
    scheduler.add_request(again)
    while again.finish_reason is None:
        scheduler.step()
    block = scheduler.cache.tokens_per_block
    assert again.cached_tokens == (len(prompt) - 1) // block * block  # every whole block of the prompt is reused
    jsonschema.validate(json.loads(again.text), WINDOW)


def test_a_session_with_tools_calls_answers_and_reuses_its_history(bytes_engine):
    session = DialogueSession(bytes_engine, bytes_engine.new_cache(),
                              SamplingParams(max_new_tokens=200, seed=0, stop_token_ids=bytes_engine.stop_token_ids()),
                              "you drive", tools=TOOLS, tool_choice="required")
    first = session.chat("open the window")
    assert first.finish_reason == "tool_calls" and len(first.tool_calls) >= 1
    call = first.tool_calls[0]
    session.tool_choice = "none"
    second = session.chat({"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'})
    assert second.finish_reason in ("stop", "length") and not second.tool_calls
    assert second.reused_tokens >= first.prefill_tokens  # the call was appended, not prefilled again
    assert session.messages[-2] == {"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'}


def test_a_saved_session_keeps_its_tools_and_calls(bytes_engine, tmp_path):
    params = SamplingParams(max_new_tokens=200, seed=0, stop_token_ids=bytes_engine.stop_token_ids())
    session = DialogueSession(bytes_engine, bytes_engine.new_cache(), params, None, tools=TOOLS,
                              tool_choice="open_window")
    call = session.chat("open the window").tool_calls[0]
    session.save(tmp_path / "s.cabin")
    restored = DialogueSession.restore(tmp_path / "s.cabin", bytes_engine)
    assert restored.tools == TOOLS and restored.tool_choice == "open_window"
    assert restored.messages == session.messages and restored.messages[-1]["tool_calls"] == [call]
    answer = {"role": "tool", "tool_call_id": call["id"], "content": "done"}
    assert restored.chat(answer).token_ids == session.chat(answer).token_ids  # restored without re-prefill, the same


def test_a_grammar_that_fails_mid_reply_ends_that_reply_only(bytes_engine, monkeypatch):
    scheduler = bytes_engine.new_core(bytes_engine.new_cache(), SchedulerConfig(max_sessions=2))
    prompt = bytes_engine.tokenizer.encode_prompt("open the window")
    params = SamplingParams(max_new_tokens=20, stop_token_ids=bytes_engine.stop_token_ids())
    nothing = torch.zeros(bytes_engine.config.vocab_size, dtype=torch.bool)
    broken = bytes_engine.vocabulary.start(json_schema_grammar(WINDOW))
    monkeypatch.setattr(broken, "allowed", lambda: nothing)
    room = SamplingParams(max_new_tokens=64, stop_token_ids=bytes_engine.stop_token_ids())  # holds a whole WINDOW
    failing, free = Request(prompt, room, lambda *_: None, grammar=broken), Request(prompt, params, lambda *_: None)
    for request in (failing, free):
        scheduler.add_request(request)
    while free.finish_reason is None:
        scheduler.step()
    assert failing.finish_reason == "error" and "allows no token" in failing.error
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    session = DialogueSession(bytes_engine, bytes_engine.new_cache(), params, None, tools=TOOLS)
    monkeypatch.setattr(type(broken), "allowed", lambda self: nothing)
    turn = session.chat("open it")
    assert turn.finish_reason == "error" and "allows no token" in turn.error and not session.seq
