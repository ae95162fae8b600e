"""cabin-build on the reference path: KV scales into the checkpoint, same logits as the runtime, no-op, bad input."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import PlanRefused, ScalesError, TargetError
from cabinllm.runtime.formats.checkpoint import layer_prefix, load_checkpoint
from cabinllm.runtime.formats.scales_file import (KVScales, LayerRanges, load_scales, load_scales_file,
                                                  model_fingerprint, save_scales)
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import import_model

from fakes.tiny_model import write_tiny_llama

PROMPT = [1, 4, 3, 6, 7, 8, 9, 2, 1, 5, 10, 11, 12]  # ids of the tiny vocabulary
SCALE = "attention.kv_cache_scaling_factor"


def quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A tiny HF model, its plain fp16 checkpoint and a scales file with chosen per-layer K/V scales."""
    root = tmp_path_factory.mktemp("tiny")
    model = write_tiny_llama(root / "model")
    plain = root / "plain"
    plain.mkdir()
    import_model(model, plain, dtype="float16")
    config, weights = load_checkpoint(plain)
    scales = KVScales(k=[0.021, 0.034, 0.055], v=[0.013, 0.047, 0.029])
    scales_path = root / "kv_scales.json"
    save_scales(scales_path, scales, model_fingerprint(config, weights), "test", {})
    return {"root": root, "model": model, "config": config, "weights": weights, "scales": scales_path}


def logits_of(model: Transformer, cache: PagedKVCache, seq: Sequence | None = None) -> torch.Tensor:
    seq = Sequence() if seq is None else seq
    cache.allocate(seq, PROMPT)
    return model.forward(PROMPT, 0, cache, seq, all_logits=True)


def test_int8_checkpoint_carries_the_file_scales_and_matches_the_runtime(tiny, tmp_path):
    out = build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", "int8", scales=tiny["scales"]), log=quiet)
    config, weights = load_checkpoint(out / "checkpoint")
    assert config.quantization["kv_cache_quant_algo"] == "INT8"
    shared = [0.021, 0.047, 0.055]  # max(k, v) per layer
    for layer, scale in enumerate(shared):
        factor = weights[f"{layer_prefix(layer)}.{SCALE}"]
        assert factor.dtype == torch.float32 and factor.shape == (1,)
        assert factor.item() == pytest.approx(scale, rel=1e-7)
    assert (out / "kv_scales.json").read_bytes() == tiny["scales"].read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_scales"]["input_sha256"] == manifest["kv_scales"]["sha256"]
    assert manifest["device_step"]["status"] == "not needed" and manifest["backend"] == "reference"

    engine = Engine.load(out)
    built = logits_of(engine.model, engine.new_cache(KvCacheConfig("int8", 1 << 20, 16)))
    scales = load_scales(tiny["scales"], model_fingerprint(tiny["config"], tiny["weights"]), 3)
    direct = Transformer(tiny["config"], tiny["weights"])
    reference = logits_of(direct, PagedKVCache(direct.kv_layout, KvCacheConfig("int8", 1 << 20, 16), scales))
    assert torch.equal(built, reference)


def test_fp8_for_thor_stores_amax_over_448_and_leaves_the_device_step(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no trtllm-build here
    out = build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", "fp8", target="thor-128gb",
                                    scales=tiny["scales"]), log=quiet)
    config, weights = load_checkpoint(out / "checkpoint")
    assert config.quantization["kv_cache_quant_algo"] == "FP8"
    assert weights[f"{layer_prefix(1)}.{SCALE}"].item() == pytest.approx(0.047 * 127 / 448, rel=1e-6)
    storage = Engine.load(out).new_cache().storage  # the reference engine stores what TensorRT-LLM will read
    assert storage.name == "fp8" and storage.k_data.dtype == torch.float8_e4m3fn
    for layer in range(config.num_hidden_layers):
        factor = weights[f"{layer_prefix(layer)}.{SCALE}"].item()
        assert storage.k_scale[layer] == storage.v_scale[layer] == pytest.approx(factor, rel=1e-6)
    step = json.loads((out / "manifest.json").read_text())["device_step"]
    assert (step["status"], step["flags"]) == ("pending", "1.x")
    assert step["command"] == [
        "trtllm-build", "--checkpoint_dir", "checkpoint", "--output_dir", "trt_engine", "--gemm_plugin", "auto",
        "--kv_cache_type", "paged", "--tokens_per_block", "32", "--use_paged_context_fmha", "enable",
        "--max_batch_size", "1", "--max_beam_width", "1", "--max_input_len", "768", "--max_seq_len", "1024",
        "--max_num_tokens", "768"]
    assert step["then"] == ["cabin-chat", "--engine", ".", "--backend", "tensorrt-llm"]  # in the engine folder too


