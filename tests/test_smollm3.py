"""SmolLM3 (layers without RoPE) as transformers writes it, added as one family file
(runtime/model/families/smollm3.py): cabin-build's engine computes transformers' logits and greedy tokens,
calibration's transformers model of its checkpoint is the original, cabin-chat plays a script on it, cabin-export's
graphs compute the same logits, and cabin-plan and cabin-build say in one line that TensorRT-LLM does not build it."""
from __future__ import annotations

import json

import pytest
import torch
from core_helpers import generate
from test_cli_chat import write_script
from test_cli_errors import assert_one_error, run_cli
from test_families import SHAPE, long_prompt, write_family_folder
from test_hf_folders import MESSAGES, cabin_build

from cabinllm.calibration.hf_model import transformers_model
from cabinllm.cli import build as build_cli
from cabinllm.cli import export as export_cli
from cabinllm.cli.chat import main as cabin_chat
from cabinllm.cli.plan import main as cabin_plan
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.checkpoint import CONFIG_FILE, load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig

# four layers, every second one without RoPE (no_rope_layers [1, 0, 1, 0])
SMOLLM3 = {"SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM", {
    "head_dim": 16, "num_hidden_layers": 4, "no_rope_layer_interval": 2, "rope_theta": 1000.0,
    "tie_word_embeddings": True})}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The tiny SmolLM3 folder, its transformers model and its engine (cabin-build --kv-cache fp32, float32)."""
    root = tmp_path_factory.mktemp("smollm3")
    model = write_family_folder(root / "hf", "SmolLM3", seed=7, families=SMOLLM3)
    engine = cabin_build(root / "hf", root / "engine", "fp32")
    return {"root": root, "model": model, "engine": Engine.load(engine)}


def test_the_checkpoint_names_the_layers_without_rope(built):
    config = built["engine"].config
    assert config.architecture == "SmolLM3ForCausalLM" and config.nope_layers == [1, 3]
    written = json.loads((built["engine"].folder / CHECKPOINT_DIR / CONFIG_FILE).read_text())
    assert written["nope_layers"] == [1, 3]


def test_calibrations_transformers_model_of_the_checkpoint_is_the_original(built):
    ids = torch.tensor([long_prompt(built["engine"])])
    rebuilt = transformers_model(*load_checkpoint(built["engine"].folder / CHECKPOINT_DIR))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, built["model"](ids).logits, atol=1e-5, rtol=0)


def test_logits_and_greedy_tokens_equal_transformers(built):
    engine, model = built["engine"], built["model"]
    ids = long_prompt(engine)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    ours = run_tokens(engine.model, ids, "fp32", all_logits=True).logits
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids[:40]]), max_new_tokens=8, do_sample=False)[0, 40:].tolist()
    kv = engine.new_cache(KvCacheConfig("fp32", 4 << 20))
    assert generate(engine, kv, ids[:40], SamplingParams(max_new_tokens=8)).token_ids == expected


def test_cabin_chat_plays_a_script(built, tmp_path, capsys):
    script = write_script(tmp_path / "d.jsonl", [MESSAGES[0], MESSAGES[1], {"role": "user", "content": "play jazz"}])
    code = cabin_chat(["--engine", str(built["engine"].folder), "--script", str(script), "--json",
                       "--max-new-tokens", "4", "--kv-budget-mb", "4"])
    assert code == 0, capsys.readouterr().err
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2] and turns[1]["reused_tokens"] > 0


def test_cabin_export_graphs_compute_transformers_logits(built, tmp_path, capsys):
    code, _, err = run_cli(export_cli.main, ["--engine", str(built["engine"].folder), "--output",
                                             str(tmp_path / "onnx"), "--context", "64", "--chunk", "16",
                                             "--kv-cache", "fp32", "--profile", "ort"], capsys)
    assert code == 0, err
    ids = torch.randint(1, SHAPE["vocab_size"], (33,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs = built["model"](ids[None]).logits[0]
    model = load_onnx_engine(tmp_path / "onnx", threads=1).model
    ours = run_tokens(model, ids.tolist(), "fp32", all_logits=True, chunk=16).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_cabin_plan_and_build_say_tensorrt_llm_does_not_build_it(built, tmp_path, capsys):
    hf = built["root"] / "hf"
    code, out, err = run_cli(cabin_plan, ["--model", str(hf), "--target", "agx-orin-32gb", "--json"], capsys)
    assert code == 0, err
    why = json.loads(out)["trtllm_cannot_build"]
    assert "does not build SmolLM3ForCausalLM" in why and "cabin-export --profile ort" in why
    code, _, err = run_cli(build_cli.main, ["--model", str(hf), "--target", "agx-orin-32gb", "--output",
                                            str(tmp_path / "engine")], capsys)
    assert_one_error(code, err, "does not build SmolLM3ForCausalLM", "cabin-export")
    assert not (tmp_path / "engine").exists()
