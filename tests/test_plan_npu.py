"""cabin-plan, cabin-build and cabin-export on the NPU targets: the planned KV window and prompt-graph chunk fit,
the cabin-export command parses and exports what was planned, refusals name the fix, profiles are checked.

All on the tiny random Llama (3 layers, 2 KV heads x 8, a 1,024-token context)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import TINY_ENGINE_SHAPE

from cabinllm.builders.engine_build import GRAPHS_SUFFIX, BuildRequest, build_engine
from cabinllm.builders.graph_plan import ENGINE_PLACEHOLDER, GRAPHS_PLACEHOLDER, graph_plan, npu_weight_bytes
from cabinllm.builders.memory_model import weights_bytes
from cabinllm.builders.planner import MIN_TURNS, PlanRequest, make_plan
from cabinllm.builders.targets import GIB, Backend, get_target, load_targets
from cabinllm.cli.export import export_request
from cabinllm.cli.export import main as cabin_export
from cabinllm.cli.export import parse_args as export_args
from cabinllm.cli.plan import main as cabin_plan
from cabinllm.runtime.errors import TargetError
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE
from cabinllm.runtime.sources.model_source import load_model_config

from fakes.tiny_model import write_tiny_llama

NPU_TARGETS = ("sa8295p-16gb", "sa8775p-36gb")
KV_ELEMENTS = 2 * 3 * 2 * 8  # K and V x 3 layers x 2 KV heads x head size 8: one byte each in int8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def run_plan(capsys, *args: str) -> tuple[int, dict]:
    code = cabin_plan([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_npu_targets_are_onnx_targets_with_a_profile():
    targets = load_targets()
    assert [name for name, t in targets.items() if t.backend is Backend.ONNX] == list(NPU_TARGETS)
    for name in NPU_TARGETS:
        t = targets[name]
        assert t.npu.onnx_profile == "npu" and t.npu.ort_provider == "qnn" and t.weights_in_memory == "fp32"
        assert "int8" in t.kv_dtypes and "fp8" in t.unsupported_kv


@pytest.mark.parametrize("target", NPU_TARGETS)
def test_plan_gives_a_window_and_chunk_that_fit(capsys, tiny_model, target):
    code, plan = run_plan(capsys, "--model", str(tiny_model), "--target", target)
    profile = get_target(target)
    assert code == 0 and plan["kv_dtypes"] == list(profile.kv_dtypes) and plan["trtllm_build_args"] is None
    assert plan["weights_bytes"] == 4 * plan["model"]["parameters"]  # weights.bin holds fp32
    budget = plan["memory_bytes"]["for_activations_and_kv"]
    for dtype, graphs in plan["cabin_export"].items():
        per_token = KV_ELEMENTS * (2 if dtype == "fp16" else 1)
        context, chunk = graphs["context"], graphs["chunk"]
        assert plan["kv_bytes_per_token"][dtype] == per_token
        assert (plan["max_seq_len"][dtype], plan["max_num_tokens"][dtype]) == (context, chunk)
        assert chunk == profile.npu.default_chunk and context == 1024  # the model's context caps the window
        assert graphs["kv_io_bytes"] == (2 * context + chunk + 1) * per_token
        assert graphs["window_bytes"] == graphs["host_cache_bytes"] == plan["kv_pool_bytes"][dtype]
        assert graphs["window_bytes"] == context * per_token
        used = graphs["kv_io_bytes"] + graphs["window_bytes"] + graphs["host_cache_bytes"] + graphs["activation_bytes"]
        assert plan["memory_left_bytes"][dtype] == budget - used > 0
        assert graphs["kv_cache"] == dtype and graphs["profile"] == "npu" and graphs["ort_provider"] == "qnn"
        assert (graphs["npu_graph_bytes"] is None) == (not profile.npu.float16)
        assert plan["fits"][dtype] and plan["est_turns"][dtype] >= MIN_TURNS
        assert f"--kv-budget-mb {-(-graphs['host_cache_bytes'] // 2**20)}" in graphs["chat_command"]
    assert any("paged cache keeps the dialogue in host memory" in w for w in plan["warnings"])


@pytest.mark.parametrize("target", NPU_TARGETS)
def test_planned_export_command_parses_with_cabin_export(capsys, tiny_model, target):
    _, plan = run_plan(capsys, "--model", str(tiny_model), "--target", target)
    for dtype, graphs in plan["cabin_export"].items():
        command = graphs["command"].split()
        assert command[0] == "cabin-export" and command[1:] == graphs["args"]
        request = export_request(export_args(command[1:]))
        assert (str(request.engine), str(request.output)) == (ENGINE_PLACEHOLDER, GRAPHS_PLACEHOLDER)
        assert (request.context, request.chunk, request.kv_cache, request.profile) == (
            graphs["context"], graphs["chunk"], dtype, "npu")


@pytest.mark.parametrize("target", NPU_TARGETS)
@pytest.mark.parametrize("kv", ["fp8", "int4", "fp32"])
def test_refuses_kv_the_npu_cannot_take_and_names_int8(capsys, tiny_model, target, kv):
    code, out = run_plan(capsys, "--model", str(tiny_model), "--target", target, "--kv-cache", kv)
    reason = out["refused"]["reason"]
    assert code == 2 and reason.startswith(f"{kv} KV cache does not work on {target}: ")
    assert get_target(target).unsupported_kv.get(kv, "takes KV dtypes") in reason
    assert out["refused"]["nearest"]["target"] == target and out["refused"]["nearest"]["kv_dtypes"] == ["int8"]


def test_sa8295p_has_no_fp16_on_its_npu(capsys, tiny_model):
    code, out = run_plan(capsys, "--model", str(tiny_model), "--target", "sa8295p-16gb", "--kv-cache", "fp16")
    assert code == 2 and "HTP v68 has no FP16" in out["refused"]["reason"]
    _, plan = run_plan(capsys, "--model", str(tiny_model), "--target", "sa8295p-16gb")
    assert any("HTP v68: it runs a16w8 graphs only (no floating point)" in w for w in plan["warnings"])
    graphs = plan["cabin_export"]["int8"]
    assert (graphs["precision"], graphs["htp_arch"]) == ("a16w8", 68)
    assert "--precision a16w8 --htp-arch 68" in graphs["command"]
    _, plan = run_plan(capsys, "--model", str(tiny_model), "--target", "sa8775p-36gb")
    assert any("HTP v73: it runs a16w8 or fp16 graphs;" in w for w in plan["warnings"])
    assert {kv: g["precision"] for kv, g in plan["cabin_export"].items()} == {"int8": "a16w8", "fp16": "fp16"}


def test_refuses_weight_formats_the_export_does_not_write(capsys, tmp_path):
    model = write_tiny_llama(tmp_path / "model", **TINY_ENGINE_SHAPE)  # inputs AWQ's groups of 64 divide
    code, out = run_plan(capsys, "--model", str(model), "--target", "sa8775p-36gb", "--weights", "int4-awq")
    assert code == 2 and "int4-awq weights are not available on sa8775p-36gb; it takes fp16, int8" in \
        out["refused"]["reason"]
    assert out["refused"]["nearest"]["weights"] == "int8"


def test_int8_weights_plan_what_the_export_writes_and_fit_a_tighter_graph_bound(capsys, tiny_model):
    """W8A16 graphs: weights.bin with int8 linear layers counted, the NPU's copy of them int8 (+ scales), so a graph
    bound that refuses fp16 weights takes int8 ones."""
    config, base = load_model_config(str(tiny_model)), get_target("sa8775p-36gb")
    code, plan = run_plan(capsys, "--model", str(tiny_model), "--target", "sa8775p-36gb", "--weights", "int8")
    assert code == 0
    assert plan["weights_bytes"] == weights_bytes(config, "int8", "fp32") < 4 * plan["model"]["parameters"]
    assert any("int8 linear layers and fp32 other weights" in w for w in plan["warnings"])
    graphs = {w: make_plan(PlanRequest("tiny", base, weights=w, kv_dtype="int8"), config).kv["int8"].graphs
              for w in ("fp16", "int8")}
    saved = npu_weight_bytes(config, "fp16") - npu_weight_bytes(config, "int8")
    assert saved > 0 and graphs["fp16"].npu_graph_bytes - graphs["int8"].npu_graph_bytes == saved
    bound = replace(base, npu=replace(base.npu, graph_memory_gib=graphs["int8"].npu_graph_bytes / GIB))
    bounded = {w: make_plan(PlanRequest("tiny", bound, weights=w, kv_dtype="int8"), config) for w in ("fp16", "int8")}
    assert bounded["int8"].kv["int8"].graphs.context == graphs["int8"].context
    assert bounded["fp16"].refusal() or bounded["fp16"].kv["int8"].max_seq_len < graphs["int8"].context


def test_a_tight_budget_shrinks_the_window_then_the_chunk(tiny_model):
    config, target = load_model_config(str(tiny_model)), get_target("sa8775p-36gb")
    free = target.memory_gib - target.os_reserve_gib - target.runtime_overhead_gib
    weights = make_plan(PlanRequest("tiny", target), config).weights_bytes
    for left, chunk in ((4 << 20, 128), (1300 << 10, 64)):  # bytes left after the weights
        request = PlanRequest("tiny", target, reserve_gb=free - (weights + left) / GIB, kv_dtype="int8")
        plan = make_plan(request, config)
        kv, budget = plan.kv["int8"], plan.budget_bytes
        assert kv.fits and kv.graphs.chunk == chunk and chunk <= kv.max_seq_len < 1024 and kv.max_seq_len % 32 == 0
        assert 0 <= kv.memory_left_bytes == budget - kv.graphs.total_bytes
        assert graph_plan(config, target, "int8", kv.max_seq_len + 32, chunk).total_bytes > budget
        if chunk < target.npu.default_chunk:  # not even one window of the default chunk fitted
            assert graph_plan(config, target, "int8", 128, 128).total_bytes > budget


def test_the_graph_bound_limits_the_window_and_refuses_models_over_it(tiny_model):
    config, base = load_model_config(str(tiny_model)), get_target("sa8775p-36gb")
    unbounded = make_plan(PlanRequest("tiny", base, kv_dtype="int8"), config).kv["int8"].graphs
    bound = replace(base, npu=replace(base.npu, graph_memory_gib=(unbounded.npu_graph_bytes - 20_000) / GIB))
    bounded = make_plan(PlanRequest("tiny", bound, kv_dtype="int8"), config).kv["int8"].graphs
    assert bounded.context < unbounded.context and bounded.npu_graph_bytes <= bound.npu.graph_memory_gib * GIB
    tiny_bound = replace(base, npu=replace(base.npu, graph_memory_gib=1e-6))
    reason = make_plan(PlanRequest("tiny", tiny_bound), config).refusal()
    assert "one graph may hold on sa8775p-36gb's NPU (graph_memory_gib" in reason and "split" in reason


def test_tensorrt_plans_have_no_export_section(capsys, tiny_model):
    _, plan = run_plan(capsys, "--model", str(tiny_model), "--target", "orin-nano-8gb")
    assert "cabin_export" not in plan and plan["trtllm_build_args"]["int8"]


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fp16", "int8"])
def test_cabin_build_for_an_npu_target_records_the_export_step(tiny_model, tmp_path, capsys, weights):
    out = tmp_path / "e"
    logged = []
    build_engine(BuildRequest(str(tiny_model), out, "int8", target="sa8775p-36gb", weights=weights),
                 log=logged.append)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    step, planned = manifest["device_step"], manifest["plan"]["cabin_export"]["int8"]
    assert manifest["backend"] == "reference" and step["status"] == "pending"
    assert step["what"] == "ONNX graph export (cabin-export)" and "cabin-export" in step["reason"]
    folders = {ENGINE_PLACEHOLDER: str(out), GRAPHS_PLACEHOLDER: f"{out}{GRAPHS_SUFFIX}"}
    assert step["command"] == ["cabin-export", *(folders.get(arg, arg) for arg in planned["args"])]
    assert step["then"][:7] == ["cabin-chat", "--engine", f"{out}{GRAPHS_SUFFIX}", "--backend", "onnxruntime",
                                "--ort-provider", "qnn"]
    assert logged[-1] == f"next, the graphs for sa8775p-36gb: {' '.join(step['command'])}"
    assert cabin_export([*step["command"][1:]]) == 0  # the recorded command exports what was planned
    graphs = json.loads((tmp_path / f"e{GRAPHS_SUFFIX}" / MANIFEST_FILE).read_text())
    assert (graphs["context"], graphs["chunk"], graphs["kv_cache"]) == (planned["context"], planned["chunk"], "int8")
    assert graphs["weight_format"]["name"] == weights


def test_cabin_export_takes_the_plan_from_target_and_flags_win(tiny_engine_dir, tmp_path):
    args = export_args(["--engine", str(tiny_engine_dir), "--output", str(tmp_path / "g"), "--target",
                        "sa8775p-36gb"])
    request = export_request(args)
    assert (request.context, request.chunk, request.kv_cache, request.profile) == (1024, 128, "int8", "npu")
    args = export_args(["--engine", str(tiny_engine_dir), "--output", "g", "--target", "sa8775p-36gb", "--chunk",
                        "32", "--kv-cache", "fp16"])
    request = export_request(args)
    assert (request.context, request.chunk, request.kv_cache) == (1024, 32, "fp16")
    request = export_request(export_args(["--engine", str(tiny_engine_dir), "--output", "g"]))
    assert (request.context, request.chunk, request.kv_cache, request.profile) == (2048, 64, "int8", "npu")


@pytest.mark.parametrize("args, message", [
    (["--target", "orin-nano-8gb"], "--target orin-nano-8gb runs tensorrt engines, not ONNX graphs; give an NPU "
                                    "target (sa8295p-16gb, sa8775p-36gb)"),
    (["--target", "sa8295p-16gb", "--kv-cache", "fp16"], "HTP v68 has no FP16"),
    (["--target", "sa8775p"], "unknown target 'sa8775p'"),
])
def test_cabin_export_target_errors_name_the_fix(tiny_engine_dir, tmp_path, capsys, args, message):
    assert cabin_export(["--engine", str(tiny_engine_dir), "--output", str(tmp_path / "g"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cabin-export: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "g").exists()


NPU_PROFILE = """
[n]
description = "an NPU"
memory_gib = 8.0
os_reserve_gib = 1.0
co_resident_gib = 1.0
runtime_overhead_gib = 0.5
kv_dtypes = ["int8"]
weight_formats = ["fp16"]
backend = "onnx"
tokens_per_block = 32
"""
NPU_TABLE = '\n[n.npu]\nonnx_profile = "npu"\nort_provider = "qnn"\nhtp_arch = 73\ndefault_chunk = 64\n'


@pytest.mark.parametrize("text, message", [
    (NPU_PROFILE, "needs a [n.npu] table exactly when backend = \"onnx\""),
    (NPU_PROFILE.replace('"onnx"', '"tensorrt"') + NPU_TABLE, "needs a [n.npu] table exactly when"),
    (NPU_PROFILE.replace('"onnx"', '"npu"') + NPU_TABLE, "backend 'npu' is not one of tensorrt, reference, onnx"),
    (NPU_PROFILE + NPU_TABLE.replace('"qnn"', '"hexagon"'), "ort_provider 'hexagon' is not one of cpu, cuda"),
    (NPU_PROFILE + NPU_TABLE.replace('"npu"', '"qdq"'), "onnx_profile 'qdq' is not one of npu, ort"),
    (NPU_PROFILE + NPU_TABLE + "vtcm_mb = 8\n", "[n.npu] has unknown keys ['vtcm_mb']"),
    (NPU_PROFILE.replace('["int8"]', '["int8", "fp8"]') + NPU_TABLE, "take none of kv_dtypes ['fp8']"),
    (NPU_PROFILE + NPU_TABLE.replace("73", "66"), "htp_arch 66 is not one of 68, 73"),
    (NPU_PROFILE.replace('["int8"]', '["int8", "fp16"]') + NPU_TABLE.replace("73", "68"),
     "HTP v68 runs a16w8 graphs, which take none of kv_dtypes ['fp16']"),
])
def test_malformed_npu_profiles_are_refused_by_name(tmp_path, text, message):
    path = tmp_path / "targets.toml"
    path.write_text(text)
    with pytest.raises(TargetError) as err:
        load_targets(path)
    assert message in str(err.value)
    path.write_text(NPU_PROFILE + NPU_TABLE)
    assert load_targets(path)["n"].npu.default_chunk == 64


@pytest.mark.parametrize("target", NPU_TARGETS)
def test_the_plan_states_what_each_precision_measured(capsys, tiny_model, target):
    _, plan = run_plan(capsys, "--model", str(tiny_model), "--target", target)
    npu = get_target(target).npu
    line = next(w for w in plan["warnings"] if w.startswith("what each precision costs"))
    for precision in npu.precisions:
        measured = npu.measured.get(precision)
        if measured is None:
            assert f"{precision}: not measured on HTP v{npu.htp_arch}" in line
        else:
            assert f"{precision}: {measured['perplexity_pct']:+.2f}% perplexity, top-1 {measured['top1_pct']:.1f}%" in line
    assert "a16w8" in npu.measured  # the precision every HTP runs has its measured cost in targets.toml
