"""HF folders as transformers itself writes them (Llama, Mistral, Qwen2 with its q/k/v biases), tokenizer beside
them: cabin-build makes an engine whose logits are transformers' own, cabin-plan and cabin-export take the folder
or its engine, and the memory model counts every tensor the checkpoint holds, biases included."""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_cli_errors import run_cli
from tokenizers import Tokenizer, models, pre_tokenizers

from cabinllm.builders.memory_model import parameter_count, weights_bytes
from cabinllm.cli import build as build_cli
from cabinllm.cli import export as export_cli
from cabinllm.cli import plan as plan_cli
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.checkpoint import load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.formats.weight_formats import WEIGHT_FORMATS
from cabinllm.runtime.model.run_tokens import run_tokens

WORDS = "navigate to the nearest charging station play some jazz".split()
SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
MESSAGES = [{"role": "system", "content": "play some jazz"},
            {"role": "user", "content": "navigate to the nearest charging station"}]
# tiny shapes; a context that holds the planner's four dialogue turns
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 2048}
FAMILIES = {"Llama": {"tie_word_embeddings": False}, "Mistral": {"tie_word_embeddings": False},
            "Qwen2": {"tie_word_embeddings": True}}  # small Qwen2 models ship tied embeddings
KV_SCALE = "kv_cache_scaling_factor"


def write_tokenizer(folder: Path) -> int:
    """A WordLevel tokenizer with a chat template and eos, saved by transformers; returns its vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", unk_token="<unk>",
                            additional_special_tokens=["<|im_start|>"],
                            chat_template=TEMPLATE).save_pretrained(folder)
    return len(vocab)


def write_hf_folder(folder: Path, family: str, seed: int, **overrides: object) -> torch.nn.Module:
    """``{family}ForCausalLM`` with random weights (biases and norms too), saved by ``save_pretrained`` beside a
    tokenizer; returns the model (float32, eval mode)."""
    import transformers

    vocab_size = write_tokenizer(folder)
    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, f"{family}ForCausalLM")
    config = config_class(vocab_size=vocab_size, **SHAPE, **{**FAMILIES[family], **overrides})
    model = model_class(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: make every tensor count
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)
    return model


def cabin_build(folder: Path, engine: Path, kv_cache: str = "int8", options: tuple = ("--dtype", "float32")) -> Path:
    """``cabin-build --target cpu`` of an HF folder into ``engine`` (asserting it succeeds, its log in the message
    where not: module-scoped fixtures have no capsys)."""
    log = io.StringIO()
    with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
        code = build_cli.main(["--model", str(folder), "--target", "cpu", "--kv-cache", kv_cache, *options,
                               "--output", str(engine)])
    assert code == 0, log.getvalue()
    return engine


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory) -> dict:
    """One family's HF folder, its transformers model and its engine (cabin-build --kv-cache int8, float32)."""
    root = tmp_path_factory.mktemp(request.param.lower())
    folder, engine = root / "hf", root / "engine"
    model = write_hf_folder(folder, request.param, seed=list(FAMILIES).index(request.param))
    return {"family": request.param, "folder": folder, "model": model, "engine": cabin_build(folder, engine)}


def prompt_ids(engine: Engine) -> list[int]:
    """The chat prompt of MESSAGES as the engine's tokenizer encodes it."""
    return engine.tokenizer.encode_prompt(engine.tokenizer.render(MESSAGES))


def test_checkpoint_holds_the_stacked_qkv_and_its_bias(built):
    hf_config = json.loads((built["folder"] / "config.json").read_text())
    assert hf_config["architectures"] == [f"{built['family']}ForCausalLM"]
    _, weights = load_checkpoint(built["engine"] / CHECKPOINT_DIR)
    state = built["model"].state_dict()
    has_bias = built["family"] == "Qwen2"
    assert any(name.endswith("q_proj.bias") for name in state) == has_bias  # as transformers writes the family
    for layer in range(SHAPE["num_hidden_layers"]):
        p, hf = f"transformer.layers.{layer}.attention.qkv", f"model.layers.{layer}.self_attn"
        assert torch.equal(weights[f"{p}.weight"], torch.cat([state[f"{hf}.{n}_proj.weight"] for n in "qkv"]))
        if has_bias:
            assert torch.equal(weights[f"{p}.bias"], torch.cat([state[f"{hf}.{n}_proj.bias"] for n in "qkv"]))
        else:
            assert f"{p}.bias" not in weights


