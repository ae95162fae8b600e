"""Calls and structured replies that are never lost, never run away and always close, on the tiny random-weight model
with a tokenizer of every byte (mechanics, not quality: a random model writes long strings and many calls, which is
what these rules are for): a cut reply keeps its whole calls and shows no markup, the grammar caps the calls, a
repeated call ends the reply, a JSON answer or a call closes within its token limit, and a limit that cannot hold
the shortest answer is refused up front, in the library's and cabin-chat's words."""
from __future__ import annotations

import json

import jsonschema
import pytest

from cabinllm.cli.chat import main
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.errors import Fix, GrammarError
from cabinllm.runtime.generation.grammar import json_schema_grammar, tool_call_grammar
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.generation.stops import ReplyStream
from cabinllm.runtime.model.tools import HERMES, LLAMA3_JSON, ContentStream

from test_grammar import TOOLS, WINDOW

CALL_A = HERMES.call_text("open_window", '{"window": "rear-right"}')
CALL_B = HERMES.call_text("set_temperature", '{"zone": "all", "celsius": 21}')
FIRST = [("open_window", '{"window": "rear-right"}')]
# schemas whose shortest answer is a few bytes (the tokens of the bytes engine), whose free strings the random model
# does not close by itself, answered with 8 to 64 tokens
SHORT_SCHEMAS = [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
                 {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["n"], "properties": {
                     "n": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}}]
LIMITS = (8, 9, 12, 16, 23, 32, 45, 64)


def _params(engine, limit: int, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=limit, temperature=1.0, seed=seed, stop_token_ids=engine.stop_token_ids())


def _run(engine, grammars: list[tuple[str, int, int]], tool_format=None) -> list[Request]:
    """Replies to one prompt under each (grammar, token limit, seed), batched on one engine core."""
    core = engine.new_core(engine.new_cache(), SchedulerConfig(max_sessions=8, max_queue=len(grammars)))
    prompt = engine.tokenizer.encode_prompt("open the rear window and set 21 degrees")
    requests = [Request(prompt, _params(engine, limit, seed), grammar=engine.vocabulary.start(grammar, tool_format))
                for grammar, limit, seed in grammars]
    for request in requests:
        core.add_request(request)
    while any(request.finish_reason is None for request in requests):
        core.step()
    return requests


def test_a_cut_reply_keeps_its_whole_calls_and_shows_no_markup():
    two = f"{CALL_A}\n{CALL_B}"
    for cut in (two[:len(CALL_A) + 9], two[:-3], f"{CALL_A}\n", CALL_A):  # in the second call, after the first
        assert HERMES.parse(cut) == FIRST and HERMES.content(cut) == ""
    for cut in ("<tool_c", CALL_A[:-4]):  # cut inside the first call: no call, and no content either
        assert HERMES.parse(cut) is None and HERMES.content(cut) == ""
    assert HERMES.content("Opening it.") == "Opening it." and HERMES.parse("Opening it.") is None
    call = LLAMA3_JSON.call_text("open_window", '{"window": "rear-right"}')
    assert LLAMA3_JSON.parse(call) == FIRST and LLAMA3_JSON.content(call[:-1]) == ""
    assert LLAMA3_JSON.content('{"name": "Bob"}') == '{"name": "Bob"}'  # JSON that is no call stays content
    stream = ContentStream(HERMES)
    assert [stream.piece(piece) for piece in ("<tool", "_call>\n{", '"name"')] == ["", "", ""]
    assert stream.rest(two) == ""
    stream = ContentStream(HERMES)
    assert [stream.piece(piece) for piece in ("<", "b>hi", "!")] == ["", "<b>hi", "!"]


@pytest.mark.parametrize("parallel, cap, made", [(True, 4, 3), (True, 2, 2), (False, 4, 1)])
def test_the_grammar_caps_the_calls_of_a_reply(bytes_engine, parallel, cap, made):
    three = "\n".join([CALL_A, CALL_B, HERMES.call_text("open_window", '{"window": "front-left"}')])
    state = bytes_engine.vocabulary.start(tool_call_grammar(HERMES, TOOLS, "required", parallel, max_calls=cap))
    taken = []
    for token in bytes_engine.tokenizer.encode(three):
        try:
            state.push(token)
        except GrammarError:
            break
        taken.append(token)
    assert len(HERMES.parse(bytes_engine.tokenizer.decode(taken))) == made


def test_a_call_repeated_in_one_reply_ends_it_before_the_repeat(bytes_engine):
    grammar = bytes_engine.vocabulary.start(tool_call_grammar(HERMES, TOOLS, "required"), HERMES)
    reply = ReplyStream(_params(bytes_engine, 1000), bytes_engine.tokenizer.decode_reply, grammar=grammar)
    for token in bytes_engine.tokenizer.encode("\n".join([CALL_A, CALL_B, CALL_A, CALL_B])):
        reply.push(token)
        if reply.finish_reason:
            break
    reply.close()
    assert reply.finish_reason == "stop" and reply.text == f"{CALL_A}\n{CALL_B}"
    assert len(reply.ids) == len(bytes_engine.tokenizer.encode("\n".join([CALL_A, CALL_B, CALL_A])))


