"""cabin-chat from a script: one JSON object per turn; bad input is a clear error."""
import json

from runtime.cli_chat import main

FIELDS = {"turn", "reply", "token_ids", "prefill_tokens", "reused_tokens", "ttft_s", "decode_tok_s",
          "kv_bytes_used", "kv_bytes_budget", "finish_reason"}


def write_script(path, lines):
    path.write_text("\n".join(json.dumps(line, ensure_ascii=False) for line in lines), encoding="utf-8")
    return path


def test_script_json_prints_one_object_per_turn(default_engine_dir, tmp_path, capsys):
    script = write_script(tmp_path / "d.jsonl", [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Open the sunroof."},
                                                 {"role": "user", "content": "请把音量调低一点。"}])
    code = main(["--engine", str(default_engine_dir), "--script", str(script), "--json",
                 "--max-new-tokens", "6", "--kv-budget-mb", "8"])
    assert code == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    assert all(FIELDS <= t.keys() for t in turns)
    assert turns[1]["reused_tokens"] > turns[0]["reused_tokens"]
    assert turns[0]["kv_bytes_budget"] <= 8 << 20 and 0 < turns[1]["kv_bytes_used"] <= turns[0]["kv_bytes_budget"]
    assert turns[0]["kv_mode"] == "int8" and turns[0]["kv_bytes_per_token"] == 11520


def test_invalid_utf8_script_is_a_clear_error(default_engine_dir, tmp_path, capsys):
    script = tmp_path / "bad.jsonl"
    script.write_bytes(b'{"role": "user", "content": "caf\xe9"}\n')
    assert main(["--engine", str(default_engine_dir), "--script", str(script)]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_missing_engine_is_a_clear_error(tmp_path, capsys):
    assert main(["--engine", str(tmp_path / "nope")]) == 2
    assert "build an engine first" in capsys.readouterr().err
