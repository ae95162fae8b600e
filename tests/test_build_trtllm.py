"""cabin-build with a fake trtllm-build on PATH and a fake tensorrt_llm reporting v0.12 or 1.x."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import cabinllm.builders.engine_build
from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.cli.build import main as cabin_build
from cabinllm.runtime.backends.trtllm import engine_max_beam_width
from cabinllm.runtime.errors import TrtllmError

from fakes.tiny_model import write_tiny_llama

FAKES = Path(__file__).parent / "fakes"


@pytest.fixture
def fake_trtllm(tmp_path, monkeypatch):
    """Put a fake trtllm-build on PATH and a fake tensorrt_llm on sys.path; returns the argv record file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "trtllm-build"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKES / "trtllm_build.py"}" "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_TRTLLM_ARGV", str(tmp_path / "argv.json"))
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.setattr(cabinllm.builders.engine_build, "local_sm", lambda: None)  # no GPU visible, as on a CPU host
    sys.modules.pop("tensorrt_llm", None)
    yield tmp_path / "argv.json"
    sys.modules.pop("tensorrt_llm", None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


def recorded(argv_file: Path) -> tuple[list[str], Path]:
    record = json.loads(argv_file.read_text())
    return record["argv"], Path(record["cwd"])


def test_v012_flags_for_orin_int8(fake_trtllm, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "0.12.0")
    out = build_engine(BuildRequest(tiny_model, tmp_path / "e", "int8", target="agx-orin-64gb"), log=lambda _: None)
    argv, cwd = recorded(fake_trtllm)
    assert argv == [
        "--checkpoint_dir", "checkpoint", "--output_dir", "trt_engine", "--gemm_plugin", "float16",
        "--paged_kv_cache", "enable", "--tokens_per_block", "64", "--use_paged_context_fmha", "disable",
        "--max_batch_size", "1", "--max_beam_width", "1", "--max_input_len", "768", "--max_seq_len", "1024",
        "--max_num_tokens", "768"]
    assert cwd.name.startswith(".e.") and cwd.name.endswith(".partial")  # built in the staging folder
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "tensorrt" and manifest["versions"]["tensorrt_llm"] == "0.12.0"
    step = manifest["device_step"]
    assert (step["status"], step["flags"], step["engine_dir"]) == ("run here", "v0.12", "trt_engine")
    assert step["command"] == [str(tmp_path / "bin" / "trtllm-build"), *argv]
    assert (out / "trt_engine" / "rank0.engine").read_bytes() == b"fake engine"
    assert "Total time of building all engines" in (out / "trtllm-build.log").read_text()


def test_1x_flags_for_thor_fp8(fake_trtllm, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "1.0.0")
    out = build_engine(BuildRequest(tiny_model, tmp_path / "e", "fp8", target="thor-128gb"), log=lambda _: None)
    argv, _ = recorded(fake_trtllm)
    assert argv == [
        "--checkpoint_dir", "checkpoint", "--output_dir", "trt_engine", "--gemm_plugin", "auto",
        "--kv_cache_type", "paged", "--tokens_per_block", "32", "--use_paged_context_fmha", "enable",
        "--max_batch_size", "1", "--max_beam_width", "1", "--max_input_len", "768", "--max_seq_len", "1024",
        "--max_num_tokens", "768"]
    assert json.loads((out / "trt_engine" / "config.json").read_text())["kv_cache_quant_algo"] == "FP8"


def test_1x_int8_switches_paged_context_fmha_off(fake_trtllm, tiny_model, tmp_path, monkeypatch):
    """1.x turns paged context FMHA on by default, so an INT8-KV build must say disable."""
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "1.0.0")
    out = build_engine(BuildRequest(tiny_model, tmp_path / "e", "int8", target="orin-nx-16gb"), log=lambda _: None)
    argv, _ = recorded(fake_trtllm)
    assert argv[argv.index("--use_paged_context_fmha") + 1] == "disable" and "--kv_cache_type" in argv
    warnings = json.loads((out / "manifest.json").read_text())["warnings"]
    assert "TensorRT-LLM 1.0.0 is installed here but orin-nx-16gb runs 0.12.0-jetson: an engine only runs with " \
           "the version that built it" in warnings