def test_engine_logits_are_transformers_own(built):
    engine = Engine.load(built["engine"])
    assert engine.manifest["kv_cache"] == "int8" and engine.config.qkv_bias == (built["family"] == "Qwen2")
    ids = prompt_ids(engine)
    assert len(ids) > 8 and 0 not in ids  # every word is in the vocabulary
    with torch.no_grad():
        theirs = built["model"](torch.tensor([ids])).logits[0]
    exact = run_tokens(engine.model, ids, "fp32", all_logits=True).logits
    torch.testing.assert_close(exact, theirs, atol=1e-4, rtol=0)
    int8 = run_tokens(engine.model, ids, "int8", engine.scales, all_logits=True).logits  # the mode it was built for
    assert (int8 - theirs).abs().max() < 0.1 * theirs.abs().max()


def test_tokenizer_renders_and_stops_as_transformers(built):
    from transformers import PreTrainedTokenizerFast  # AutoTokenizer would take Qwen2's BPE class for WordLevel

    engine, hf = Engine.load(built["engine"]), PreTrainedTokenizerFast.from_pretrained(built["folder"])
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert engine.tokenizer.render(MESSAGES) == text
    assert prompt_ids(engine) == hf.encode(text, add_special_tokens=False)
    assert engine.stop_token_ids() == [hf.eos_token_id]


def test_memory_model_counts_every_stored_tensor(built):
    config, weights = load_checkpoint(built["engine"] / CHECKPOINT_DIR)
    stored = {name: t for name, t in weights.items() if not name.endswith(KV_SCALE)}
    assert weights_bytes(config, "fp16", "fp32") == sum(t.numel() * t.element_size() for t in stored.values())
    assert weights_bytes(config, "fp16") == 2 * sum(t.numel() for t in stored.values())
    assert parameter_count(config) == sum(t.numel() for t in stored.values())
    biases = sum(t.numel() for name, t in stored.items() if name.endswith(".bias"))
    assert (biases > 0) == (built["family"] == "Qwen2")
    for fmt in WEIGHT_FORMATS:  # a quantized format stores the biases as float tensors
        assert weights_bytes(config, fmt) - weights_bytes(replace(config, qkv_bias=False), fmt) == 2 * biases


@pytest.mark.parametrize("weights", ["fp16", "int8", "int4-awq"])
def test_plan_takes_the_folder(built, capsys, weights):
    code, out, err = run_cli(plan_cli.main, ["--model", str(built["folder"]), "--target", "orin-nano-8gb",
                                             "--weights", weights], capsys)
    assert code == 0 and f"{built['family']}ForCausalLM, 2 layers" in out, err
    code, out, err = run_cli(plan_cli.main, ["--model", str(built["folder"]), "--target", "orin-nano-8gb",
                                             "--weights", weights, "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    config, _ = load_checkpoint(built["engine"] / CHECKPOINT_DIR)
    assert plan["weights_bytes"] == weights_bytes(config, weights) and plan["weights"] == weights


def test_onnx_export_of_the_engine_computes_transformers_logits(built, tmp_path, capsys):
    graphs = tmp_path / "onnx"
    code, _, err = run_cli(export_cli.main, ["--engine", str(built["engine"]), "--output", str(graphs),
                                             "--context", "64", "--chunk", "16", "--kv-cache", "fp32",
                                             "--profile", "ort"], capsys)
    assert code == 0, err
    onnx_engine = load_onnx_engine(graphs, threads=1)
    ids = prompt_ids(onnx_engine)
    with torch.no_grad():
        theirs = built["model"](torch.tensor([ids])).logits[0]
    ours = run_tokens(onnx_engine.model, ids, "fp32", all_logits=True, chunk=16).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- bad folders: one error line, no traceback


def assert_one_error(code: int, err: str, *words: str) -> None:
    """Exit code 2 and one ``error:`` line naming each of ``words``, no traceback."""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert all(word in errors[0] for word in words), errors[0]


def test_llama_with_attention_bias_is_one_error(tmp_path, capsys):
    folder = tmp_path / "hf"
    write_hf_folder(folder, "Llama", seed=0, attention_bias=True)
    code, _, err = run_cli(build_cli.main, ["--model", str(folder), "--output", str(tmp_path / "e")], capsys)
    assert_one_error(code, err, "config.json", "attention_bias", "without those biases")
    code, _, err = run_cli(plan_cli.main, ["--model", str(folder), "--target", "orin-nano-8gb"], capsys)
    assert_one_error(code, err, "attention_bias")


def test_qwen2_folder_without_a_bias_is_one_error(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    write_hf_folder(folder, "Qwen2", seed=0)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    code, _, err = run_cli(build_cli.main, ["--model", str(folder), "--output", str(tmp_path / "e")], capsys)
    assert_one_error(code, err, "model.layers.1.self_attn.k_proj.bias", "missing")
