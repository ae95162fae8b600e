"""cabin-plan and cabin-build for the families in-car teams shortlist (the Hub configs in builders/data/model_configs):
bytes per token from the shapes, Gemma 3's local layers counted at their window, and what each TensorRT-LLM line can
build said before a checkpoint is written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_errors import assert_one_error, run_cli
from test_families import write_family_folder

from cabinllm.cli import build as build_cli
from cabinllm.cli.plan import main as cabin_plan

CONFIGS = Path(__file__).parents[1] / "builders" / "data" / "model_configs"
# (layers holding every token, KV heads, head size, layers holding the window, window) from the Hub configs
SHAPES = {"qwen3-1.7b": (28, 8, 128, 0, 0), "llama-3.2-3b-instruct": (28, 8, 128, 0, 0),
          "gemma-3-4b-it": (5, 4, 256, 29, 1024), "phi-4-mini-instruct": (32, 8, 128, 0, 0)}
BUILDS_ON_0_12 = {"qwen3-1.7b": False, "llama-3.2-3b-instruct": True, "gemma-3-4b-it": False,
                  "phi-4-mini-instruct": False}


def plan(capsys, name: str, target: str) -> dict:
    code, out, err = run_cli(cabin_plan, ["--model", str(CONFIGS / f"{name}.json"), "--target", target,
                                          "--weights", "int4-awq", "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("target", ["orin-nano-8gb", "agx-orin-32gb"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_plan_counts_each_family_and_says_what_the_board_can_build(capsys, name, target):
    if (name, target) == ("gemma-3-4b-it", "orin-nano-8gb"):  # 4.1 GiB of weights leave too little
        code, _, err = run_cli(cabin_plan, ["--model", str(CONFIGS / f"{name}.json"), "--target", target,
                                            "--weights", "int4-awq"], capsys)
        assert code == 2 and "fewer than 4 dialogue turns" in err
        return
    result = plan(capsys, name, target)
    layers, heads, head, local, window = SHAPES[name]
    assert result["kv_bytes_per_token"] == {"fp16": 2 * 2 * layers * heads * head, "int8": 2 * layers * heads * head}
    tpb = result["tokens_per_block"]
    held = (-(-window // tpb) + 1) * tpb if window else 0  # the window in whole blocks, one more for a straddle
    per_token = local * heads * head  # the local layers' channels of one token, K or V
    assert result["kv_window_bytes"] == {"fp16": held * 4 * per_token, "int8": held * 2 * per_token}
    for dtype in ("fp16", "int8"):
        blocks = result["num_blocks"][dtype] * tpb * result["kv_bytes_per_token"][dtype]
        assert result["kv_pool_bytes"][dtype] == blocks + result["kv_window_bytes"][dtype]
    if BUILDS_ON_0_12[name]:
        assert result["trtllm_cannot_build"] is None and all(result["trtllm_build_args"].values())
    else:
        assert "cannot build" in result["trtllm_cannot_build"] and "cabin-export --profile ort" in \
            result["trtllm_cannot_build"] and not any(result["trtllm_build_args"].values())
    assert result["est_turns"]["int8"] >= 4


def test_thor_builds_every_family(capsys):
    for name in SHAPES:
        result = plan(capsys, name, "thor-128gb")
        assert result["trtllm_cannot_build"] is None and all(result["trtllm_build_args"].values()), name


def test_cabin_build_refuses_a_checkpoint_the_board_cannot_build(tmp_path, capsys):
    write_family_folder(tmp_path / "hf", "Qwen3", seed=0)
    code, _, err = run_cli(build_cli.main, ["--model", str(tmp_path / "hf"), "--target", "orin-nano-8gb", "--output",
                                            str(tmp_path / "engine")], capsys)
    assert_one_error(code, err, "TensorRT-LLM 0.12.0-jetson", "cannot build Qwen3ForCausalLM", "cabin-export")
    assert not (tmp_path / "engine").exists()


def test_plan_names_the_cuda_runner_where_tensorrt_cannot_build(capsys):
    why = plan(capsys, "qwen3-1.7b", "orin-nano-8gb")["trtllm_cannot_build"]
    assert "the CUDA runner runs it (cabin-plan --backend cuda" in why and "int4-awq weights 1.86 GiB" in why
    assert "int8 KV pool" in why and "turns, block reuse" in why


def test_cuda_backend_plans_every_dtype_with_block_reuse(capsys):
    code, out, err = run_cli(cabin_plan, ["--model", str(CONFIGS / "qwen3-1.7b.json"), "--target", "orin-nano-8gb",
                                          "--backend", "cuda", "--weights", "int4-g32", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["target_profile"]["backend"] == "cuda" and result["kv_dtypes"] == ["fp16", "int8", "int8-dynamic"]
    assert all(result["block_reuse"].values()) and set(result["max_num_tokens"].values()) == {2048}
    assert result["trtllm_build_args"] is None and result["trtllm_cannot_build"] is None
    # the runner's overhead, not TensorRT-LLM's, comes out of the board's memory
    assert result["memory_bytes"]["runtime_overhead"] == int(1.2 * 2**30)
    code, out, err = run_cli(cabin_plan, ["--model", str(CONFIGS / "qwen3-1.7b.json"), "--target", "orin-nano-8gb",
                                          "--backend", "cuda", "--weights", "int4-g32"], capsys)
    assert "cabin-chat --engine ENGINE_DIR --device cuda --kv-cache int8 --kv-budget-mb" in out


@pytest.mark.parametrize("args, words", [
    (["--target", "orin-nano-8gb", "--kv-cache", "fp8"], ["fp8", "SM87", "SM89"]),
    (["--target", "cpu"], ["cpu has no CUDA GPU profile"]),
])
def test_cuda_backend_refusals_are_one_line(capsys, args, words):
    code, _, err = run_cli(cabin_plan, ["--model", str(CONFIGS / "qwen3-1.7b.json"), "--backend", "cuda", *args],
                           capsys)
    assert code == 2 and all(word in err for word in words), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
