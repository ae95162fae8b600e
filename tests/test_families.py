"""Qwen3, Gemma 3, Phi-3 (Phi-4-mini's family) and Llama 3.2 as transformers writes them: tiny random-weight models
built by cabin-build into engines whose logits are transformers' own, whose dialogue reuse equals recomputing, and
whose KV equalization leaves full-precision logits as they were.

The shapes are transformers' own testers' (CausalLMModelTester's defaults, tests/causal_lm_tester.py L86-103 at
2b6c089d, which the Qwen3, Llama, Phi3 and Gemma3 testers keep), plus what each family's feature needs to show:
Gemma 3 gets four layers alternating local and global with a window shorter than the dialogue, Phi-3 partial
rotary and LongRoPE, Llama 3.2 tied embeddings and llama3 RoPE scaling. Random weights prove mechanics only."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
from core_helpers import generate
import torch
from test_hf_folders import MESSAGES, WORDS, cabin_build, write_tokenizer

from cabinllm.calibration.clips import compute_clips, layer_ranges
from cabinllm.calibration.equalize import equalize
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.calibration.stats import collect_stats
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.checkpoint import load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kernels.bindings import native_kernels_enabled
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.transformer import Transformer

SHAPE = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512, "pad_token_id": 0}
# config class, model class and what each family adds; Gemma's window is shorter than the dialogues below
FAMILIES = {
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "hidden_act": "gelu"}),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "rope_local_base_freq": 100.0,
        "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "hidden_act": "gelu", "partial_rotary_factor": 0.5, "tie_word_embeddings": True,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.25, 1.5, 2.0],
                         "long_factor": [2.0, 3.0, 5.0, 8.0]}}),
    "Llama32": ("LlamaConfig", "LlamaForCausalLM", {
        "head_dim": 16, "hidden_act": "gelu", "tie_word_embeddings": True, "rope_scaling": {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}}),
}
TURNS = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(6)]


def write_family_folder(folder: Path, family: str, seed: int, families: dict = FAMILIES) -> torch.nn.Module:
    """A tiny ``family`` model (config class, model class and settings from ``families``) with random weights
    (norms around their identity), saved by ``save_pretrained`` beside a word-level tokenizer; returns the model
    (float32, eval mode)."""
    import transformers

    config_name, model_name, extra = families[family]
    assert write_tokenizer(folder) <= SHAPE["vocab_size"]
    config = getattr(transformers, config_name)(**copy.deepcopy({**SHAPE, **extra}))  # transformers edits them
    model = getattr(transformers, model_name)(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    identity = 0.0 if family == "Gemma3" else 1.0  # Gemma's norms scale by 1 + weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (identity if "norm" in name else 0.0))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory) -> dict:
    """One family's HF folder, its transformers model and its engine (cabin-build --kv-cache int8, float32)."""
    root = tmp_path_factory.mktemp(request.param.lower())
    folder, engine = root / "hf", root / "engine"
    model = write_family_folder(folder, request.param, seed=list(FAMILIES).index(request.param))
    return {"family": request.param, "model": model, "engine": Engine.load(cabin_build(folder, engine))}


def long_prompt(engine: Engine) -> list[int]:
    """A chat prompt longer than Gemma's window and Phi's original context (64), every word in the vocabulary."""
    messages = MESSAGES + [{"role": "user", "content": text} for text in TURNS]
    ids = engine.tokenizer.encode_prompt(engine.tokenizer.render(messages))
    assert len(ids) > 64 and 0 not in ids
    return ids


def test_logits_equal_transformers(built):
    engine = built["engine"]
    ids = long_prompt(engine)
    if built["family"] == "Phi3":  # one forward call past the original context takes the long factors for all of
        ids = ids[:64]  # its positions in transformers; per position here (the next test decodes past it)
    with torch.no_grad():
        theirs = built["model"](torch.tensor([ids])).logits[0]
    ours = run_tokens(engine.model, ids, "fp32", all_logits=True).logits
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)
    int8 = run_tokens(engine.model, ids, "int8", engine.scales, all_logits=True).logits  # the mode it was built for
    assert (int8 - theirs).abs().max() < 0.15 * theirs.abs().max()