def test_same_inputs_are_a_no_op_unless_forced(tiny, tmp_path):
    request = BuildRequest(str(tiny["model"]), tmp_path / "e", "int8", scales=tiny["scales"])
    build_engine(request, log=quiet)
    manifest = tmp_path / "e" / "manifest.json"
    first = manifest.stat().st_mtime_ns
    lines: list[str] = []
    build_engine(request, log=lines.append)
    assert manifest.stat().st_mtime_ns == first and lines == [f"{tmp_path / 'e'} is up to date (same inputs); "
                                                              "pass --force to build it again"]
    request.force = True
    build_engine(request, log=lines.append)
    assert manifest.stat().st_mtime_ns != first and lines[-1].startswith("engine written to")


def test_output_from_other_inputs_or_not_an_engine_is_refused(tiny, tmp_path):
    build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", "int8", scales=tiny["scales"]), log=quiet)
    with pytest.raises(FileExistsError, match=r"built from other inputs \(differs in: kv_cache\); pass --force"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", "fp16", scales=tiny["scales"]), log=quiet)
    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an engine folder"):
        build_engine(BuildRequest(str(tiny["model"]), keep, "int8", force=True), log=quiet)
    assert (keep / "todo.txt").read_text() == "mine"


def test_bad_input_leaves_nothing_half_written(tiny, tmp_path):
    with pytest.raises(TargetError, match="unknown target 'orin'; known targets: orin-nano-8gb, orin-nx-16gb"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "a", target="orin"), log=quiet)
    other = tmp_path / "other_scales.json"
    save_scales(other, KVScales(k=[0.1] * 3, v=[0.1] * 3), "0123456789abcdef", "test", {})
    with pytest.raises(ScalesError, match="made for model 0123456789abcdef, not this one"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "b", scales=other), log=quiet)
    with pytest.raises(PlanRefused, match="int8 KV cache does not work on thor-128gb.*nearest working config: "
                                          "--target thor-128gb --kv-cache fp8"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "c", target="thor-128gb"), log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_scales.json"]


def test_built_engine_checkpoint_scales_equal_its_scales_file(engine_dir):
    config, weights = load_checkpoint(engine_dir / "checkpoint")
    doc = json.loads((engine_dir / "kv_scales.json").read_text())
    assert len(doc["layers"]) == config.num_hidden_layers
    for entry in doc["layers"]:
        factor = weights[f"{layer_prefix(entry['layer'])}.{SCALE}"]
        assert factor.dtype == torch.float32 and factor.shape == (1,)
        assert factor.item() == pytest.approx(max(entry["k"], entry["v"]), rel=1e-7)
        assert math.isclose(entry["kv_cache_scaling_factor"], max(entry["k"], entry["v"]))


