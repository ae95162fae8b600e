"""How sure the model was of each call: the probability of a call's function name from the reply's token
log-probabilities (``ToolFormat.name_probabilities``), on ``TurnStats.call_confidence``, and cabin-chat's
``--confirm-below``, which asks the user before a call below it is carried out. The tiny random model with a
tokenizer of every byte proves the mechanics (its probabilities mean nothing)."""
from __future__ import annotations

import builtins
import json
import math

import pytest

from cabinllm.benchmarks.studies.call_confidence import trade_off
from cabinllm.cli.chat import DECLINED, main
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.errors import GrammarError, ScriptError
from cabinllm.runtime.formats.chat_script import read_script
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.model.tools import HERMES, LLAMA3_JSON, Tool

TOOLS = [Tool("set_sunroof", "", {"type": "object", "properties": {"action": {"enum": ["open", "close"]}},
                                  "required": ["action"], "additionalProperties": False}),
         Tool("set_seat", "", {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                               "additionalProperties": False})]


def test_a_name_s_probability_is_the_product_over_the_tokens_of_its_json_string():
    pieces = [b'<tool_call>\n{"name": ', b'"set', b"_sun", b'roof",', b' "arguments": {"action": "open"}}',
              b"\n</tool_call>\n", b'<tool_call>\n{"name": "', b"set_seat", b'"',
              b', "arguments": {"on": true}}\n</tool_call>', b""]
    logprobs = [0.0, math.log(0.5), math.log(0.8), math.log(0.9), -3.0, -1.0, -2.0, math.log(0.25), math.log(0.5),
                -4.0, -5.0]
    assert HERMES.name_probabilities(pieces, logprobs, ["set_sunroof", "set_seat"]) == pytest.approx(
        [0.5 * 0.8 * 0.9, math.exp(-2.0) * 0.25 * 0.5])
    llama = [b'{"name": "', b"set_seat", b'", "parameters": {"on": false}}']
    assert LLAMA3_JSON.name_probabilities(llama, [-1.0, -0.5, -0.1], ["set_seat"]) == pytest.approx(
        [math.exp(-1.6)])
    with pytest.raises(GrammarError, match="write no call of set_window"):
        HERMES.name_probabilities(pieces, logprobs, ["set_window"])


def _session(engine, choice: str) -> DialogueSession:
    params = SamplingParams(max_new_tokens=200, seed=0, stop_token_ids=engine.stop_token_ids())
    return DialogueSession(engine, engine.new_cache(), params, "you drive", tools=TOOLS, tool_choice=choice)


def test_a_session_s_calls_carry_the_probability_of_their_names(bytes_engine):
    picked = _session(bytes_engine, "required").chat("open the sunroof")
    assert picked.finish_reason == "tool_calls" and len(picked.call_confidence) == len(picked.tool_calls) == 1
    assert 0 < picked.call_confidence[0] < 1  # two functions to pick from
    named = _session(bytes_engine, "set_seat").chat("open the sunroof")
    assert named.call_confidence == [1.0]  # the grammar allowed one name: every token of it was certain
    words = _session(bytes_engine, "none").chat("open the sunroof")
    assert words.tool_calls == [] and words.call_confidence == []
    assert "call_confidence" in words.to_dict()


def _tools_file(tmp_path) -> str:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([tool.to_openai() for tool in TOOLS]))
    return str(path)


def _script(tmp_path, lines: list[dict]) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return str(path)


def test_a_script_confirms_a_call_by_a_confirm_line_and_declines_it_without_one(bytes_engine_dir, tmp_path, capsys):
    ask = {"role": "user", "content": "Open the sunroof."}
    script = _script(tmp_path, [ask, {"role": "user", "confirm": True}, {"role": "tool", "content": '{"ok": true}'},
                                ask, ask])
    flags = ["--engine", str(bytes_engine_dir), "--script", script, "--json", "--tools", _tools_file(tmp_path),
             "--tool-choice", "required", "--max-new-tokens", "120", "--confirm-below", "1"]
    assert main(flags) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    first, result, second, declined, third, _ = turns
    (asked,) = first["confirmations"]
    assert asked == {"id": first["tool_calls"][0]["id"], "name": first["tool_calls"][0]["function"]["name"],
                     "probability": first["call_confidence"][0], "confirmed": True}
    assert result["confirmations"] == [] and result["tool_calls"] == []  # the result of the confirmed call
    assert second["confirmations"][0]["confirmed"] is False  # the next line was no confirm line: declined
    assert declined["tool_calls"] == [] and third["tool_calls"]  # the decline was answered, then the script went on
    assert main(flags[:-2]) == 0  # without --confirm-below nothing is asked: a confirm line is one error line
    out, err = capsys.readouterr()
    assert all("confirmations" not in json.loads(line) for line in out.splitlines())
    assert "message 2 of the script: a confirm line answers a call that asked for confirmation" in err


def test_a_declined_call_is_answered_with_a_result_saying_so(bytes_engine_dir, tmp_path, capsys):
    script = _script(tmp_path, [{"role": "user", "content": "Open the sunroof."}, {"role": "user", "confirm": False}])
    assert main(["--engine", str(bytes_engine_dir), "--script", script, "--tools", _tools_file(tmp_path),
                 "--tool-choice", "required", "--max-new-tokens", "120", "--confirm-below", "0.999"]) == 0
    out = capsys.readouterr().out
    assert "below 100%: no, declined" in out and "confirm set_" in out and f"tool> {DECLINED}" in out


def test_interactive_chat_asks_before_a_call_below_the_threshold(bytes_engine_dir, tmp_path, monkeypatch, capsys):
    typed = iter(["Open the sunroof.", "n", "Open the sunroof.", "y", "/quit"])
    prompts = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": prompts.append(prompt) or next(typed))
    assert main(["--engine", str(bytes_engine_dir), "--tools", _tools_file(tmp_path), "--tool-choice", "required",
                 "--max-new-tokens", "120", "--confirm-below", "1"]) == 0
    out = capsys.readouterr().out
    questions = [p for p in prompts if p.strip().startswith("confirm ")]
    assert len(questions) == 2 and all(q.endswith("[y/N] ") for q in questions)
    assert out.count("(declined: not carried out)") == 1


def test_confirm_lines_and_the_flag_are_checked(bytes_engine_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": "hi"}\n{"role": "user", "confirm": "yes"}\n')
    with pytest.raises(ScriptError, match="bad.jsonl:2: a confirm line is"):
        read_script(bad)
    assert main(["--engine", str(bytes_engine_dir), "--confirm-below", "0.5"]) == 2
    assert "--confirm-below needs --tools" in capsys.readouterr().err


def test_the_study_counts_questions_and_wrong_calls_that_run_at_each_threshold():
    calls = [{"meant": "a", "called": "a", "probability": 0.9}, {"meant": "a", "called": "b", "probability": 0.6},
             {"meant": "b", "called": "a", "probability": 0.2}, {"meant": "b", "called": "b", "probability": 0.4}]
    assert trade_off(calls, 0.0) == {"asked": 0, "wrong_run": 2, "wrong_caught": 0, "right_asked": 0}
    assert trade_off(calls, 0.5) == {"asked": 2, "wrong_run": 1, "wrong_caught": 1, "right_asked": 1}
    assert trade_off(calls, 1.0) == {"asked": 4, "wrong_run": 0, "wrong_caught": 2, "right_asked": 2}
