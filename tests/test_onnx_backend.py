"""The NPU path: cabin-export's static ONNX graphs and the ONNX Runtime backend on the tiny engine.

The backend answers a scripted dialogue token for token as the reference engine does, reuses earlier turns,
keeps the budget under every overflow policy; over the INT8 codes the reference engine stored it predicts as
the reference does, within float rounding; the npu profile's graphs are strict, static and on the allow-list;
bad input is one clear error."""
import json
import sys
import random
import shutil

import onnx
import pytest
import torch

from cabinllm.benchmarks.studies.onnx_compare import RUNS, perplexities
from cabinllm.builders.onnx_export import OnnxExportRequest, export_onnx
from cabinllm.cli.chat import main as chat_main
from cabinllm.cli.export import main as export_main
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE, SCALES_FILE
from cabinllm.runtime.formats.onnx_folder import PROMPT_GRAPH, TOKEN_GRAPH
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import sized_config
from cabinllm.runtime.model.tools import Tool

from conftest import QUICK_CALIBRATION

CONTEXT, CHUNK = 256, 16
SYSTEM = "You are the in-car assistant."
SCRIPT = ["navigate to the nearest charging station", "Turn the music down.", "Is the trunk closed?"]


@pytest.fixture(scope="module")
def exports(tiny_engine_dir, tmp_path_factory):
    """Float graph folders of the tiny engine: fp32 and fp16 KV, int8 KV (npu profile: uint8 codes, the host's
    embedding and RoPE rows; ort: int8)."""
    root = tmp_path_factory.mktemp("onnx")
    folders = {}
    for name, kv, profile in (("fp32", "fp32", "ort"), ("fp16", "fp16", "npu"), ("int8", "int8", "npu"),
                              ("int8-ort", "int8", "ort")):
        folders[name] = root / f"tiny-{name}"
        export_onnx(OnnxExportRequest(tiny_engine_dir, folders[name], CONTEXT, CHUNK, kv, profile, "fp16"),
                    log=lambda _m: None)
    return folders


def session(engine, kv, policy="error", tokens=1024, max_new_tokens=12):
    config = sized_config(engine.model.kv_layout, kv, tokens, tokens_per_block=16)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids())
    return DialogueSession(engine, engine.new_cache(config), params, SYSTEM, OverflowPolicy(policy))


@pytest.mark.parametrize("export", ["fp32", "fp16", "int8", "int8-ort"])
def test_greedy_replies_equal_the_reference_and_later_turns_prefill_only_new_tokens(tiny_engine, exports, export):
    onnx_engine, kv = load_onnx_engine(exports[export], threads=1), export.split("-")[0]
    fed = []
    forward = onnx_engine.model.forward
    onnx_engine.model.forward = lambda ids, *a, **k: fed.append(len(ids)) or forward(ids, *a, **k)
    ours, reference = session(onnx_engine, kv), session(tiny_engine, kv)
    for turn, text in enumerate(SCRIPT):
        held, fed[:] = len(ours.fed), []
        onnx_engine.model.window_cache = None  # the turn's first step refills the graphs' window from the blocks
        got, want = ours.chat(text), reference.chat(text)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert (got.prefill_tokens, got.reused_tokens) == (want.prefill_tokens, want.reused_tokens)
        assert sum(fed) == got.prefill_tokens + len(got.token_ids) - 1  # only new tokens went through the graphs
        if turn:
            assert got.reused_tokens == held and got.prefill_tokens < held
    assert ours.cache.stats().bytes_used == reference.cache.stats().bytes_used


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    targets = torch.tensor(ids[1:])
    return float(logits[:-1].log_softmax(-1).gather(1, targets[:, None]).mean().neg().exp())


