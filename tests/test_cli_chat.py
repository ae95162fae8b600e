"""cabin-chat from a script: one JSON object per turn; bad input is a clear error; /save answers on every backend."""
import builtins
import json
import shutil
import sys
import types

from cabinllm.builders.engine_build import DEFAULT_SYSTEM_PROMPT, BuildRequest, build_engine
from cabinllm.cli.chat import main
from cabinllm.runtime.dialogue.session_file import read_session_file
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR, MANIFEST_FILE, TRT_ENGINE_DIR, EngineFolder

from fakes.tiny_model import write_tiny_llama

FIELDS = {"turn", "reply", "token_ids", "prefill_tokens", "reused_tokens", "ttft_s", "decode_tok_s",
          "kv_bytes_used", "kv_bytes_budget", "finish_reason"}


def write_script(path, lines):
    path.write_text("\n".join(json.dumps(line, ensure_ascii=False) for line in lines), encoding="utf-8")
    return path


def test_script_json_prints_one_object_per_turn(engine_dir, tmp_path, capsys):
    script = write_script(tmp_path / "d.jsonl", [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Open the sunroof."},
                                                 {"role": "user", "content": "请把音量调低一点。"}])
    code = main(["--engine", str(engine_dir), "--script", str(script), "--json",
                 "--max-new-tokens", "6", "--kv-budget-mb", "8"])
    assert code == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    assert all(FIELDS <= t.keys() for t in turns)
    assert turns[1]["reused_tokens"] > turns[0]["reused_tokens"]
    assert turns[0]["kv_bytes_budget"] <= 8 << 20 and 0 < turns[1]["kv_bytes_used"] <= turns[0]["kv_bytes_budget"]
    config = EngineFolder(engine_dir).config()  # INT8 KV: one byte for each K and V element (11,520 B on the default)
    int8_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_size
    assert turns[0]["kv_mode"] == "int8" and turns[0]["kv_bytes_per_token"] == int8_bytes


def test_invalid_utf8_script_is_a_clear_error(tiny_engine_dir, tmp_path, capsys):
    script = tmp_path / "bad.jsonl"
    script.write_bytes(b'{"role": "user", "content": "caf\xe9"}\n')
    assert main(["--engine", str(tiny_engine_dir), "--script", str(script)]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_missing_engine_is_a_clear_error(tmp_path, capsys):
    assert main(["--engine", str(tmp_path / "nope")]) == 2
    assert "build an engine first" in capsys.readouterr().err


def chat_interactively(monkeypatch, argv, lines):
    """Run cabin-chat with ``lines`` typed at its prompt; returns the exit code."""
    typed = iter(lines)
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(typed))
    return main(argv)


class FakeRunner:
    """Stands in for tensorrt_llm's ModelRunnerCpp: records from_dir's arguments; has the engine's limits."""

    created: list[dict] = []
    max_input_len, max_seq_len = 1024, 2048

    @classmethod
    def from_dir(cls, engine_dir, **kwargs):
        cls.created.append({"engine_dir": engine_dir, **kwargs})
        return cls()

    def generate(self, batch_input_ids, *, input_token_extra_ids=None, **kwargs):
        raise AssertionError("these tests run no turn")


def test_save_on_the_tensorrt_llm_backend_is_a_clear_message(engine_dir, tmp_path, monkeypatch, capsys):
    module, runtime = types.ModuleType("tensorrt_llm"), types.ModuleType("tensorrt_llm.runtime")
    runtime.ModelRunnerCpp = FakeRunner
    module.runtime = runtime
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime", runtime)
    FakeRunner.created = []
    folder = tmp_path / "engine"  # the engine plus a (fake) TensorRT engine
    (folder / TRT_ENGINE_DIR).mkdir(parents=True)
    (folder / CHECKPOINT_DIR).symlink_to(engine_dir / CHECKPOINT_DIR)
    shutil.copy(engine_dir / MANIFEST_FILE, folder / MANIFEST_FILE)
    code = chat_interactively(monkeypatch, ["--engine", str(folder), "--backend", "tensorrt-llm"],
                              [f"/save {tmp_path / 's.cabin'}", "/stats", "/quit"])
    out = capsys.readouterr().out
    assert code == 0 and len(FakeRunner.created) == 1
    assert "could not save: saving is available on the reference backend only (--backend reference)" in out
    assert "Traceback" not in out and not (tmp_path / "s.cabin").exists()
    assert "TensorRT-LLM KV settings" in out


def test_save_on_the_reference_backend_reports_the_tokens_saved(engine_dir, tmp_path, monkeypatch, capsys):
    path = tmp_path / "s.cabin"
    code = chat_interactively(monkeypatch, ["--engine", str(engine_dir), "--backend", "reference",
                                            "--system", "Be brief.", "--max-new-tokens", "4", "--kv-budget-mb", "8"],
                              ["Open the sunroof.", f"/save {path}", "/quit"])
    out = capsys.readouterr().out
    header, _ = read_session_file(path)
    assert code == 0 and header["kv_cache"]["kv_mode"] == "int8" and header["kv_cache"]["max_bytes"] == 8 << 20
    assert f"saved 3 messages and {len(header['fed'])} tokens of KV to {path}" in out and header["fed"]


