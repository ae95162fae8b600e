"""Quantized TensorRT-LLM checkpoints (W8A16, W4A16-AWQ) exported by ModelOpt run on the reference engine."""
from __future__ import annotations

import json

import pytest
import torch

from cabinllm.calibration.hf_model import transformers_model
from cabinllm.calibration.weight_quant import calibration_tokens, quantize_weights, round_to_nearest
from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import load_checkpoint, save_checkpoint
from cabinllm.runtime.formats.weight_formats import WEIGHT_FORMATS
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.model.linear import linear_op, pack_int4, unpack_int4
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import import_model

from fakes.tiny_model import write_tiny_llama

SHAPE = {"hidden_size": 128, "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rope_theta": 100000.0}  # not TensorRT-LLM's default rotary_base: it must survive the export
IDS = [1, 4, 7, 9, 3, 12, 15, 8, 6, 20, 2, 11, 13, 5, 17, 19, 10, 14, 16, 18, 21, 7, 8, 9]


@pytest.fixture(scope="module")
def fp_checkpoint(tmp_path_factory):
    """A tiny random Llama imported as a float32 checkpoint: (config, weights)."""
    root = tmp_path_factory.mktemp("quant")
    (root / "fp32").mkdir()
    import_model(write_tiny_llama(root / "hf", **SHAPE), root / "fp32", dtype="float32")
    return load_checkpoint(root / "fp32")


@pytest.fixture(scope="module", params=["int8", "int4-awq"])
def exported(request, fp_checkpoint, tmp_path_factory):
    """The ModelOpt export of the tiny model in one weight format, saved and loaded back as a checkpoint."""
    config, weights = quantize_weights(*fp_checkpoint, WEIGHT_FORMATS[request.param], [IDS, IDS[::-1]],
                                       progress=False)
    folder = tmp_path_factory.mktemp(request.param)
    save_checkpoint(folder, config, weights)
    return request.param, folder


def logits(config, weights, ids=IDS) -> torch.Tensor:
    """Every position's logits on the reference engine (fp32 KV)."""
    return run_tokens(Transformer(config, weights), ids, "fp32", None, all_logits=True).logits


def test_int4_packing_is_modelopts(fp_checkpoint):
    """Our packing equals ModelOpt's pack_int4_in_uint8 (even rows in the low nibble) and unpacks back."""
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    weight = torch.randn(6, 128)
    scale = weight.view(6, 2, 64).abs().amax(-1) / 7
    q = (weight / scale.repeat_interleave(64, dim=1)).round().clamp(-8, 7)
    theirs = pack_int4_in_uint8(weight, scale, 64).view(torch.int8)
    assert torch.equal(pack_int4(q), theirs)
    assert torch.equal(unpack_int4(theirs), q.to(torch.int8))


def test_exported_checkpoint_matches_transformers_on_dequantized_weights(exported, fp_checkpoint):
    """The reference engine on a ModelOpt W8A16 / W4A16-AWQ checkpoint matches transformers' forward on the
    dequantized weights within 1e-3, and differs from the full-precision model (the weights are quantized)."""
    name, folder = exported
    config, weights = load_checkpoint(folder)
    algo = {"int8": "W8A16", "int4-awq": "W4A16_AWQ"}[name]
    assert config.quantization["quant_algo"] == algo
    assert config.rotary_base == fp_checkpoint[0].rotary_base == 100000.0
    assert weights["transformer.layers.0.attention.qkv.weight"].dtype == torch.int8
    ours = logits(config, weights)
    with torch.no_grad():
        reference = transformers_model(config, weights)(torch.tensor([IDS])).logits[0]
    assert (ours - reference).abs().max() < 1e-3
    vocab = fp_checkpoint[0].vocab_size  # AWQ export pads the vocabulary to a multiple of 64
    full = logits(*fp_checkpoint)
    error = (ours[:, :vocab] - full).abs().mean()
    assert 1e-4 < error < full.abs().mean()  # int4 on random weights is coarse: RTN is off by as much


def test_round_to_nearest_runs_in_the_awq_format(fp_checkpoint, tmp_path):
    """RTN int4 on the same groups is a valid W4A16_AWQ checkpoint; each weight is off by at most half a step."""
    config, weights = round_to_nearest(*fp_checkpoint)
    save_checkpoint(tmp_path, config, weights)
    config, weights = load_checkpoint(tmp_path)
    assert config.quantization["group_size"] == 64  # the MLP's 192 inputs are not a multiple of 128
    op = linear_op(config.weight_format, {s: weights[f"transformer.layers.1.mlp.proj.{s}"]
                                      for s in config.weight_format.tensors}, config.quantization)
    original = fp_checkpoint[1]["transformer.layers.1.mlp.proj.weight"]
    step = op.scale.repeat_interleave(64, dim=1)
    assert ((op.dequantize() - original).abs() <= step / 2 + 1e-6).all()
    assert torch.isfinite(logits(config, weights)).all()


def _edit(folder, change_config=None, drop=None):
    from safetensors.torch import load_file, save_file

    if change_config:
        data = json.loads((folder / "config.json").read_text())
        change_config(data["quantization"])
        (folder / "config.json").write_text(json.dumps(data))
    if drop:
        weights = load_file(folder / "rank0.safetensors")
        del weights[drop]
        save_file(weights, folder / "rank0.safetensors")


@pytest.mark.parametrize("change, drop, message", [
    (lambda q: q.update(quant_algo="W4A8_AWQ"), None, "quant_algo 'W4A8_AWQ' is not run by the reference engine"),
    (lambda q: q.update(group_size=96), None, "group_size 96 does not divide the 128 inputs of attention.qkv"),
    (None, "transformer.layers.1.mlp.proj.weights_scaling_factor",
     "tensor transformer.layers.1.mlp.proj.weights_scaling_factor is missing"),
])
def test_bad_quantized_checkpoint_is_one_clear_error(fp_checkpoint, tmp_path, change, drop, message):
    """Unknown quant_algo, a group size that does not divide an input size, missing scales: one error naming it."""
    save_checkpoint(tmp_path, *round_to_nearest(*fp_checkpoint))
    _edit(tmp_path, change, drop)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_checkpoint(tmp_path)
    assert "again" in str(err.value) or "rebuild" in str(err.value)


@pytest.mark.parametrize("name", ["int8", "int4-awq"])
def test_default_model_exported_by_modelopt_matches_transformers(default_engine_dir, name):
    """The default model quantized and exported by ModelOpt (one short calibration dialogue) runs on the reference
    engine; its logits match transformers' forward on the dequantized weights within 1e-3."""
    config, weights = load_checkpoint(default_engine_dir / "checkpoint")
    tokenizer_ids = calibration_tokens("builtin", ChatTokenizer(default_engine_dir / "checkpoint"), count=1,
                                       max_tokens=64)
    config, weights = quantize_weights(config, weights, WEIGHT_FORMATS[name], tokenizer_ids, progress=False)
    assert config.quantization["quant_algo"] == {"int8": "W8A16", "int4-awq": "W4A16_AWQ"}[name]
    assert config.quantization.get("group_size", 64) == 64  # hidden size 576 is not a multiple of 128
    ids = tokenizer_ids[0][:32]
    ours = logits(config, weights, ids)
    with torch.no_grad():
        reference = transformers_model(config, weights)(torch.tensor([ids])).logits[0]
    assert (ours - reference).abs().max() < 1e-3