@pytest.mark.parametrize("export", ["int8", "int8-ort"])
def test_over_the_reference_int8_cache_the_graphs_predict_as_the_reference(tiny_engine, exports, export):
    """Teacher-forced over the K/V the reference engine stored, each token's logits through the token graph are the
    reference's within float rounding (but where an element of the token's own K/V lies on a rounding edge): the
    graphs quantize, clip, scale and attend as the reference does, the new tokens' own K/V included."""
    rng = random.Random(0)
    ids = [rng.randrange(tiny_engine.config.vocab_size) for _ in range(CONTEXT - 6)]
    prefilled = run_tokens(tiny_engine.model, ids, "int8", tiny_engine.scales, all_logits=True)
    stored = prefilled.cache.storage.k_data.clone(), prefilled.cache.storage.v_data.clone()
    logits = load_onnx_engine(exports[export], threads=1).model.logits_over(prefilled.cache, prefilled.seq)
    gap = (logits - prefilled.logits).abs().amax(-1)
    assert float(gap.quantile(0.99)) < 1e-3 and float(gap.median()) < 1e-4
    assert perplexity(logits, ids) == pytest.approx(perplexity(prefilled.logits, ids), rel=5e-4)
    assert torch.equal(prefilled.cache.storage.k_data, stored[0]) and torch.equal(prefilled.cache.storage.v_data,
                                                                                  stored[1])


@pytest.mark.parametrize("export", ["fp32", "int8"])
def test_onnx_compare_reports_every_perplexity_run_against_the_reference(tiny_engine, exports, export):
    rng = random.Random(1)
    ids_list = [[rng.randrange(tiny_engine.config.vocab_size) for _ in range(100)] for _ in range(2)]
    report = perplexities(tiny_engine, load_onnx_engine(exports[export], threads=1), export, ids_list)
    assert (report["chunk"], report["dialogues"], report["tokens"]) == (CHUNK, 2, 200)
    runs = {name: report[name] for name in RUNS[1:]}
    assert all(len(run["delta_percent_by_dialogue"]) == 2 for run in runs.values())
    if export == "fp32":  # nothing rounds K/V: every run is the reference within float rounding
        assert all(abs(run["delta_percent"]) < 1e-3 for run in runs.values())
    assert abs(runs["onnxruntime_over_reference_cache"]["delta_percent"]) < 0.05


def test_npu_graphs_are_strict_static_gather_nothing_and_pass_8_bit_kv(exports):
    manifest = json.loads((exports["int8"] / MANIFEST_FILE).read_text())
    assert manifest["opset"] == 23 and manifest["kv_graph"]["dtype"] == "uint8" and "Gather" not in manifest["ops"]
    for name in (PROMPT_GRAPH, TOKEN_GRAPH):
        path = exports["int8"] / name
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True).graph
        assert model.opset_import[0].domain == "" and model.opset_import[0].version == 23
        assert all(node.domain == "" for node in model.graph.node)
        assert [i.name for i in model.graph.input[:3]] == ["inputs_embeds", "rope_cos", "rope_sin"]
        values = list(inferred.input) + list(inferred.output) + list(inferred.value_info)
        produced = {out for node in model.graph.node for out in node.output}
        assert produced <= {v.name for v in values}  # every tensor got a type and shape
        for value in values:
            dims = value.type.tensor_type.shape.dim
            assert dims and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims), value.name
        kv = [v for v in list(model.graph.input) + list(model.graph.output) if v.name.startswith(("past_", "new_"))]
        assert len(kv) == 4 * 3
        assert {v.type.tensor_type.elem_type for v in kv} == {onnx.TensorProto.UINT8}
        assert {n.op_type for n in model.graph.node} >= {"QuantizeLinear", "DequantizeLinear"}


