"""NPU graphs checked by Qualcomm's own compiler: cabin-export's A16W8 (and fp16) graphs of a tiny random model
finalize on the QNN HTP backend (onnxruntime-qnn; an emulator on x86_64) for HTP v68 and v73 with CPU fallback
disabled into one context binary that holds the weights once, reply over 3 turns as the CPU provider does on the
same graphs, and every bad folder or install is one clear error. The emulator cannot load a weight-shared context
of two graphs (it crashes), so here the graphs of such a folder are compiled at start; a folder of an older export,
a binary per graph, loads from its binaries.

The model is calm (small layer weights, random): its replies survive the difference between the HTP's arithmetic
and the CPU provider's; its replies say nothing of quality."""
from __future__ import annotations

import json
import shutil
import sys

import onnx
import pytest

from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.builders.onnx_export import OnnxExportRequest, export_onnx
from cabinllm.builders.qnn_quantize import CalibrationData
from cabinllm.cli.chat import main as chat_main
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.backends.qnn import CONTEXT_SUFFIX, compiled_arch, htp_emulated, htp_session
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import CabinError, CheckpointError, ConfigError, MissingDependency
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE
from cabinllm.runtime.formats.onnx_folder import PROMPT_GRAPH, TOKEN_GRAPH
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import sized_config

from conftest import QUICK_CALIBRATION
from cli_words import raises_in_cli_words
from truncated_model import write_truncated_default

pytest.importorskip("onnxruntime_qnn")
CONTEXT, CHUNK = 128, 16
SCRIPT = ["navigate to the nearest charging station", "Turn the music down.", "Is the trunk closed?"]
QUIET = {"log": lambda _m: None}
Q_DQ = {"QuantizeLinear", "DequantizeLinear"}


@pytest.fixture(scope="module")
def htp_exports(calm_engine, tmp_path_factory):
    """A16W8 graphs compiled for HTP v68 and v73, fp16 graphs compiled for v73."""
    root = tmp_path_factory.mktemp("htp")
    folders = {}
    for precision, arch in (("a16w8", 68), ("a16w8", 73), ("fp16", 73)):
        folders[precision, arch] = root / f"{precision}-v{arch}"
        export_onnx(OnnxExportRequest(calm_engine, folders[precision, arch], CONTEXT, CHUNK, "int8", "npu", precision,
                                      arch, QUICK_CALIBRATION), **QUIET)
    return folders


def load_on_the_htp(folder, **kwargs):
    """The folder's engine on the QNN provider; on the emulator, which compiles the graphs of a shared context binary at
    start, that warning checked."""
    if not htp_emulated():
        return load_onnx_engine(folder, "qnn", **kwargs)
    with pytest.warns(RuntimeWarning, match="emulator .x86_64. cannot load the graphs' shared context binary"):
        return load_onnx_engine(folder, "qnn", **kwargs)


def compiled_apart(folder, tmp_path):
    """A copy of an export with each graph compiled alone, a context binary per graph, and the manifest's ``qnn`` as
    exports before the shared context wrote it."""
    apart = tmp_path / "apart"
    shutil.copytree(folder, apart, ignore=shutil.ignore_patterns(f"*{CONTEXT_SUFFIX}", "*.bin"))
    shutil.copyfile(folder / "weights.bin", apart / "weights.bin")
    manifest = json.loads((apart / MANIFEST_FILE).read_text())
    qnn = {key: manifest["qnn"][key] for key in ("htp_arch", "onnxruntime", "onnxruntime_qnn", "qnn_sdk",
                                                  "context_graphs", "compile_s")}
    for key, name in manifest["graphs"].items():
        context = apart / qnn["context_graphs"][key]
        htp_session(apart / name, qnn["htp_arch"], **{"ep.context_enable": "1", "ep.context_embed_mode": "0",
                                                       "ep.context_file_path": str(context)})
    qnn["binary_bytes"] = {key: (apart / f"{context.removesuffix('.onnx')}_qnn.bin").stat().st_size
                           for key, context in qnn["context_graphs"].items()}
    (apart / MANIFEST_FILE).write_text(json.dumps({**manifest, "qnn": qnn}))
    return apart


