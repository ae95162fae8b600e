"""cabin-build --weights int8|int4-awq: ModelOpt-quantized checkpoints with KV scales, equal to ModelOpt's own
export."""
from __future__ import annotations

import json

import pytest
import torch
from core_helpers import prefill
from conftest import TINY_ENGINE_SHAPE
from safetensors.torch import load_file

from cabinllm.benchmarks.runners.cabin import weights_note
from cabinllm.builders.engine_build import BuildRequest, build_engine
from cabinllm.calibration.hf_model import transformers_model
from cabinllm.calibration.weight_quant import calibration_tokens, modelopt_config
from cabinllm.cli.build import main as build_main
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.checkpoint import linear_inputs, load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.formats.weight_formats import WEIGHT_FORMATS, awq_group_size
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.kernels.bindings import decode_step
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.interface import Span
from cabinllm.runtime.sources.model_source import import_model

from fakes.tiny_model import write_tiny_llama

QUIET = {"log": lambda _msg: None}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """The tiny random Llama as an HF folder."""
    return write_tiny_llama(tmp_path_factory.mktemp("build-quant") / "hf", **TINY_ENGINE_SHAPE)


@pytest.fixture(scope="module", params=["int8", "int4-awq"])
def built(request, tiny_hf, tmp_path_factory):
    """(weights format, engine folder) built with INT8 KV from the tiny model."""
    folder = tmp_path_factory.mktemp("engines") / request.param
    build_engine(BuildRequest(str(tiny_hf), folder, kv_cache="int8", weights=request.param), **QUIET)
    return request.param, folder


def modelopt_export(tiny_hf, fmt_name, folder):
    """ModelOpt's own export of the tiny model (imported as fp16, calibrated on the same dialogues)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    imported = folder / "imported"
    imported.mkdir()
    import_model(tiny_hf, imported, dtype="float16")
    config, weights = load_checkpoint(imported)
    model = transformers_model(config, weights)
    group = awq_group_size(list(linear_inputs(config).values()))  # 64: the MLP has 64 inputs
    tokens = calibration_tokens("builtin", ChatTokenizer(imported))
    with torch.no_grad():
        mtq.quantize(model, modelopt_config(WEIGHT_FORMATS[fmt_name], group),
                     lambda m: [m(torch.tensor([ids])) for ids in tokens])
    export_tensorrt_llm_checkpoint(model, "llama", torch.float16, export_dir=folder / "export",
                                   inference_tensor_parallel=1)
    return folder / "export"


def test_checkpoint_equals_modelopts_own_export(built, tiny_hf, tmp_path):
    """Tensor names, dtypes, shapes, values and the quantization block equal ModelOpt's export of the same model;
    ours adds the INT8 KV algorithm and each layer's kv_cache_scaling_factor."""
    name, folder = built
    ours = load_file(folder / CHECKPOINT_DIR / "rank0.safetensors")
    ours_config = json.loads((folder / CHECKPOINT_DIR / "config.json").read_text())
    export = modelopt_export(tiny_hf, name, tmp_path)
    theirs = load_file(export / "rank0.safetensors")
    theirs_config = json.loads((export / "config.json").read_text())
    kv = {n for n in ours if n.endswith("kv_cache_scaling_factor")}
    assert len(kv) == 3 and set(ours) - kv == set(theirs)
    for tensor, value in theirs.items():
        assert (ours[tensor].dtype, ours[tensor].shape) == (value.dtype, value.shape), tensor
        assert torch.equal(ours[tensor], value), tensor
    assert ours_config["quantization"] == {**theirs_config["quantization"], "kv_cache_quant_algo": "INT8"}
    algo = {"int8": "W8A16", "int4-awq": "W4A16_AWQ"}[name]
    assert ours_config["quantization"]["quant_algo"] == algo


def test_built_engine_runs_and_records_its_weights(built):
    """The engine loads on the reference engine with its INT8 KV, answers, and the manifest names its weights."""
    name, folder = built
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["weights"]["format"] == name and manifest["weights"]["quantized_by"] == "nvidia-modelopt"
    assert "--weights " + name in manifest["build_command"]
    engine = Engine.load(folder)
    assert engine.config.weight_format.name == name
    ids = engine.tokenizer.encode_prompt(engine.tokenizer.render([{"role": "user", "content": "play some jazz"}]))
    logits = run_tokens(engine.model, ids, "int8", engine.scales, all_logits=True).logits
    assert torch.isfinite(logits).all()
    assert weights_note(engine, "int8").startswith(engine.config.weight_format.label)  # cabin-bench's row says so