def test_failing_trtllm_build_keeps_and_shows_its_log(fake_trtllm, tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "0.12.0")
    monkeypatch.setenv("FAKE_TRTLLM_FAIL", "1")
    engines = tmp_path / "engines"
    with pytest.raises(TrtllmError, match=r"(?s)exit code 1; full log kept in .*out of memory while building"):
        build_engine(BuildRequest(tiny_model, engines / "e", "int8", target="agx-orin-32gb"), log=lambda _: None)
    assert sorted(p.name for p in engines.iterdir()) == ["e.trtllm-build.log"]
    log = (engines / "e.trtllm-build.log").read_text()
    assert log.startswith("$ ") and "fake trtllm-build starting" in log and "(fake failure)" in log
    code = cabin_build(["--model", tiny_model, "--target", "agx-orin-32gb", "--output", str(engines / "e")])
    err = capsys.readouterr().err
    assert code == 2 and "cabin-build: error: trtllm-build failed" in err and "(fake failure)" in err
    assert not (engines / "e").exists()
    monkeypatch.delenv("FAKE_TRTLLM_FAIL")
    assert cabin_build(["--model", tiny_model, "--target", "agx-orin-32gb", "--output", str(engines / "e")]) == 0
    assert sorted(p.name for p in engines.iterdir()) == ["e"]  # the stale failure log is gone


def test_trtllm_build_without_importable_tensorrt_llm_is_an_error(fake_trtllm, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(FAKES)])
    with pytest.raises(TrtllmError, match="cannot import tensorrt_llm to tell its version"):
        build_engine(BuildRequest(tiny_model, tmp_path / "e", "int8", target="agx-orin-32gb"), log=lambda _: None)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("version", ["0.12.0", "1.0.0"])
def test_max_beam_width_reaches_trtllm_build_and_the_engine(fake_trtllm, tiny_model, tmp_path, monkeypatch, version):
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", version)
    out = build_engine(BuildRequest(tiny_model, tmp_path / "e", "int8", target="agx-orin-64gb", max_beam_width=4),
                       log=lambda _: None)
    argv, _ = recorded(fake_trtllm)
    assert argv[argv.index("--max_batch_size"):argv.index("--max_input_len")] == [
        "--max_batch_size", "1", "--max_beam_width", "4"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "--max-beam-width 4" in manifest["build_command"] and manifest["inputs"]["max_beam_width"] == 4
    assert manifest["plan"]["max_beam_width"] == 4 and manifest["device_step"]["command"][1:] == argv
    assert engine_max_beam_width(out / "trt_engine") == 4  # what TrtllmSession hands from_dir


def test_cabin_build_takes_max_beam_width_for_tensorrt_targets_only(fake_trtllm, tiny_model, tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "1.0.0")
    argv = ["--model", tiny_model, "--max-beam-width", "2", "--output"]
    assert cabin_build([*argv, str(tmp_path / "e"), "--target", "agx-orin-64gb"]) == 0
    args, _ = recorded(fake_trtllm)
    assert args[args.index("--max_beam_width") + 1] == "2"
    assert cabin_build([*argv, str(tmp_path / "cpu")]) == 2 and not (tmp_path / "cpu").exists()
    assert "--max-beam-width sizes a TensorRT engine's beam search" in capsys.readouterr().err


@pytest.mark.slow  # the vision graph's export
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_vision_language_engine_for_the_board_holds_the_vision_graph_and_a_prompt_table(
        fake_trtllm, tmp_path, monkeypatch, family):
    from cabinllm.benchmarks.random_vlm import write_random_vlm
    from cabinllm.runtime.model.vision import ImageLimits

    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "0.12.0")
    model = write_random_vlm(tmp_path / family, family)
    out = build_engine(BuildRequest(str(model), tmp_path / "e", "fp16", target="agx-orin-64gb"), log=lambda _: None)
    argv, _ = recorded(fake_trtllm)
    manifest = json.loads((out / "manifest.json").read_text())
    limits, max_input = ImageLimits(), int(argv[argv.index("--max_input_len") + 1])
    table = int(argv[argv.index("--max_multimodal_len") + 1])
    assert table == min(limits.max_images * limits.max_image_tokens, max_input)  # one request at a time
    built = json.loads((out / "trt_engine" / "config.json").read_text())["build_config"]
    assert built["max_prompt_embedding_table_size"] == table
    graph = manifest["vision"]["onnx"]
    assert (out / "vision" / graph["file"]).is_file() and graph["max_abs_diff_vs_torch"] < 1e-4
    assert graph["device_command"] == ["trtexec", "--onnx=vision/vision.onnx", "--fp16",
                                       "--saveEngine=vision/vision.engine"]
