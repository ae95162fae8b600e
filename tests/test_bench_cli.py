"""cabin-bench end to end on a tiny model: results JSON, RESULTS.md, figures, unavailable peers (no timing asserted)."""
from __future__ import annotations

import json

import pytest

from cabinllm.benchmarks.cli import main
from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.builders.onnx_export import OnnxExportRequest, export_onnx

from conftest import QUICK_CALIBRATION
from fakes.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """An int8 engine of the tiny random model (not imported from a GGUF, so llama.cpp cannot run it)."""
    root = tmp_path_factory.mktemp("bench")
    return build_engine(BuildRequest(str(write_tiny_llama(root / "model")), root / "engine", "int8",
                                     dtype="float32"), log=lambda _msg: None)


@pytest.mark.slow  # a whole cabin-bench run
def test_one_run_writes_results_markdown_and_figures(tiny_engine, tmp_path, capsys, keep_threads):
    out = tmp_path / "out"
    code = main(["--engine", str(tiny_engine), "--contexts", "16", "32", "--repeats", "2", "--decode-steps", "3",
                 "--turns", "3", "--modes", "fp16", "int8", "--threads", "1", "--out", str(out),
                 "--json", str(tmp_path / "r.json")])
    assert code == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert results == json.loads((out / "cabin_bench.json").read_text())
    assert {"cpu", "cores", "versions"} <= set(results["machine"]) and results["machine"]["torch_threads"] == 1
    assert results["model"].startswith("model (") and str(tmp_path.parent) not in results["model"]  # no machine path
    status = {r["name"]: r["status"] for r in results["runners"]}
    assert status["cabin int8"] == status["transformers dynamic"] == "ok"
    assert status["llama.cpp q8_0"] == "unavailable"
    rows = {(r["runner"], r["context"]): r for r in results["speed"]["rows"]}
    assert {c for (_, c) in rows} == {16, 32} and len(rows[("cabin int8", 32)]["decode_tok_s_samples"]) == 2
    assert results["speed"]["warm_up_runs"] == 1
    ratio = next(r for r in results["speed"]["ratios"] if (r["ours"], r["peer"], r["metric"], r["context"])
                 == ("cabin int8", "transformers dynamic", "decode_tok_s", 32))
    ours = rows[("cabin int8", 32)]["decode_tok_s_samples"]
    peer = rows[("transformers dynamic", 32)]["decode_tok_s_samples"]
    assert ratio["pairs"] == 2
    assert ratio["ratio"] == pytest.approx((ours[0] / peer[0] + ours[1] / peer[1]) / 2)  # median of two pairs
    kv = {r["runner"]: r for r in results["kv_memory"]}
    assert kv["cabin int8"]["bytes_per_token"] * 2 == kv["cabin fp16"]["bytes_per_token"]
    assert kv["transformers dynamic"]["vs_cabin_fp16"] == pytest.approx(2.0)
    turns = results["multiturn"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert set(turns[2]["ttft_s"]) == {"cabin int8 (reuse)", "transformers dynamic"}
    assert turns[2]["context_tokens"] > turns[1]["context_tokens"] > turns[2]["new_tokens"]
    assert len(results["claims"]) >= 3
    limit = results["memory_limit"]
    assert limit["against"] == "1" and limit["read_bandwidth_bytes_s"]["1"] > 1e8
    read = {(r["runner"], r["context"]): r for r in limit["rows"]}
    assert set(read) == {(f"cabin {m}", c) for m in ("fp16", "int8") for c in (16, 32)}
    kv_step = kv["cabin int8"]["bytes_per_token"] * 16  # the KV of 16 more tokens of context
    assert read["cabin int8", 32]["bytes_per_token"] - read["cabin int8", 16]["bytes_per_token"] == kv_step
    assert read["cabin int8", 32]["fraction"] == pytest.approx(read["cabin int8", 32]["bytes_per_token"]
                                                               * rows[("cabin int8", 32)]["decode_tok_s"]
                                                               / limit["read_bandwidth_bytes_s"]["1"])
    text = (out / "RESULTS.md").read_text()
    for part in ("## Results", "## Claims", "## Decode tokens/s, ours / peer", "## KV memory",
                 "## Decode against the memory limit",
                 "## Peers unavailable or failed", "llama.cpp q8_0: unavailable: the engine was not imported from"):
        assert part in text
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["cabin_bench_kv.png", "cabin_bench_speed.png",
                                                                    "cabin_bench_ttft.png"]
    assert "## Results" in capsys.readouterr().out
    assert main(["--render", str(out / "cabin_bench.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "RESULTS.md").read_text() == text
    assert len(list((tmp_path / "again" / "figures").iterdir())) == 3


def test_unknown_peer_family_and_bad_eval_json_are_clear_errors(tiny_engine, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")]
    assert main(["--engine", str(tiny_engine), "--peers", "vllm", *out]) == 2
    assert "unknown --peers" in capsys.readouterr().err
    bad = tmp_path / "eval.json"
    for text in ("{}", '{"modes": {"int8": {"kl": 0.1}}}', "not json"):
        bad.write_text(text)
        assert main(["--engine", str(tiny_engine), "--eval-json", str(bad), *out]) == 2
        assert "pass the eval.json cabin-eval wrote" in capsys.readouterr().err
    assert main(["--render", str(bad), *out]) == 2
    assert "not a cabin-bench results JSON" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a whole cabin-bench run
def test_weights_engines_add_runners_on_their_weights(tiny_engine, tmp_path, capsys, keep_threads):
    """An engine of the same model with W8A16 weights adds 'cabin int8 + W8A16'; another model is refused."""
    root = tmp_path / "w8"
    w8 = build_engine(BuildRequest(str(write_tiny_llama(root / "model")), root / "engine", "int8", weights="int8"),
                      log=lambda _msg: None)
    out = ["--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json")]
    assert main(["--engine", str(tiny_engine), "--weights-engines", str(w8), "--contexts", "16", "--repeats", "1",
                 "--decode-steps", "3", "--turns", "0", "--modes", "int8", "--peers", "none", "--threads", "1",
                 *out]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    runners = {r["name"]: r for r in results["runners"]}
    assert runners["cabin int8 + W8A16"]["status"] == "ok" and "W8A16" in runners["cabin int8 + W8A16"]["weights"]
    assert {r["runner"] for r in results["speed"]["rows"]} == {"cabin int8", "cabin int8 + W8A16"}
    other = tmp_path / "other"
    wide = build_engine(BuildRequest(str(write_tiny_llama(other / "model", hidden_size=128)), other / "engine",
                                     "int8", dtype="float32"), log=lambda _msg: None)
    assert main(["--engine", str(tiny_engine), "--weights-engines", str(wide), *out]) == 2
    assert "holds another model" in capsys.readouterr().err


@pytest.mark.slow  # a whole cabin-bench run
def test_onnx_graphs_add_our_onnxruntime_backend_and_a_missing_genai_folder_is_reported(
        tiny_engine, tmp_path, keep_threads):
    """--onnx adds 'cabin onnxruntime int8' (contexts beyond the graphs' window fail, reported); --genai without
    the builder's folder is an unavailable peer that says what to pass."""
    graphs = tmp_path / "graphs"
    export_onnx(OnnxExportRequest(tiny_engine, graphs, 32, 8, "int8", "npu", calibration=QUICK_CALIBRATION),
                log=lambda _m: None)
    out = ["--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json")]
    assert main(["--engine", str(tiny_engine), "--onnx", str(graphs), "--genai", str(tmp_path / "none"),
                 "--contexts", "16", "48", "--repeats", "1", "--decode-steps", "3", "--turns", "0", "--modes", "int8",
                 "--peers", "none", "--threads", "1", *out]) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    runners = {r["name"]: r for r in results["runners"]}
    assert runners["cabin onnxruntime int8"]["status"] == "failed"  # 48 tokens do not fit a window of 32
    assert "no genai_config.json" in runners["onnxruntime-genai"]["reason"]
    rows = {(r["runner"], r["context"]): r for r in results["speed"]["rows"]}
    assert rows[("cabin onnxruntime int8", 16)]["decode_tok_s_samples"]
    kv = {r["runner"]: r for r in results["kv_memory"]}
    assert kv["cabin onnxruntime int8"]["bytes_per_token"] == kv["cabin int8"]["bytes_per_token"]