@pytest.mark.parametrize("policy", ["sink-window", "drop-turns", "error"])
def test_a_long_dialogue_at_a_small_int8_budget_finishes_under_each_policy(exports, policy):
    engine = load_onnx_engine(exports["int8"], threads=1)
    chat = session(engine, "int8", policy, tokens=128, max_new_tokens=8)
    turns = [chat.chat(text) for text in SCRIPT * 5]
    assert all(t.kv_bytes_used <= t.kv_bytes_budget for t in turns)
    assert len(chat.fed) <= 128
    if policy == "error":
        assert "capacity" in {t.finish_reason for t in turns} and turns[0].finish_reason != "capacity"
    else:
        assert all(t.finish_reason in ("stop", "length") for t in turns), [t.error for t in turns]
        assert sum(t.evicted_tokens for t in turns) > 0
    chat.cache.blocks.check_invariants()


def test_the_graphs_window_bounds_the_dialogue(exports, tiny_engine_dir, tmp_path):
    """With a budget far above the window, overflow plans against the graphs' context."""
    small = tmp_path / "small"
    export_onnx(OnnxExportRequest(tiny_engine_dir, small, 64, CHUNK, "int8", "npu", calibration=QUICK_CALIBRATION),
                log=lambda _m: None)
    engine = load_onnx_engine(small, threads=1)
    chat = session(engine, "int8", "sink-window", tokens=4096, max_new_tokens=8)
    turns = [chat.chat(text) for text in SCRIPT * 3]
    assert all(t.finish_reason in ("stop", "length") for t in turns) and len(chat.fed) <= 64
    assert sum(t.evicted_tokens for t in turns) > 0


def test_int8_export_of_an_engine_without_scales_is_a_clear_error(tiny_engine_dir, tmp_path):
    engine = tmp_path / "no-scales"
    shutil.copytree(tiny_engine_dir, engine)
    (engine / SCALES_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"has no {SCALES_FILE}.*calibrated static scales"):
        export_onnx(OnnxExportRequest(engine, tmp_path / "out", CONTEXT, CHUNK, "int8"), log=lambda _m: None)
    assert not (tmp_path / "out").exists()