def test_greedy_tokens_equal_transformers_decoding_with_its_cache(built):
    """Token by token past Gemma's window and Phi's original context, each step on transformers' own KV cache.

    (transformers' ``generate`` for Phi-3 instead drops its cache and recomputes the whole sequence with the long
    factors once it passes the original context; a paged cache keeps each position's factors, as vLLM does.)"""
    engine, model = built["engine"], built["model"]
    ids = long_prompt(engine)[:60]
    theirs, cache, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(12):
            out = model(step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            theirs.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[theirs[-1]]])
    kv = engine.new_cache(KvCacheConfig("fp32", 4 << 20))
    ours = generate(engine, kv, ids, SamplingParams(max_new_tokens=12))
    assert ours.token_ids == theirs


def test_reuse_over_six_turns_equals_recomputing(built):
    engine = built["engine"]
    params = SamplingParams(max_new_tokens=6, stop_token_ids=engine.stop_token_ids())
    session = DialogueSession(engine, engine.new_cache(KvCacheConfig("fp32", 4 << 20, 8)), params,
                              MESSAGES[0]["content"])
    for text in TURNS:
        turn = session.chat(text)
        history = session.fed[: turn.reused_tokens + turn.prefill_tokens]
        fresh = generate(engine, engine.new_cache(KvCacheConfig("fp32", 4 << 20, 8)), history, params)
        assert fresh.token_ids == turn.token_ids
    assert turn.reused_tokens > 8  # the last turn reused more than Gemma's window


def test_equalized_full_precision_logits_equal_the_original(built):
    engine = built["engine"]
    config, weights = load_checkpoint(engine.folder / CHECKPOINT_DIR)
    train, _ = prepare_dialogues("builtin", "train", 4, 0, engine.tokenizer, max_tokens=96, min_tokens=32)
    stats = collect_stats(engine.model, train, progress=False)
    ranges = layer_ranges(stats, compute_clips(stats, "max"))
    ids = long_prompt(engine)
    reference = run_tokens(Transformer(config, weights), ids, "fp32", all_logits=True).logits
    for first_token in (None, ids[0]):
        eq_weights, scales = equalize(config, weights, ranges, first_token=first_token)
        changed = [n for n in weights if not torch.equal(eq_weights[n], weights[n])]
        assert changed  # the factors went somewhere
        logits = run_tokens(Transformer(config, eq_weights), ids, "fp32", all_logits=True).logits
        torch.testing.assert_close(logits, reference, atol=1e-3, rtol=0)
        assert scales.k == pytest.approx(scales.v)  # every K and V channel now reaches the same range


