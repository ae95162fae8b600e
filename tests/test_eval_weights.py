"""cabin-eval --weights: quantized weight formats measured against fp32 weights, alone and with a KV mode."""
from __future__ import annotations

import json

from cabinllm.cli import eval as cli_eval


def test_weights_axis_measures_each_format_alone_and_with_int8_kv(tiny_engine_dir, tmp_path, capsys):
    code = cli_eval.main(["--model", str(tiny_engine_dir), "--data", "builtin", "--kv-cache", "int8-shared",
                          "--weights", "fp32,int8,int4-awq,int4-rtn", "--num-dialogues", "1", "--max-tokens", "48",
                          "--output", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "eval.json").read_text())["modes"]
    names = ["fp32", "int8-shared"] + [f"{w}/{kv}" for w in ("int8", "int4-awq", "int4-rtn")
                                       for kv in ("fp32", "int8-shared")]
    assert list(rows) == names
    size = {w: rows[f"{w}/fp32"]["weight_bytes"] for w in ("int8", "int4-awq", "int4-rtn")}
    assert size["int4-rtn"] < size["int8"] < rows["fp32"]["weight_bytes"]
    assert size["int4-awq"] > size["int4-rtn"]  # ModelOpt's AWQ export pads the 22-token vocabulary to 64
    assert rows["int8-shared"]["weights"] == "fp32" and rows["int4-awq/int8-shared"]["weights"] == "int4-awq"
    for name in names[2:]:
        assert rows[name]["kl"] > 0 and 0 < rows[name]["top1_agree"] <= 1
    assert rows["int4-rtn/fp32"]["kl"] > rows["int8/fp32"]["kl"]  # 4 bits lose more than 8
    table = capsys.readouterr().out
    assert table.splitlines()[1].startswith("weights ") and "int4-awq" in table  # ModelOpt's prints go to stderr


def test_weights_axis_refuses_unknown_formats(tiny_engine_dir, tmp_path, capsys):
    assert cli_eval.main(["--model", str(tiny_engine_dir), "--weights", "int3", "--output", str(tmp_path)]) == 2
    assert "unknown --weights ['int3']" in capsys.readouterr().err