def test_json_answers_close_within_every_token_limit(bytes_engine):
    asked, schemas = [], []
    for schema in SHORT_SCHEMAS:
        grammar = json_schema_grammar(schema)
        shortest = len(bytes_engine.vocabulary.start(grammar).ending(64))
        assert shortest <= 12
        limits = [limit for limit in LIMITS if limit >= shortest]
        asked += [(grammar, limit, seed) for seed, limit in enumerate(limits)]
        schemas += [schema] * len(limits)
    for (_, limit, _), request, schema in zip(asked, _run(bytes_engine, asked), schemas):
        assert request.finish_reason in ("stop", "length") and len(request.token_ids) <= limit
        jsonschema.validate(json.loads(request.text), schema)


def test_calls_close_within_their_token_limit_and_keep_to_the_cap(bytes_engine):
    grammar = tool_call_grammar(HERMES, TOOLS, "required", max_calls=2)
    shortest = bytes_engine.vocabulary.start(grammar).ending(200)
    asked = [(grammar, len(shortest) + extra, seed) for seed, extra in enumerate((0, 3, 11, 40, 90, 160))]
    for request in _run(bytes_engine, asked, HERMES):
        calls = HERMES.parse(request.text)
        assert request.finish_reason in ("stop", "length") and 1 <= len(calls) <= 2
        assert request.text == "\n".join(HERMES.call_text(name, arguments) for name, arguments in calls)
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), next(t for t in TOOLS if t.name == name).parameters)


def test_a_limit_below_the_shortest_answer_is_refused_up_front(bytes_engine):
    shortest = len(bytes_engine.vocabulary.start(json_schema_grammar(WINDOW)).ending(200))
    core = bytes_engine.new_core(bytes_engine.new_cache())
    prompt = bytes_engine.tokenizer.encode_prompt("open it")
    grammar = bytes_engine.vocabulary.start(json_schema_grammar(WINDOW))
    with pytest.raises(GrammarError, match=f"takes {shortest} tokens, more than the {shortest - 1}") as err:
        core.add_request(Request(prompt, _params(bytes_engine, shortest - 1), grammar=grammar))
    assert [(hint.fix, hint.detail) for hint in err.value.hints] == [(Fix.RAISE_MAX_NEW_TOKENS, str(shortest))]
    assert not core.scheduler.waiting
    request = Request(prompt, _params(bytes_engine, shortest), grammar=grammar)
    core.generate(request)
    jsonschema.validate(json.loads(request.text), WINDOW)


def test_a_session_reply_cut_by_its_limit_keeps_its_call_and_streams_no_markup(bytes_engine):
    grammar = tool_call_grammar(HERMES, TOOLS, "required", parallel=False)
    shortest = len(bytes_engine.vocabulary.start(grammar).ending(200))
    for extra in (0, 2, 30):
        session = DialogueSession(bytes_engine, bytes_engine.new_cache(), _params(bytes_engine, shortest + extra),
                                  tools=TOOLS, tool_choice="required")
        shown: list[str] = []
        turn = session.chat("open the window", on_text=shown.append)
        assert turn.finish_reason in (("length",) if extra == 0 else ("tool_calls", "length"))  # 0: cut after it
        assert len(turn.tool_calls) == 1
        assert turn.reply == "" and shown == [] and session.messages[-1]["content"] == ""
    session.params = _params(bytes_engine, shortest - 1)
    turn = session.chat("and the other one")
    assert turn.finish_reason == "error" and f"takes {shortest} tokens" in turn.error
    assert turn.error_words({Fix.RAISE_MAX_NEW_TOKENS: "raise it to {}"}).endswith(f"raise it to {shortest}")


def test_cabin_chat_json_shows_calls_not_markup_and_refuses_a_limit_too_small(bytes_engine, bytes_engine_dir, tmp_path,
                                                                              capsys):
    shortest = len(bytes_engine.vocabulary.start(tool_call_grammar(HERMES, TOOLS, "required", False)).ending(200))
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([tool.to_openai() for tool in TOOLS]))
    script = tmp_path / "d.jsonl"
    script.write_text(json.dumps({"role": "user", "content": "Open the window."}))
    argv = ["--engine", str(bytes_engine_dir), "--script", str(script), "--json", "--tools", str(tools),
            "--tool-choice", "required"]
    assert main(argv + ["--max-new-tokens", str(shortest)]) == 0  # the call, cut by the limit right after it
    turn = json.loads(capsys.readouterr().out)
    assert turn["finish_reason"] == "length" and turn["reply"] == "" and len(turn["tool_calls"]) == 1
    assert "<tool_call>" not in json.dumps(turn)
    assert main(argv + ["--max-new-tokens", "8"]) == 0
    turn = json.loads(capsys.readouterr().out)
    assert turn["finish_reason"] == "error" and "raise --max-new-tokens to " in turn["error"]