def test_equalized_fp8_is_warned(tiny, tmp_path, monkeypatch):
    from cabinllm.cli import build

    monkeypatch.setattr(build, "build_engine", lambda request, log: None)
    args = ["--model", str(tiny["model"]), "--target", "thor-128gb", "--kv-cache", "fp8", "--output", str(tmp_path)]
    with pytest.warns(UserWarning, match=r"equalization is made for int8's grid.*fp8 KV's KL from 0.0097 to 0.0117"):
        assert build.main(args + ["--equalize"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build.main(args) == 0


def test_cli_reports_errors_with_exit_code_2(tiny, tmp_path, capsys):
    from cabinllm.cli.build import main

    code = main(["--model", str(tiny["model"]), "--target", "orin-nano-8gb", "--kv-cache", "fp8",
                 "--output", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2
    assert "cabin-build: error: fp8 KV cache does not work on orin-nano-8gb: Orin (SM87) has no FP8" in err
    assert "--target orin-nano-8gb --kv-cache int8" in err and not (tmp_path / "x").exists()


def test_model_path_must_exist(tmp_path):
    with pytest.raises(ValueError, match="no such model file or folder"):
        build_engine(BuildRequest(str(tmp_path / "missing"), tmp_path / "e"), log=quiet)
    assert not (tmp_path / "e").exists()


def measured_ranges(model: Transformer) -> list[LayerRanges]:
    """Per-channel K/V abs-max of each layer over PROMPT, from a full-precision cache."""
    cache = PagedKVCache(model.kv_layout, KvCacheConfig("fp32", 1 << 20, 16))
    seq = Sequence()
    logits_of(model, cache, seq)
    table = cache.block_table(seq)
    ranges = []
    for layer in range(model.kv_layout.num_layers):
        k, v = cache.storage.read(layer, table, len(PROMPT))
        ranges.append(LayerRanges(k.abs().amax(0).tolist(), v.abs().amax(0).tolist()))
    return ranges


def test_equalize_folds_factors_and_keeps_full_precision_outputs(tiny, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    import_model(tiny["model"], plain, dtype="float32")
    config, weights = load_checkpoint(plain)
    model = Transformer(config, weights)
    ranges = measured_ranges(model)
    scales = KVScales(k=[max(map(max, r.k_channel_amax)) / 127 for r in ranges],
                      v=[max(map(max, r.v_channel_amax)) / 127 for r in ranges])
    scales_path = tmp_path / "kv_scales.json"
    save_scales(scales_path, scales, model_fingerprint(config, weights), "max", {}, ranges)
    out = build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", "int8", dtype="float32",
                                    scales=scales_path, equalize=True), log=quiet)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["equalization"] == {"enabled": True} and manifest["kv_scales"]["method"] == "max+equalized"
    written = load_scales_file(out / "kv_scales.json", model_fingerprint(config, weights), 3)
    assert written.equalized
    _, eq_weights = load_checkpoint(out / "checkpoint")
    for layer, shared in enumerate(written.scales.shared()):
        assert eq_weights[f"{layer_prefix(layer)}.{SCALE}"].item() == pytest.approx(shared, rel=1e-7)
    assert not torch.equal(eq_weights[f"{layer_prefix(0)}.attention.qkv.weight"],
                           weights[f"{layer_prefix(0)}.attention.qkv.weight"])
    engine = Engine.load(out)
    fp32 = KvCacheConfig("fp32", 1 << 20, 16)
    torch.testing.assert_close(logits_of(engine.model, engine.new_cache(fp32)),
                               logits_of(model, PagedKVCache(model.kv_layout, fp32)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ScalesError, match="belong to equalized weights"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "f", scales=out / "kv_scales.json"), log=quiet)


def test_equalize_needs_calibrated_ranges(tiny, tmp_path):
    with pytest.raises(ScalesError, match="--equalize needs calibrated per-channel ranges"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", equalize=True), log=quiet)
    with pytest.raises(ScalesError, match="--equalize needs per-channel K/V ranges"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", scales=tiny["scales"], equalize=True), log=quiet)
    assert not (tmp_path / "e").exists()


def test_calibrate_builtin_with_equalize(tiny, tmp_path):
    lines: list[str] = []
    out = build_engine(BuildRequest(str(tiny["model"]), tmp_path / "e", "int8", calibrate="builtin", equalize=True),
                       log=lines.append)
    assert "[2/4] calibrating KV scales on builtin dialogues and folding KV equalization into the weights" in lines
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_scales"]["method"].startswith("kl:") and manifest["kv_scales"]["method"].endswith("+equalized")
    assert manifest["kv_scales"]["source"] == "calibrated on builtin dialogues"
    written = load_scales_file(out / "kv_scales.json", model_fingerprint(tiny["config"], tiny["weights"]), 3)
    assert written.equalized and written.data["dialogues"] == 2 and written.data["sessions"]  # the default run
    _, weights = load_checkpoint(out / "checkpoint")
    for layer, shared in enumerate(written.scales.shared()):
        assert weights[f"{layer_prefix(layer)}.{SCALE}"].item() == pytest.approx(shared, rel=1e-7)
    with pytest.raises(ScalesError, match="either --scales FILE or --calibrate DATA, not both"):
        build_engine(BuildRequest(str(tiny["model"]), tmp_path / "f", scales=tiny["scales"], calibrate="builtin"),
                     log=quiet)