def test_imports_a_modelopt_checkpoint_folder(built, tmp_path, capsys):
    """cabin-build --model CKPT_DIR takes a quantized TensorRT-LLM checkpoint folder and keeps its weights; asked
    for another format, it says which to use."""
    name, folder = built
    out = tmp_path / "again"
    assert build_main(["--model", str(folder / CHECKPOINT_DIR), "--output", str(out), "--kv-cache", "fp16"]) == 0
    assert Engine.load(out).config.weight_format.name == name
    other = "int8" if name == "int4-awq" else "int4-awq"
    bare = tmp_path / "bare"  # as ModelOpt 0.47 exports under transformers 5: no rotary_base
    bare.mkdir()
    for f in (folder / CHECKPOINT_DIR).iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    data = json.loads((bare / "config.json").read_text())
    del data["rotary_base"]
    (bare / "config.json").write_text(json.dumps(data))
    assert build_main(["--model", str(bare), "--output", str(tmp_path / "y")]) == 2
    assert "no rotary_base" in capsys.readouterr().err
    assert build_main(["--model", str(folder / CHECKPOINT_DIR), "--output", str(tmp_path / "x"),
                       "--weights", other]) == 2
    assert f"build it with --weights {name}" in capsys.readouterr().err


def test_decoding_on_the_quantized_kernels_matches_prefill(built):
    """Token-by-token decode (one-token steps: the fused decode step over the int8 / int4 kernels where it builds)
    gives the logits of one prefill over the same tokens (torch path on dequantized weights), to float rounding."""
    _, folder = built
    engine = Engine.load(folder)
    message = {"role": "user", "content": "set cabin temperature"}
    ids = engine.tokenizer.encode_prompt(engine.tokenizer.render([message]))
    prefill = run_tokens(engine.model, ids, "fp32", all_logits=True)
    prefilled = run_tokens(engine.model, ids[:1], "fp32", cache=engine.new_cache(KvCacheConfig("fp32")))
    cache, seq = prefilled.cache, prefilled.seq
    calls = decode_step.cache_info().hits
    for pos in range(1, len(ids)):
        cache.append(seq, ids[pos:pos + 1])
        step = engine.model.forward(ids[pos:pos + 1], pos, cache, seq)
        assert torch.allclose(step, prefill.logits[pos], atol=1e-4 * prefill.logits.abs().max()), pos
    c = engine.config
    if engine.model.native_kernels and decode_step(torch.float32, c.head_size,
                                                   c.num_attention_heads // c.num_key_value_heads) is not None:
        assert decode_step.cache_info().hits - calls >= len(ids) - 1  # each step fused


def test_batched_decode_on_quantized_weights_matches_each_sequence_alone(built):
    """A step of several sequences (the server's batched decode) runs the int8 / int4 kernels for all its tokens
    and gives each sequence the logits it gets alone, to float rounding."""
    _, folder = built
    engine = Engine.load(folder)
    prompts = [[1, 5, 9, 2], [3, 8, 8, 4, 6, 2, 7], [11, 2]]
    cache = engine.new_cache(KvCacheConfig("int8", 1 << 20))
    seqs = [Sequence() for _ in prompts]
    for seq, prompt in zip(seqs, prompts):
        prefill(engine.model, cache, seq, prompt)
    spans = [Span([4], len(seq), seq) for seq in seqs]  # one token each, in one step, as the scheduler decodes
    for seq in seqs:
        cache.append(seq, [4])
    batched = engine.model.step(spans, cache)
    for prompt, row in zip(prompts, batched):
        alone_cache = engine.new_cache(KvCacheConfig("int8", 1 << 20))
        alone = Sequence()
        prefill(engine.model, alone_cache, alone, prompt)
        alone_cache.append(alone, [4])
        want = engine.model.forward([4], len(prompt), alone_cache, alone)
        assert torch.allclose(row, want, atol=1e-4 * want.abs().max())


def test_int4_g32_and_the_int8_head_are_refused_where_tensorrt_runs(tiny_hf, tmp_path, capsys):
    """TensorRT-LLM's W4A16 kernels take symmetric groups of 64 / 128 and its runtime reads an fp16 head: both
    are refused on a TensorRT target before any work, naming what runs them; nothing is written."""
    out = tmp_path / "out"
    args = ["--model", str(tiny_hf), "--output", str(out), "--target", "orin-nano-8gb", "--kv-cache", "fp16"]
    assert build_main([*args, "--weights", "int4-g32"]) == 2
    err = capsys.readouterr().err
    assert "TensorRT-LLM W4A16 kernels take symmetric groups of 64 / 128" in err and "--target cpu" in err
    assert build_main([*args, "--head", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--head int8 runs on the reference engine only" in err and "Traceback" not in err
    assert not out.exists()