def weight_tensors(model) -> dict[str, bytes]:
    """The bytes of every initializer a DequantizeLinear of a weight reads: the codes, their scales, zero points."""
    initializers = {t.name: t for t in model.graph.initializer}
    return {name: onnx.numpy_helper.to_array(initializers[name]).tobytes() for node in model.graph.node
            if node.op_type == "DequantizeLinear" and node.input[0] in initializers for name in node.input}


def replies(engine) -> list:
    config = sized_config(engine.model.kv_layout, "int8", 512, tokens_per_block=16)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=engine.stop_token_ids())
    session = DialogueSession(engine, engine.new_cache(config), params, "You are the in-car assistant.",
                              OverflowPolicy("error"))
    return [(r.token_ids, r.prefill_tokens, r.reused_tokens) for r in map(session.chat, SCRIPT)]


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
@pytest.mark.parametrize("arch", [68, 73])
def test_a16w8_graphs_finalize_for_the_htp_and_reply_as_the_cpu_provider(htp_exports, arch):
    folder = htp_exports["a16w8", arch]
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    qnn = manifest["qnn"]
    assert qnn["htp_arch"] == arch and {"onnxruntime", "onnxruntime_qnn", "qnn_sdk"} <= set(qnn)
    for key in ("prompt", "token"):
        assert compiled_arch(folder / qnn["context_graphs"][key]) == arch
    htp, cpu = load_on_the_htp(folder, threads=1), load_onnx_engine(folder, "cpu", threads=1)
    got, want = replies(htp), replies(cpu)
    assert got == want and got[2][2] > got[1][2] > 0  # later turns reuse the earlier ones on the HTP too
    assert sum(len(ids) for ids, _, _ in got) > 20


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
@pytest.mark.parametrize("arch", [68, 73])
def test_both_graphs_share_one_context_binary_that_holds_the_weights_once(htp_exports, tmp_path, arch):
    """Both context models name the one binary; the graphs' int8 weights, scales and zero points are byte-identical
    (what QNN shares). On the tiny model each graph's own tensors (activation encodings, ops) are larger than the
    weights, so the binary is measured against the same graphs compiled apart: it is smaller by at least 90% of a copy
    of the weights (weights.bin). An export of before, a binary per graph, still loads and replies."""
    folder = htp_exports["a16w8", arch]
    qnn = json.loads((folder / MANIFEST_FILE).read_text())["qnn"]
    assert sorted(p.name for p in folder.glob("*.bin")) == sorted(["weights.bin", qnn["context_binary"]])
    models = [onnx.load(str(folder / qnn["context_graphs"][key])) for key in ("prompt", "token")]
    named = {a.s.decode() for model in models for node in model.graph.node for a in node.attribute
             if a.name == "ep_cache_context"}
    assert named == {qnn["context_binary"]} and "weight sharing" in qnn["shared"]
    assert qnn["binary_bytes"] == (folder / qnn["context_binary"]).stat().st_size
    assert qnn["weights_bytes"] == (folder / "weights.bin").stat().st_size
    weights = [weight_tensors(onnx.load(str(folder / name))) for name in (PROMPT_GRAPH, TOKEN_GRAPH)]
    assert weights[0] == weights[1] and sum(map(len, weights[0].values())) > 0.9 * qnn["weights_bytes"]
    apart = compiled_apart(folder, tmp_path)
    binaries = json.loads((apart / MANIFEST_FILE).read_text())["qnn"]["binary_bytes"]
    assert sum(binaries.values()) - qnn["binary_bytes"] >= 0.9 * qnn["weights_bytes"]
    got = replies(load_onnx_engine(apart, "qnn", threads=1))  # no warning: a binary per graph loads on the emulator
    assert got == replies(load_onnx_engine(folder, "cpu", threads=1))


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
@pytest.mark.parametrize("name", [PROMPT_GRAPH, TOKEN_GRAPH])
def test_a16w8_graphs_are_quantized_throughout_with_the_engines_kv_scales(htp_exports, calm_engine, name):
    """HTP v68 has no floating point: every op but Q/DQ reads dequantized tensors and writes quantized ones, and the
    K/V come in and go out as uint8 codes with the engine's scale of each layer."""
    folder = htp_exports["a16w8", 68]
    model = onnx.load(str(folder / name))
    producer = {out: node for node in model.graph.node for out in node.output}
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type in Q_DQ or node.op_type == "Constant":
            continue
        data = node.input[:1] if node.op_type in ("Reshape", "Split", "Slice", "Unsqueeze", "ReduceMean") else node.input
        floats = [i for i in data if i and i not in initializers]  # shapes, sizes and axes are int64 constants
        assert all(i in producer and producer[i].op_type == "DequantizeLinear" for i in floats), node.name
    kv_io = [v for v in list(model.graph.input) + list(model.graph.output) if v.name.startswith(("past_", "new_"))]
    assert len(kv_io) == 4 * 3 and {v.type.tensor_type.elem_type for v in kv_io} == {onnx.TensorProto.UINT8}
    engine_scales = Engine.load(calm_engine).scales.shared()  # the int8 cache's one scale per layer
    past_dequantized = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
                        and n.input[0].startswith(("past_key.", "past_value."))]
    assert len(past_dequantized) == 2 * len(engine_scales) == 2 * 3  # each window input straight into its DQ
    for node in past_dequantized:
        layer = int(node.input[0].split(".")[1])
        scale = onnx.numpy_helper.to_array(initializers[node.input[1]])
        assert float(scale) == pytest.approx(engine_scales[layer], rel=1e-7)
        assert int(onnx.numpy_helper.to_array(initializers[node.input[2]])) == 128


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
def test_fp16_graphs_run_on_v73_and_v68_takes_only_a16w8(htp_exports, calm_engine, tmp_path):
    htp = load_on_the_htp(htp_exports["fp16", 73], threads=1)
    assert replies(htp)[0][0]
    with pytest.raises(ConfigError, match="HTP v68 runs a16w8 graphs, not fp16"):
        export_onnx(OnnxExportRequest(calm_engine, tmp_path / "x", CONTEXT, CHUNK, "int8", "npu", "fp16", 68), **QUIET)
    with pytest.raises(ConfigError, match="a16w8 graphs take --kv-cache int8, not fp16"):
        export_onnx(OnnxExportRequest(calm_engine, tmp_path / "x", CONTEXT, CHUNK, "fp16", "npu", "a16w8"), **QUIET)


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
def test_cabin_chat_runs_a_script_on_the_htp(htp_exports, tmp_path, capsys):
    script = tmp_path / "d.jsonl"
    script.write_text("\n".join(json.dumps({"role": "user", "content": t}) for t in SCRIPT[:2]), encoding="utf-8")
    code = chat_main(["--engine", str(htp_exports["a16w8", 68]), "--script", str(script), "--json",
                      "--ort-provider", "qnn", "--max-new-tokens", "6"])
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and [t["turn"] for t in turns] == [1, 2] and turns[1]["reused_tokens"] > 0
    assert chat_main(["--engine", str(htp_exports["a16w8", 68]), "--script", str(script), "--htp-arch", "68"]) == 2
    err = capsys.readouterr().err
    assert "--htp-arch names the HTP of --ort-provider qnn, not cpu" in err and "Traceback" not in err


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
def test_graphs_compiled_for_another_arch_are_refused(htp_exports, tmp_path):
    with raises_in_cli_words(ConfigError, match="compiled for HTP v68, and this device is v73; .* --htp-arch 73"):
        load_onnx_engine(htp_exports["a16w8", 68], "qnn", htp_arch=73)
    swapped = tmp_path / "swapped"  # v73 context models in a folder whose manifest says v68
    shutil.copytree(htp_exports["a16w8", 68], swapped)
    for name in ("prompt_ctx.onnx", "token_ctx.onnx", "prompt_ctx_qnn.bin"):
        shutil.copyfile(htp_exports["a16w8", 73] / name, swapped / name)
    with pytest.raises(ConfigError, match="compiled for HTP v73, and this device is v68"):
        load_onnx_engine(swapped, "qnn")


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
@pytest.mark.parametrize("missing", ["token_ctx.onnx", "prompt_ctx_qnn.bin"])  # a context model, the one binary
def test_a_missing_context_binary_is_one_clear_error(htp_exports, tmp_path, missing):
    folder = tmp_path / "graphs"
    shutil.copytree(htp_exports["a16w8", 68], folder)
    assert json.loads((folder / MANIFEST_FILE).read_text())["qnn"]["context_binary"] == "prompt_ctx_qnn.bin"
    (folder / missing).unlink()
    with pytest.raises(CheckpointError, match=f"{missing}: .*missing; export it again"):
        load_onnx_engine(folder, "qnn")