def test_bad_export_flags_exit_2_with_one_line(tiny_engine_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_main(["--engine", str(tiny_engine_dir), "--output", str(out), "--context", "8", "--chunk", "16"]) == 2
    assert "--context 8 is smaller than --chunk 16" in capsys.readouterr().err
    assert export_main(["--engine", str(tiny_engine_dir), "--output", str(tiny_engine_dir), "--context", "64"]) == 2
    assert "is not an ONNX export" in capsys.readouterr().err
    assert not out.exists()


def test_graphs_from_another_export_are_refused(exports, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(exports["int8"], mixed)
    manifest = json.loads((mixed / MANIFEST_FILE).read_text())
    manifest["model"]["fingerprint"] = "0123456789abcdef"  # the manifest of another model beside these graphs
    (mixed / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model_fingerprint.*another export"):
        load_onnx_engine(mixed)
    other = tmp_path / "other"
    shutil.copytree(exports["int8"], other)
    shutil.copyfile(exports["fp16"] / TOKEN_GRAPH, other / TOKEN_GRAPH)
    with pytest.raises(CheckpointError, match="kv_cache"):
        load_onnx_engine(other)


def test_an_interrupted_export_leaves_no_folder(tiny_engine_dir, tmp_path, monkeypatch):
    import cabinllm.builders.onnx_export as onnx_export

    build = onnx_export.build_graph

    def interrupted(model, tokens, *args):
        if tokens == 1:  # the token graph, after the prompt graph was written
            raise KeyboardInterrupt
        return build(model, tokens, *args)

    monkeypatch.setattr(onnx_export, "build_graph", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(OnnxExportRequest(tiny_engine_dir, tmp_path / "out", 64, CHUNK), log=lambda _m: None)
    assert list(tmp_path.iterdir()) == []


def test_cabin_chat_on_the_onnxruntime_backend(exports, tmp_path, capsys):
    script = tmp_path / "d.jsonl"
    script.write_text("\n".join(json.dumps({"role": "user", "content": t}) for t in SCRIPT), encoding="utf-8")
    base = ["--engine", str(exports["int8"]), "--script", str(script), "--max-new-tokens", "6"]
    assert chat_main(base + ["--json"]) == 0  # auto: the folder is an ONNX export
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2, 3] and turns[0]["kv_mode"] == "int8"
    assert turns[2]["reused_tokens"] > turns[1]["reused_tokens"] > 0
    assert chat_main(base + ["--backend", "onnxruntime", "--kv-cache", "fp16"]) == 2
    assert "take int8 K/V" in capsys.readouterr().err
    ort_graphs = base[:1] + [str(exports["int8-ort"])] + base[2:]
    assert chat_main(ort_graphs + ["--backend", "onnxruntime", "--ort-provider", "qnn"]) == 2
    assert "gather by token ids, which the HTP cannot compile" in capsys.readouterr().err



def test_graphs_without_onnxruntime_installed_are_one_error_naming_the_install(exports, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ModuleNotFoundError
    script = tmp_path / "d.jsonl"
    script.write_text(json.dumps({"role": "user", "content": SCRIPT[0]}), encoding="utf-8")
    assert chat_main(["--engine", str(exports["int8"]), "--script", str(script)]) == 2
    err = capsys.readouterr().err
    assert "needs onnxruntime, which is not installed" in err and "pip install" in err and "Traceback" not in err

def test_a_session_saved_on_the_reference_continues_on_the_onnx_backend(tiny_engine, exports, tmp_path):
    reference = session(tiny_engine, "int8")
    reference.chat(SCRIPT[0])
    reference.save(tmp_path / "s.cabin")
    onnx_engine = load_onnx_engine(exports["int8"], threads=1)
    restored = DialogueSession.restore(tmp_path / "s.cabin", onnx_engine)
    got, want = restored.chat(SCRIPT[1]), reference.chat(SCRIPT[1])
    assert got.token_ids == want.token_ids and got.reused_tokens == want.reused_tokens > 0


def test_the_default_model_answers_as_the_reference_with_fp32_kv(default_engine, default_engine_dir, tmp_path):
    """The 135M model's greedy replies, token for token, on 3 turns (slow: the default model)."""
    folder = tmp_path / "smollm2-fp32"
    export_onnx(OnnxExportRequest(default_engine_dir, folder, 512, 64, "fp32", "npu"), log=lambda _m: None)
    ours, reference = session(load_onnx_engine(folder), "fp32"), session(default_engine, "fp32")
    for text in SCRIPT:
        got, want = ours.chat(text), reference.chat(text)
        assert got.token_ids == want.token_ids and (got.prefill_tokens, got.reused_tokens) == \
            (want.prefill_tokens, want.reused_tokens)


@pytest.mark.slow
def test_a_session_with_tools_on_the_graphs_calls_as_on_the_reference(bytes_engine_dir, bytes_engine, tmp_path):
    folder = tmp_path / "bytes-int8"
    export_onnx(OnnxExportRequest(bytes_engine_dir, folder, 2048, 64, "int8", "npu", calibration=QUICK_CALIBRATION),
                log=lambda _m: None)
    tools = [Tool("set_sunroof", "", {"type": "object", "properties": {"action": {"enum": ["open", "tilt"]}},
                                      "required": ["action"], "additionalProperties": False})]
    replies = []
    for engine in (load_onnx_engine(folder, threads=1), bytes_engine):
        config = sized_config(engine.model.kv_layout, "int8", 2048, tokens_per_block=16)
        params = SamplingParams(max_new_tokens=120, stop_token_ids=engine.stop_token_ids())
        chat = DialogueSession(engine, engine.new_cache(config), params, None, tools=tools, tool_choice="required")
        replies.append(chat.chat("open it"))
    onnx_turn, reference_turn = replies
    assert onnx_turn.finish_reason == "tool_calls" and onnx_turn.tool_calls[0]["function"]["name"] == "set_sunroof"
    assert onnx_turn.token_ids == reference_turn.token_ids  # the same constrained greedy reply on both backends
