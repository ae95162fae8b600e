"""Qwen3 (q/k norms), Gemma 3 (extra norms, GELU, scales, softcap, local layers over a window shorter than the
prompt) and Phi-3 (half the head rotated, LongRoPE) HF folders as transformers writes them: cabin-export's graphs
of their engines compute transformers' logits, in the ort profile and, on its allow-list, the npu one."""
from __future__ import annotations

import json

import pytest
import torch
from test_cli_errors import run_cli
from test_families import write_family_folder
from test_hf_folders import SHAPE, cabin_build

from cabinllm.cli import export as export_cli
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE
from cabinllm.runtime.model.run_tokens import run_tokens

WINDOW, CONTEXT, CHUNK = 8, 64, 16
PROMPTS = (33, 40)  # tokens: two prompt chunks then the token graph; two full chunks then a padded one
# HF config class, model class, what differs from SHAPE's defaults
FAMILIES = {
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),  # heads * d > hidden
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW, "final_logit_softcapping": 5.0,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "partial_rotary_factor": 0.5, "tie_word_embeddings": False, "pad_token_id": 0,
        "original_max_position_embeddings": 1024,  # factor 2: LongRoPE's attention factor scales cos/sin
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                            "short_factor": [1.0, 1.3, 1.7, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0]}}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory) -> dict:
    """One family's transformers model, its engine (cabin-build --kv-cache fp32, float32) and prompts."""
    root = tmp_path_factory.mktemp(request.param.lower())
    folder, engine = root / "hf", root / "engine"
    seed = list(FAMILIES).index(request.param)
    model = write_family_folder(folder, request.param, seed, {k: (c, m, {**SHAPE, **o}) for k, (c, m, o) in
                                                              FAMILIES.items()})
    cabin_build(folder, engine, "fp32")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=gen) for n in PROMPTS]
    with torch.no_grad():  # each prompt's token ids and transformers' logits of them
        prompts = [(ids.tolist(), model(ids[None]).logits[0]) for ids in prompts]
    return {"family": request.param, "engine": engine, "prompts": prompts}


def test_the_engine_runs_the_family(built):
    config = Engine.load(built["engine"]).config
    assert config.architecture == f"{built['family']}ForCausalLM"
    assert config.qk_layernorm == (built["family"] != "Phi3")
    assert config.rotary_dim == (8 if built["family"] == "Phi3" else None)
    if built["family"] == "Gemma3":  # a local layer, then a global one
        assert [config.layer_window(i) for i in range(2)] == [WINDOW, None] and config.final_logit_softcapping


@pytest.mark.parametrize("profile", ["ort", "npu"])
def test_graphs_compute_transformers_logits(built, tmp_path, capsys, profile):
    graphs = tmp_path / "onnx"
    code, _, err = run_cli(export_cli.main, ["--engine", str(built["engine"]), "--output", str(graphs),
                                             "--context", str(CONTEXT), "--chunk", str(CHUNK), "--kv-cache", "fp32",
                                             "--profile", profile], capsys)
    assert code == 0, err
    ops = json.loads((graphs / MANIFEST_FILE).read_text())["ops"]
    assert ("Gather" in ops) == (profile == "ort")  # npu graphs gather nothing: the host looks rows up
    model = load_onnx_engine(graphs, threads=1).model
    for ids, theirs in built["prompts"]:
        ours = run_tokens(model, ids, "fp32", all_logits=True, chunk=CHUNK).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