@pytest.mark.slow  # the HTP emulator's graphs (a module fixture)
def test_onnxruntime_without_the_qnn_plugin_is_one_error_naming_the_install(htp_exports, calm_engine, tmp_path,
                                                                           monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)
    with pytest.raises(MissingDependency, match="needs onnxruntime_qnn.*pip install onnxruntime-qnn"):
        load_onnx_engine(htp_exports["a16w8", 68], "qnn")
    with pytest.raises(CabinError, match="pip install onnxruntime-qnn"):
        export_onnx(OnnxExportRequest(calm_engine, tmp_path / "x", CONTEXT, CHUNK, "int8", "npu", "a16w8",
                                      calibration=QUICK_CALIBRATION), **QUIET)
    assert not (tmp_path / "x").exists()


def test_a_graph_that_needs_the_cpu_names_its_nodes(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Det", ["m"], ["d"], name="the_det")], "g",
                              [helper.make_tensor_value_info("m", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("d", TensorProto.FLOAT, [])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "det.onnx")
    with pytest.raises(ConfigError, match=r"does not take 1 node\(s\).*CPU fallback is disabled: the_det \(Det\)"):
        htp_session(tmp_path / "det.onnx", 73)


@pytest.mark.slow
def test_the_default_models_a16w8_graphs_finalize_for_v68(tmp_path):
    """The real model's widths (hidden 576, the 49152-row embedding and head: binaries of tens of MB) finalize for
    v68, the HTP with the smaller VTCM. The model is the default one cut to its first 2 of 30 layers (same widths,
    vocabulary and tokenizer): the static quantizer's time grows with the layers, and every layer has the same
    shapes; a small window and calibration keep the test short too (the 2-turn cabin-chat on the HTP emulator,
    minutes long, is in docs/npu-onnx.md with the whole model's figures). Both arches' finalize and chat are tested
    on the tiny model above."""
    engine = tmp_path / "engine"
    build_engine(BuildRequest(str(write_truncated_default(tmp_path / "model", 2)), engine, kv_cache="int8",
                              dtype="float32"), **QUIET)
    graphs = tmp_path / "v68"
    export_onnx(OnnxExportRequest(engine, graphs, 64, 32, "int8", "npu", "a16w8", 68,
                                  CalibrationData(num_dialogues=1, max_tokens=64, token_steps=1)), **QUIET)
    qnn = json.loads((graphs / MANIFEST_FILE).read_text())["qnn"]
    assert qnn["htp_arch"] == 68 and 10 << 20 < qnn["binary_bytes"] <= 1.15 * qnn["weights_bytes"]
    assert all(compiled_arch(graphs / name) == 68 for name in qnn["context_graphs"].values())