def test_gemma3_vision_language_folder_imports_its_text_model(tmp_path):
    """Gemma-3-4B and up are Gemma3ForConditionalGeneration: their text model imports (the vision tower is the
    images' part), with the defaults the Hub's config.json leaves to transformers filled in."""
    import transformers

    from cabinllm.runtime.sources.model_source import load_model

    assert write_tokenizer(tmp_path) <= SHAPE["vocab_size"]
    text = copy.deepcopy({**SHAPE, **FAMILIES["Gemma3"][2]})
    vision = dict(hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "Gemma3ForCausalLM" and loaded.config.sliding_window == 8
    ids = list(range(1, 14)) * 2
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(run_tokens(loaded.transformer(), ids, "fp32", all_logits=True).logits, theirs,
                               atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def gemma_512(tmp_path_factory) -> dict:
    """A tiny Gemma 3 whose local layers attend over 512 tokens, its engine (fp32 weights) and its model."""
    import transformers

    folder, engine = tmp_path_factory.mktemp("gemma512") / "hf", tmp_path_factory.mktemp("gemma512") / "engine"
    assert write_tokenizer(folder) <= SHAPE["vocab_size"]
    config = transformers.Gemma3TextConfig(**copy.deepcopy({**SHAPE, **FAMILIES["Gemma3"][2], "sliding_window": 512,
                                                            "max_position_embeddings": 8192}))
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    model.save_pretrained(folder)
    return {"model": model, "engine": Engine.load(cabin_build(folder, engine, "fp32"))}


def test_gemma3_local_layers_hold_the_window_over_4000_tokens(gemma_512):
    """Over a 4,000-token dialogue the blocks hold the global layers' tokens and the window pool only the local
    layers' last 512 (block-rounded), and every reply equals transformers' greedy one on the same conversation."""
    engine, model = gemma_512["engine"], gemma_512["model"]
    cache = engine.new_cache(KvCacheConfig("fp32", 8 << 20, 32))
    layout, plan = cache.layout, cache.storage.plan
    per_layer = 2 * layout.channels * 4  # fp32 K and V of one token in one layer
    assert len(plan.global_layers) == 2 and len(plan.local_layers) == 2
    assert cache.bytes_per_token() == len(plan.global_layers) * per_layer
    params = SamplingParams(max_new_tokens=6)
    session = DialogueSession(engine, cache, params, MESSAGES[0]["content"])
    turn = 0
    while len(session.fed) < 4000:
        reply = session.chat(" ".join(TURNS[turn % len(TURNS)] for _ in range(8)))
        turn += 1
        tokens = len(session.seq)
        stats = cache.stats()
        window_used = stats.bytes_used - stats.blocks_in_use * cache.bytes_per_block
        assert stats.blocks_in_use == cdiv(tokens, 32)  # the global layers: every token
        assert window_used <= len(plan.local_layers) * (512 + 32) * per_layer  # the local ones: the window
        if turn % 10 == 1 or len(session.fed) >= 4000:  # transformers' greedy reply to the same prompt
            prompt = session.fed[: reply.reused_tokens + reply.prefill_tokens]
            with torch.no_grad():
                theirs = model.generate(torch.tensor([prompt]), max_new_tokens=len(reply.token_ids), do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert reply.token_ids == theirs, turn
    full = len(session.seq) * layout.num_layers * per_layer
    assert stats.bytes_used < 0.65 * full  # two of four layers at the window instead of 4,000 tokens


def test_checkpoint_is_what_tensorrt_llms_converter_writes(built):
    """Config keys and tensors as TensorRT-LLM 1.x's own converters name them (each family's file in
    runtime/model/families cites the lines): read straight from the engine's checkpoint files."""
    import json

    from safetensors.torch import load_file

    folder = built["engine"].folder / CHECKPOINT_DIR
    config = json.loads((folder / "config.json").read_text())
    stored = load_file(str(folder / "rank0.safetensors"))
    hf = {k: v.float() for k, v in built["model"].state_dict().items()}
    extra = FAMILIES[built["family"]][2]
    assert config["architecture"] == FAMILIES[built["family"]][1].replace("Llama32", "Llama")
    lm_head = hf["model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"]
    assert torch.equal(stored["lm_head.weight"], lm_head)  # always written, a copy where tied
    assert torch.equal(stored["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])  # unscaled
    layer = "transformer.layers.1"
    if built["family"] == "Qwen3":
        assert (config["qwen_type"], config["attn_bias"], config["head_size"]) == ("qwen3", False, 16)
        q_norm = hf["model.layers.1.self_attn.q_norm.weight"]
        assert torch.equal(stored[f"{layer}.attention.q_layernorm.weight"], q_norm)
    if built["family"] == "Gemma3":
        for key in ("query_pre_attn_scalar", "sliding_window", "rope_local_base_freq"):
            assert config[key] == extra[key]
        assert config["sliding_window_pattern"] == config["_sliding_window_pattern"] == 2
        assert config["inter_layernorms"] is True and config["hidden_act"] == "gelu_pytorch_tanh"
        norms = {"input_layernorm": "input_layernorm", "post_layernorm": "post_attention_layernorm",
                 "pre_feedforward_layernorm": "pre_feedforward_layernorm",
                 "post_feedforward_layernorm": "post_feedforward_layernorm",
                 "attention.q_layernorm": "self_attn.q_norm", "attention.k_layernorm": "self_attn.k_norm"}
        for ours, theirs in norms.items():  # the converter adds Gemma's 1 to every norm
            assert torch.equal(stored[f"{layer}.{ours}.weight"], hf[f"model.layers.1.{theirs}.weight"] + 1.0)
        assert torch.equal(stored["transformer.ln_f.weight"], hf["model.norm.weight"] + 1.0)
    if built["family"] == "Phi3":
        scaling = extra["rope_scaling"]
        assert config["rotary_pct"] == 0.5 and config["position_embedding_type"] == "long_rope"
        assert config["longrope_scaling_short_factors"] == scaling["short_factor"]
        assert config["longrope_scaling_long_factors"] == scaling["long_factor"]
        assert config["original_max_position_embeddings"] == 64
        assert torch.equal(stored[f"{layer}.attention.qkv.weight"], hf["model.layers.1.self_attn.qkv_proj.weight"])
        gate, up = hf["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
        assert torch.equal(stored[f"{layer}.mlp.fc.weight"], torch.cat([up, gate]))  # fused, halves swapped
        assert f"{layer}.mlp.gate.weight" not in stored
    if built["family"] == "Llama32":
        assert {k: v for k, v in config["rotary_scaling"].items() if k != "type"} == extra["rope_scaling"]
        assert config["tie_word_embeddings"] is True


def test_the_fused_decode_step_takes_every_family_but_gemma(built):
    """decode_step.c normalizes the q/k heads (Qwen3) and rotates part of each head (Phi-3); its token's logits
    equal the per-layer path's. Gemma 3 (extra norms, GELU, scales, windows) keeps the per-layer path."""
    model, ids = built["engine"].model, long_prompt(built["engine"])[:40]
    if built["family"] == "Gemma3":
        assert model._step_weights is None
        return
    assert model._step_weights is not None and native_kernels_enabled()
    last = []
    for fused in (True, False):
        run = run_tokens(model, ids[:-1], "fp32", cache=built["engine"].new_cache(
            KvCacheConfig("fp32", 1 << 20)))
        run.cache.append(run.seq, ids[-1:])
        if not fused:
            model.__dict__["_step_weights"] = None  # the cached property, emptied: the per-layer path
        try:
            last.append(model.forward(ids[-1:], len(ids) - 1, run.cache, run.seq))
        finally:
            model.__dict__.pop("_step_weights", None)
    torch.testing.assert_close(last[0], last[1], atol=1e-4, rtol=0)


def test_a_template_that_writes_bos_gets_one_bos(tmp_path):
    """Gemma's (and Llama 3's) chat template starts with ``bos_token`` while its tokenizer also asks for BOS: the
    prompt starts with one, as transformers' apply_chat_template gives it."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cabinllm.runtime.model.tokenizer import ChatTokenizer
    from cabinllm.runtime.sources.tokenizer_export import export_tokenizer

    vocab = {token: i for i, token in enumerate(["<unk>", "<bos>", "<eos>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    hf_folder = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            chat_template=template).save_pretrained(hf_folder)
    config_path = hf_folder / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "add_bos_token": True}))
    export_tokenizer(hf_folder, tmp_path)  # as an import writes it beside the checkpoint
    ours = ChatTokenizer(tmp_path)
    ids = ours.encode_prompt(ours.render(MESSAGES))
    theirs = PreTrainedTokenizerFast.from_pretrained(hf_folder).apply_chat_template(MESSAGES, tokenize=True,
                                                                                     return_dict=False)
    assert ids == list(theirs) and ids.count(1) == 1 and ids[0] == 1
