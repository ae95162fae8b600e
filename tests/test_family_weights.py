"""Qwen3, Gemma 3 and Phi-3 as transformers models rebuilt from our checkpoint (cabinllm.calibration.hf_model) and
quantized by ModelOpt (cabin-build --weights int8 | int4-awq).

The models are tests/test_families.py's (its FAMILIES: Gemma 3 with four layers alternating local and global over a
window of 8, Phi-3 with partial rotary and LongRoPE), widened so every linear input divides AWQ's group of 64:
hidden 64, intermediate 128, four heads of 16 over two KV heads. Random weights prove mechanics only: the int4
bound is on each weight (AWQ's groups leave about 11% of a random matrix's norm), since ten percent per layer
compounds through the logits of a random model.
"""
from __future__ import annotations

import pytest
import torch
from test_families import FAMILIES, long_prompt, write_family_folder
from test_hf_folders import cabin_build

from cabinllm.calibration.hf_model import transformers_model
from cabinllm.cli import build as build_cli
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.checkpoint import layer_prefix, load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.formats.weight_formats import LINEAR_LAYERS
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.model.linear import full_precision, linear_op

WIDER = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
QUANTIZED = {"int8": "W8A16", "int4-awq": "W4A16_AWQ"}


def build(folder, output, *options: str) -> Engine:
    """cabin-build of an HF folder for the CPU (fp32 KV), loaded."""
    return Engine.load(cabin_build(folder, output, "fp32", options))


@pytest.fixture(scope="module", params=["Qwen3", "Gemma3", "Phi3"])
def family(request, tmp_path_factory) -> dict:
    """One family's transformers model, its fp32 engine and its W8A16 and W4A16-AWQ engines."""
    root = tmp_path_factory.mktemp(f"weights-{request.param.lower()}")
    wider = {name: (config, model, {**extra, **WIDER}) for name, (config, model, extra) in FAMILIES.items()}
    model = write_family_folder(root / "hf", request.param, 3, wider)
    engines = {"fp32": build(root / "hf", root / "fp32", "--dtype", "float32")}
    for name in QUANTIZED:
        engines[name] = build(root / "hf", root / name, "--weights", name)
    # past Gemma's window; within Phi's original context (64), where transformers takes the short factors
    ids = long_prompt(engines["fp32"])[:60]
    return {"family": request.param, "model": model, "engines": engines, "ids": ids}


def logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Every position's logits on the reference engine (fp32 KV), over the model's own vocabulary."""
    return run_tokens(engine.model, ids, "fp32", all_logits=True).logits


def test_transformers_model_of_the_checkpoint_is_the_original(family):
    """The family's transformers model rebuilt from the fp32 checkpoint (names mapped back, Gemma's 1 + weight
    norms undone, Phi-3's qkv_proj and gate_up_proj fused again) gives the original model's logits, and ours."""
    engine, ids = family["engines"]["fp32"], family["ids"]
    rebuilt = transformers_model(*load_checkpoint(engine.folder / CHECKPOINT_DIR))
    assert type(rebuilt) is type(family["model"])
    with torch.no_grad():
        theirs = family["model"](torch.tensor([ids])).logits[0]
        ours = rebuilt(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits(engine, ids), theirs, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_modelopt_quantized_engine_is_complete_and_close(family, name):
    """cabin-build --weights int8 | int4-awq writes a complete checkpoint (the family's norms as they were) that
    runs on the reference engine as transformers runs its dequantized weights; each linear is the fp32 one to
    int8 / int4 precision (a tensor under another's name would be off by its whole norm), and the int8 logits
    stay close to the fp32 engine's (int4's within the loose bound random weights allow)."""
    quantized, full = family["engines"][name], family["engines"]["fp32"]
    ids, vocab = family["ids"], full.config.vocab_size
    config, weights = load_checkpoint(quantized.folder / CHECKPOINT_DIR)  # validates every tensor
    assert config.quantization["quant_algo"] == QUANTIZED[name]
    assert (config.qk_layernorm, config.inter_layernorms, config.rotary_dim) == (
        full.config.qk_layernorm, full.config.inter_layernorms, full.config.rotary_dim)
    _, fp_weights = load_checkpoint(full.folder / CHECKPOINT_DIR)
    for tensor, value in fp_weights.items():  # norms (Gemma's as 1 + weight), embeddings: the fp32 ones in fp16
        if not tensor.removesuffix(".weight").endswith(LINEAR_LAYERS):
            assert torch.equal(weights[tensor][:len(value)], value.half()), tensor
    fmt = config.weight_format
    for layer in range(config.num_hidden_layers):
        for linear in LINEAR_LAYERS:
            base = f"{layer_prefix(layer)}.{linear}"
            w = full_precision(linear_op(fmt, {s: weights[f"{base}.{s}"] for s in fmt.tensors}, config.quantization))
            original = fp_weights[f"{base}.weight"]
            assert (w - original).norm() < {"int8": 0.02, "int4-awq": 0.2}[name] * original.norm(), base
    ours = logits(quantized, ids)
    with torch.no_grad():
        reference = transformers_model(config, weights)(torch.tensor([ids])).logits[0]
    assert (ours - reference).abs().max() < 1e-3
    fp32, ours = logits(full, ids), ours[:, :vocab]  # an AWQ export pads the vocabulary to a multiple of 64
    if name == "int8":
        assert (ours - fp32).abs().max() < 0.25 * fp32.abs().max()
    else:  # int4 compounds through a random model (up to half the mean logit); unrelated logits differ by ~1.4x
        assert (ours - fp32).abs().mean() < 0.75 * fp32.abs().mean()


def test_int4_awq_refuses_inputs_no_group_divides(tmp_path, capsys):
    """test_families' own Phi-3 (hidden 32, intermediate 37): no AWQ group of 128 or 64 divides its inputs, so
    cabin-build --weights int4-awq stops before quantizing with the error that says to use int8."""
    write_family_folder(tmp_path / "hf", "Phi3", seed=0)
    code = build_cli.main(["--model", str(tmp_path / "hf"), "--target", "cpu", "--kv-cache", "fp32", "--weights",
                           "int4-awq", "--output", str(tmp_path / "engine")])
    assert code == 2
    err = capsys.readouterr().err
    assert "no AWQ group size of 128, 64 divides the input sizes [32, 37]; use --weights int8" in err