def test_the_engine_s_system_prompt_is_the_default_and_can_be_replaced(tiny_engine_dir, monkeypatch, capsys):
    assert DEFAULT_SYSTEM_PROMPT.startswith("You are the in-car assistant")
    assert json.loads((tiny_engine_dir / MANIFEST_FILE).read_text())["system_prompt"] == DEFAULT_SYSTEM_PROMPT
    argv = ["--engine", str(tiny_engine_dir), "--max-new-tokens", "2"]
    for extra, shown in (([], DEFAULT_SYSTEM_PROMPT), (["--system", "Be brief."], "Be brief."),
                         (["--system", ""], "(none)")):
        assert chat_interactively(monkeypatch, argv + extra, ["/quit"]) == 0
        assert f"system prompt: {shown}\n" in capsys.readouterr().out


def test_build_records_another_system_prompt_or_none(tmp_path):
    model = write_tiny_llama(tmp_path / "model")
    for prompt, recorded in (("Answer in German.", "Answer in German."), ("", None)):
        folder = build_engine(BuildRequest(str(model), tmp_path / "e", kv_cache="fp16", dtype="float32",
                                           force=True, system_prompt=prompt), log=lambda _msg: None)
        assert EngineFolder(folder).system_prompt() == recorded


def test_restore_says_what_it_restored(tiny_engine_dir, tmp_path, monkeypatch, capsys):
    path = tmp_path / "s.cabin"
    argv = ["--engine", str(tiny_engine_dir), "--max-new-tokens", "3", "--kv-budget-mb", "8"]
    assert chat_interactively(monkeypatch, argv, ["Open the sunroof.", f"/save {path}", "/quit"]) == 0
    header, _ = read_session_file(path)
    capsys.readouterr()
    assert chat_interactively(monkeypatch, argv + ["--restore", str(path)], ["/quit"]) == 0
    assert (f"restored {path}: 1 turns (3 messages), {len(header['fed'])} tokens of KV, no re-prefill"
            in capsys.readouterr().err)


def test_tools_script_prints_each_call_and_feeds_the_result_back(bytes_engine_dir, tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "set_sunroof", "parameters": {
        "type": "object", "properties": {"action": {"enum": ["open", "close"]}}, "required": ["action"],
        "additionalProperties": False}}}]))
    script = write_script(tmp_path / "d.jsonl", [{"role": "user", "content": "Open the sunroof."},
                                                 {"role": "tool", "content": '{"ok": true}'}])
    code = main(["--engine", str(bytes_engine_dir), "--script", str(script), "--json", "--tools", str(tools),
                 "--tool-choice", "set_sunroof", "--max-new-tokens", "200"])
    assert code == 0
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert first["finish_reason"] == "tool_calls"
    (call,) = first["tool_calls"]
    assert call["function"]["name"] == "set_sunroof"
    assert json.loads(call["function"]["arguments"])["action"] in ("open", "close")
    assert second["reused_tokens"] > first["prefill_tokens"]  # the result was appended to the cached call
    assert second["tool_calls"] == [] and second["finish_reason"] in ("stop", "length")  # the result is answered in words


def test_a_bad_tools_file_or_choice_is_one_clear_line(bytes_engine_dir, tmp_path, capsys):
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "nameless.json").write_text('[{"type": "function", "function": {"description": "x"}}]')
    cases = [(["--tools", str(tmp_path / "missing.json")], "cannot read"),
             (["--tools", str(tmp_path / "empty.json")], "non-empty list of tool definitions"),
             (["--tools", str(tmp_path / "nameless.json")], "[0].function.name must be"),
             (["--tools", "builtin", "--tool-choice", "self_destruct"], "choose auto, required, none or one of"),
             (["--tool-choice", "required"], "--tool-choice needs --tools")]
    for flags, problem in cases:
        assert main(["--engine", str(bytes_engine_dir), *flags]) == 2
        err = capsys.readouterr().err
        assert problem in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_choices_and_beams_print_the_alternatives(tiny_engine_dir, tmp_path, capsys):
    script = tmp_path / "s.jsonl"
    script.write_text('{"role": "user", "content": "play some jazz"}\n{"role": "user", "content": "louder"}\n')
    assert main(["--engine", str(tiny_engine_dir), "--script", str(script), "--beam-width", "3",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert out.count("alternative 2> ") == 2 and out.count("alternative 3> ") == 2
    assert main(["--engine", str(tiny_engine_dir), "--script", str(script), "--choices", "2", "--json",
                 "--temperature", "1", "--seed", "5", "--max-new-tokens", "6"]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(turn["alternatives"]) for turn in turns] == [1, 1]
    assert main(["--engine", str(tiny_engine_dir), "--script", str(script), "--choices", "2", "--beam-width",
                 "2"]) == 2
    assert "give one of them" in capsys.readouterr().err
