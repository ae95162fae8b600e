"""What makes the A16W8 graphs accurate: the conversation's first token stored at export (no graph runs it, so no
calibrated range holds its massive activation), padded prompt rows that repeat the last token, and a precision plan
that stores chosen weights in 16 bits where the HTP architecture runs them. A tiny random model: mechanics only."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from cabinllm.builders.onnx_export import OnnxExportRequest, export_onnx
from cabinllm.builders.qnn_precision import PLAN_FORMAT, PrecisionPlan, check_plan, read_plan
from cabinllm.builders.qnn_quantize import Recording
from cabinllm.cli.export import main as export_main
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import ConfigError, DataError
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE
from cabinllm.runtime.formats.onnx_folder import INPUTS_EMBEDS, ROPE_INPUTS
from cabinllm.runtime.model.run_tokens import run_tokens

from conftest import QUICK_CALIBRATION

pytest.importorskip("onnxruntime")
CONTEXT, CHUNK = 64, 16
QUIET = {"log": lambda _m: None}
PLAN = PrecisionPlan(("layers.0.qkv", "layers.1.input_norm"), "a test")


@pytest.fixture(scope="module")
def exports(calm_engine, tmp_path_factory):
    """A16W8 graphs without and with the plan (not compiled)."""
    root = tmp_path_factory.mktemp("graphs")
    for name, plan in (("plain", PrecisionPlan()), ("plan", PLAN)):
        export_onnx(OnnxExportRequest(calm_engine, root / name, CONTEXT, CHUNK, "int8", "npu", "a16w8",
                                      calibration=QUICK_CALIBRATION, precision_plan=plan), **QUIET)
    return root


def tokens(n: int) -> list[int]:
    """n token ids of the tiny vocabulary, none of them the conversation's first token."""
    return [3 + i % 18 for i in range(n)]


def recorded(folder):
    """The folder's engine on the CPU provider and the prompt graph's calls' inputs as it makes them."""
    loaded = load_onnx_engine(folder, "cpu", 1)
    model, calls = loaded.model, []
    graph = model.graphs[model.chunk]
    graph.session = Recording(graph.session, lambda feeds: calls.append({k: np.array(v) for k, v in feeds.items()}))
    return loaded, calls


def test_no_graph_runs_the_conversations_first_token(exports, calm_engine):
    reference = Engine.load(calm_engine)
    manifest = json.loads((exports / "plain" / MANIFEST_FILE).read_text())
    ids = reference.tokenizer.encode_prompt(reference.tokenizer.render([{"role": "user", "content": "Hi there!"}]))
    assert manifest["prefix"] == ids[:1]
    loaded, calls = recorded(exports / "plain")
    run = run_tokens(loaded.model, ids, "int8", loaded.scales, all_logits=True)
    rope = np.load(exports / "plain" / "host" / f"{ROPE_INPUTS[0]}.npy")
    assert np.array_equal(calls[0][ROPE_INPUTS[0]][0, 0, 0], rope[1])  # the graphs start at position 1
    stored = run_tokens(reference.model, ids[:1], "int8", loaded.scales, all_logits=True)  # the reference's position 0
    assert torch.allclose(run.logits[0], stored.logits[0], atol=1e-5)
    for layer in range(reference.config.num_hidden_layers):
        for ours, theirs in zip(run.cache.read(layer, run.seq), stored.cache.read(layer, stored.seq)):
            assert torch.equal(ours[:1], theirs)
    plain = load_onnx_engine(exports / "plain", "cpu", 1)
    plain.model.prefix = None  # the graphs run position 0 as well: the same tokens predicted after it, nearly
    again = run_tokens(plain.model, ids, "int8", plain.scales, all_logits=True).logits
    assert (again[1:].argmax(-1) == run.logits[1:].argmax(-1)).float().mean() > 0.9


def test_padded_prompt_rows_repeat_the_last_token(exports):
    loaded, calls = recorded(exports / "plain")
    run_tokens(loaded.model, tokens(CHUNK + 5), "int8", loaded.scales)  # a chunk, then 5 tokens and padding
    last = calls[-1]
    embeds, mask = last[INPUTS_EMBEDS][0], last["attention_mask"][0, 0]
    assert np.array_equal(embeds[5:], np.repeat(embeds[4:5], CHUNK - 5, axis=0))
    assert np.array_equal(mask[5:], np.repeat(mask[4:5], CHUNK - 5, axis=0))
    assert not np.array_equal(embeds[3], embeds[4]) and not np.array_equal(mask[3], mask[4])


def test_a_plan_stores_its_weights_in_16_bits(exports):
    manifest = json.loads((exports / "plan" / MANIFEST_FILE).read_text())
    assert manifest["quantization"]["weights_16_bit"] == PLAN.to_dict()
    mixed, plain = ({t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(
        str(exports / name / "prompt.onnx")).graph.initializer} for name in ("plan", "plain"))
    for name in PLAN.w16:  # the same weight, to within half a step of each
        codes, scale = mixed[f"{name}_quantized"], mixed[f"{name}_scale"]
        assert codes.dtype == np.int16 and np.abs(codes).max() == 32767
        eight = plain[f"{name}_quantized"] * plain[f"{name}_scale"]
        assert np.abs(codes * scale - eight).max() <= 0.5 * (plain[f"{name}_scale"] + scale).max() * 1.001
    assert mixed["layers.0.dense_quantized"].dtype == np.int8
    a16w8, mixed = (load_onnx_engine(exports / name, "cpu", 1) for name in ("plain", "plan"))
    ids = tokens(35)
    got = [run_tokens(m.model, ids, "int8", m.scales, all_logits=True).logits for m in (a16w8, mixed)]
    assert not torch.equal(got[0], got[1])


def test_a_plan_the_htp_cannot_run_is_refused_naming_what_it_runs(exports):
    model = onnx.load(str(exports / "plan" / "prompt.onnx"), load_external_data=False)
    check_plan(PLAN, model, 73)
    check_plan(PrecisionPlan(("layers.1.input_norm",)), model, 68)  # a norm's scale: an elementwise Mul
    with pytest.raises(ConfigError, match="HTP v68 runs 16-bit weights only in Mul ops.*layers.0.qkv.*--htp-arch 73"):
        check_plan(PLAN, model, 68)
    with pytest.raises(ConfigError, match="do not quantize: layers.9.qkv"):
        check_plan(PrecisionPlan(("layers.9.qkv",)), model, 73)


def test_cabin_export_reads_plans_and_refuses_a_bad_one(calm_engine, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN.to_dict()))
    assert read_plan(path) == PLAN and PLAN.to_dict()["format"] == PLAN_FORMAT
    path.write_text("{}")
    with pytest.raises(DataError, match="not a precision plan"):
        read_plan(path)
    code = export_main(["--engine", str(calm_engine), "--output", str(tmp_path / "out"), "--context", "64", "--chunk", "16",
                        "--precision-plan", str(path)])
    assert code == 2 and "not a precision plan" in capsys.readouterr().err
    path.write_text(json.dumps(PLAN.to_dict()))
    code = export_main(["--engine", str(calm_engine), "--output", str(tmp_path / "out"), "--context", "64", "--chunk", "16",
                        "--precision", "fp16", "--kv-cache", "fp32", "--precision-plan", str(path)])
    assert code == 2 and "export --precision a16w8" in capsys.readouterr().err
