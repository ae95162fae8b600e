"""cabin-plan: every target profile, exact sizes, refusals with the nearest working config, bare HF config.json.

Plans of the default model read its GGUF's metadata (seconds) and are marked slow; the same checks run on the tiny
random Llama's HF folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import pytest

from cabinllm.builders.dialogue_turns import TURNS_SOURCE, TYPICAL_TURN, measure_turn_tokens
from cabinllm.builders.planner import CHUNK_TOKENS, REPLY_TOKENS, PlanRequest, make_plan
from cabinllm.builders.targets import GIB, get_target, load_targets
from cabinllm.builders.trtllm import build_args, flag_set
from cabinllm.cli.plan import main as cabin_plan
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.sources.model_source import load_model_config

from fakes.tiny_model import write_tiny_llama

LLAMA3_8B = Path(__file__).parent / "data" / "llama3-8b" / "config.json"
TARGETS = ("orin-nano-8gb", "orin-nx-16gb", "agx-orin-32gb", "agx-orin-64gb", "thor-128gb", "cpu")
NPU_TARGETS = ("sa8295p-16gb", "sa8775p-36gb")  # planned as cabin-export arguments: tests/test_plan_npu.py
# SmolLM2-135M: 30 layers, hidden 576, q 9x64, kv 3x64, MLP 1536, vocab 49152; lm_head stored as its own copy.
SMOL_PARAMS = 2 * 49152 * 576 + 576 + 30 * ((576 + 2 * 192) * 576 + 576 * 576 + 3 * 1536 * 576 + 2 * 576)
# The tiny random Llama (fakes.tiny_model.SHAPE): 3 layers, hidden 32, q 4x8, kv 2x8, MLP 64, vocab 22, its own lm_head.
TINY_PARAMS = 2 * 22 * 32 + 32 + 3 * ((32 + 2 * 16) * 32 + 32 * 32 + 3 * 64 * 32 + 2 * 32)
# Llama-3-8B: 32 layers, hidden 4096, q 32x128, kv 8x128, MLP 14336, vocab 128256.
LLAMA3_PARAMS = 2 * 128256 * 4096 + 4096 + 32 * ((4096 + 2 * 1024) * 4096 + 4096 * 4096 + 3 * 14336 * 4096 + 2 * 4096)


class Planned(NamedTuple):
    """A model's cabin-plan arguments, and what its plans must show."""

    args: tuple[str, ...]  # --model PATH, or none for the default model
    parameters: int
    fp16_bytes_per_token: int  # and half of it for every one-byte KV dtype
    context: int  # caps max_seq_len on every target
    turns: int  # typical turns in the context


@pytest.fixture(scope="module", params=["tiny", pytest.param("default", marks=pytest.mark.slow)])
def planned(request, tmp_path_factory) -> Planned:
    """The tiny random Llama's HF folder (a 1,024-token context), and the default model (its GGUF)."""
    if request.param == "default":
        return Planned((), SMOL_PARAMS, 23040, 8192, 135)  # fp16 KV bytes per token: 30 x 3 x 64 x 2 x 2
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    return Planned(("--model", str(folder)), TINY_PARAMS, 2 * 3 * 2 * 8 * 2, 1024, 15)  # K, V x 3 layers x 2x8


def run_plan(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = cabin_plan([*args, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out else None, out.err


@pytest.mark.parametrize("target", TARGETS)
def test_plan_json_for_every_target(capsys, planned, target):
    code, plan, _ = run_plan(capsys, *planned.args, "--target", target)
    profile = get_target(target)
    assert code == 0 and plan["target"] == target
    assert set(plan["kv_dtypes"]) == set(profile.kv_dtypes)
    for key in ("weights_bytes", "kv_bytes_per_token", "max_kv_tokens", "est_turns", "trtllm_build_args", "warnings"):
        assert key in plan
    per_param = 4 if target == "cpu" else 2  # the reference runtime holds fp32 weights
    assert plan["weights_bytes"] == planned.parameters * per_param
    assert plan["kv_bytes_per_token"]["fp16"] == planned.fp16_bytes_per_token
    one_byte = [d for d in ("int8", "fp8") if d in profile.kv_dtypes]
    assert all(plan["kv_bytes_per_token"][d] == planned.fp16_bytes_per_token // 2 for d in one_byte)
    context = planned.context
    for dtype in profile.kv_dtypes:  # the model's context caps it everywhere for a model this small
        assert plan["max_seq_len"][dtype] == context
        assert plan["est_turns"][dtype] == (context - TYPICAL_TURN.system) // TYPICAL_TURN.per_turn == planned.turns
        assert plan["num_blocks"][dtype] == context // profile.tokens_per_block
        assert plan["max_kv_tokens"][dtype] * plan["kv_bytes_per_token"][dtype] <= plan["memory_bytes"][
            "for_activations_and_kv"] - plan["activation_bytes"][dtype]
    assert (plan["trtllm_build_args"] is None) == (profile.backend == "reference")


def test_orin_int8_plan_states_the_fmha_conflict(capsys, planned):
    _, plan, _ = run_plan(capsys, *planned.args, "--target", "orin-nano-8gb")
    assert plan["tokens_per_block"] == 64
    assert plan["block_reuse"] == {"fp16": True, "int8": False}
    max_input = planned.context - REPLY_TOKENS  # 7936 for the default model
    assert plan["max_num_tokens"] == {"fp16": min(CHUNK_TOKENS, max_input), "int8": max_input}
    turns, t = planned.turns, TYPICAL_TURN
    mean = t.system + t.user + t.per_turn * (turns - 1) // 2  # 4107 for the default model
    assert plan["prefill_tokens_per_turn"]["int8"]["mean"] == mean
    assert plan["prefill_tokens_per_turn"]["fp16"]["mean"] == t.user + 64 // 2 == 49
    assert any(f"re-prefills the whole history, {mean} tokens per turn" in w for w in plan["warnings"])
    assert plan["trtllm_build_args"]["int8"] == [
        "--checkpoint_dir", "checkpoint", "--output_dir", "trt_engine", "--gemm_plugin", "float16",
        "--paged_kv_cache", "enable", "--tokens_per_block", "64", "--use_paged_context_fmha", "disable",
        "--max_batch_size", "1", "--max_beam_width", "1", "--max_input_len", str(max_input),
        "--max_seq_len", str(planned.context), "--max_num_tokens", str(max_input)]


def test_bare_hf_config_json_llama3_8b(capsys):
    code, plan, _ = run_plan(capsys, "--model", str(LLAMA3_8B), "--target", "agx-orin-64gb")
    assert code == 0
    assert plan["model"]["parameters"] == LLAMA3_PARAMS == 8_030_261_248
    assert plan["weights_bytes"] == 2 * LLAMA3_PARAMS
    assert plan["kv_bytes_per_token"] == {"fp16": 131072, "int8": 65536}
    assert plan["est_turns"] == {"fp16": 135, "int8": 135}
    assert plan["kv_pool_bytes"] == {"fp16": 8192 * 131072, "int8": 8192 * 65536}


def test_weight_only_formats_shrink_the_linear_layers():
    config = load_model_config(str(LLAMA3_8B))
    target = get_target("agx-orin-64gb")
    sizes = {w: make_plan(PlanRequest("llama3", target, w), config).weights_bytes for w in ("fp16", "int8", "int4-awq")}
    embeddings = 2 * 128256 * 4096 * 2 + (65 * 4096) * 2  # embedding + lm_head + norms stay fp16
    linear = LLAMA3_PARAMS - 2 * 128256 * 4096 - 65 * 4096
    out_channels = 32 * (6144 + 4096 + 2 * 14336 + 4096)
    assert sizes["int8"] == embeddings + linear + 4 * out_channels  # float32 scales, as ModelOpt exports them
    groups = 32 * (6144 * 32 + 4096 * 32 + 2 * 14336 * 32 + 4096 * 112)  # in/128 groups per output row
    prequant = 32 * (4096 + 4096 + 2 * 4096 + 14336)  # one fp16 AWQ prequant scale per input of each linear
    assert sizes["int4-awq"] == embeddings + linear // 2 + 4 * groups + 2 * prequant


def test_refuses_model_that_does_not_fit_and_names_nearest(capsys):
    code, out, err = run_plan(capsys, "--model", str(LLAMA3_8B), "--target", "orin-nano-8gb")
    assert code == 2
    reason = out["refused"]["reason"]
    assert reason.startswith("14.96 GiB of fp16 weights do not fit on orin-nano-8gb") and "leaves 4.10 GiB" in reason
    nearest = out["refused"]["nearest"]
    assert (nearest["target"], nearest["weights"]) == ("orin-nx-16gb", "int8")  # int4 on the Nano does not fit either
    assert all(nearest["fits"].values())
    assert "nearest working config: --target orin-nx-16gb --weights int8" in err


def test_refuses_kv_dtype_the_target_cannot_run(capsys, planned):
    code, out, _ = run_plan(capsys, *planned.args, "--target", "orin-nano-8gb", "--kv-cache", "fp8")
    assert code == 2 and "Orin (SM87) has no FP8" in out["refused"]["reason"]
    assert out["refused"]["nearest"]["kv_dtypes"] == ["int8"]
    code, out, _ = run_plan(capsys, *planned.args, "--target", "thor-128gb", "--kv-cache", "int8")
    assert code == 2 and "refuses INT8 (INT8 KV included) on SM100-119" in out["refused"]["reason"]
    assert out["refused"]["nearest"]["kv_dtypes"] == ["fp8"]


def test_unknown_target_lists_known_ones(capsys, planned):
    assert cabin_plan([*planned.args, "--target", "orin-nano"]) == 2
    err = capsys.readouterr().err
    assert "unknown target 'orin-nano'; known targets: " + ", ".join(TARGETS + NPU_TARGETS) in err


def test_small_budget_shrinks_max_seq_len_to_fit():
    config = load_model_config(str(LLAMA3_8B))
    target = get_target("agx-orin-32gb")
    free = (target.memory_gib - target.os_reserve_gib - target.runtime_overhead_gib) * GIB - 2 * LLAMA3_PARAMS
    plan = make_plan(PlanRequest("llama3", target, reserve_gb=(free - 0.75 * GIB) / GIB), config)
    budget = plan.budget_bytes
    assert 0.74 * GIB < budget < 0.76 * GIB
    for kv in plan.kv.values():
        assert kv.max_seq_len < 8192 and kv.max_seq_len % 64 == 0
        assert kv.memory_left_bytes == budget - kv.activation_bytes - kv.kv_pool_bytes >= 0  # what is planned fits
        assert kv.kv_pool_bytes == kv.num_blocks * 64 * kv.bytes_per_token == kv.max_seq_len * kv.bytes_per_token
        assert kv.est_turns == (kv.max_seq_len - TYPICAL_TURN.system) // TYPICAL_TURN.per_turn
    # INT8 holds more tokens despite needing the whole prompt in one prefill.
    assert plan.kv["int8"].max_seq_len > plan.kv["fp16"].max_seq_len


def test_int8_never_asks_for_paged_context_fmha():
    config = load_model_config(str(LLAMA3_8B))
    for target in load_targets().values():
        for dtype in target.kv_dtypes:
            kv = make_plan(PlanRequest("llama3", target, "int4-awq", kv_dtype=dtype), config).kv[dtype]
            for flags in ("v0.12", "1.x"):
                args = build_args(kv.shape, flags)
                fmha = args[args.index("--use_paged_context_fmha") + 1]
                assert fmha == ("disable" if dtype.startswith("int8") else "enable")
    assert flag_set("0.12.0") == "v0.12" and flag_set("0.13.0") == "1.x" and flag_set("1.0.0rc3") == "1.x"


def test_typical_turn_is_measured_on_the_builtin_set(default_engine):
    from cabinllm.calibration.sources import open_source

    dialogues, _ = open_source("builtin")
    messages = [d.messages for d in dialogues]
    assert len(messages) == 200
    measured = measure_turn_tokens(default_engine.tokenizer, messages, TURNS_SOURCE, "SmolLM2-135M-Instruct")
    assert measured == TYPICAL_TURN, "the built-in dialogue set changed: update TYPICAL_TURN in dialogue_turns.py"


def test_beams_hold_the_longest_prompt_once_and_each_beam_s_reply(capsys, planned):
    code, plan, _ = run_plan(capsys, *planned.args, "--target", "orin-nano-8gb", "--max-beam-width", "4")
    context, max_input = planned.context, planned.context - REPLY_TOKENS
    # the worst prompt is one token short of max_input_len's whole blocks: its last block is every beam's own
    shared = max_input // 64 - 1
    blocks = shared + 4 * (cdiv(context - 1, 64) - shared)  # 31 for the tiny model, against 16 for one sequence
    assert code == 0 and plan["max_beam_width"] == 4
    for dtype in ("fp16", "int8"):
        assert plan["max_seq_len"][dtype] == context and plan["est_turns"][dtype] == planned.turns
        assert plan["num_blocks"][dtype] == blocks > context // 64
        assert plan["kv_pool_bytes"][dtype] == blocks * 64 * plan["kv_bytes_per_token"][dtype]
        args = plan["trtllm_build_args"][dtype]
        assert args[args.index("--max_beam_width") + 1] == "4"
    assert any("int8 KV with 4 beams" in w and f"{blocks} blocks instead of {context // 64}" in w
               for w in plan["warnings"])


def test_beams_shrink_max_seq_len_where_memory_binds():
    config = load_model_config(str(LLAMA3_8B))
    target = get_target("agx-orin-32gb")
    free = (target.memory_gib - target.os_reserve_gib - target.runtime_overhead_gib) * GIB - 2 * LLAMA3_PARAMS
    plans = {width: make_plan(PlanRequest("llama3", target, reserve_gb=(free - 0.75 * GIB) / GIB,
                                          max_beam_width=width), config) for width in (1, 4)}
    for dtype, beams in plans[4].kv.items():
        assert beams.max_seq_len < plans[1].kv[dtype].max_seq_len and beams.memory_left_bytes >= 0
        assert beams.kv_pool_bytes == beams.num_blocks * 64 * beams.bytes_per_token
        assert beams.shape.max_beam_width == 4


def test_beams_on_a_target_that_is_no_tensorrt_engine_are_refused(capsys, planned):
    assert cabin_plan([*planned.args, "--target", "cpu", "--max-beam-width", "2"]) == 2
    err = capsys.readouterr().err
    assert "--max-beam-width sizes a TensorRT engine's beam search" in err and "cpu runs the reference" in err


def test_the_nearest_config_for_beams_is_a_tensorrt_engine_with_them(capsys):
    code, out, err = run_plan(capsys, "--model", str(LLAMA3_8B), "--target", "orin-nano-8gb", "--max-beam-width", "4")
    nearest = out["refused"]["nearest"]
    assert code == 2 and nearest["target_profile"]["backend"] == "tensorrt" and nearest["max_beam_width"] == 4
    assert f"nearest working config: --target {nearest['target']}" in err and "--max-beam-width 4 (" in err


def test_plan_says_which_weight_formats_each_runtime_takes(capsys, planned):
    """int4-g32 runs on the reference engine, not on a TensorRT-LLM target (whose W4A16 kernels take symmetric
    groups of 64 / 128): the table lists it with the reason, a request for it is refused naming the targets that
    run it; the int8 head counts its int8 bytes."""
    code, plan, _ = run_plan(capsys, *planned.args, "--target", "cpu", "--weights", "int4-g32", "--head", "int8")
    assert code == 0 and plan["head"] == "int8"
    choices = {w["weights"]: w for w in plan["weight_formats"]}
    assert choices["int4-g32"]["taken"] and "no loss" in choices["int4-g32"]["conversion"]
    _, fp16_head, _ = run_plan(capsys, *planned.args, "--target", "cpu", "--weights", "int4-g32")
    assert plan["weights_bytes"] < fp16_head["weights_bytes"]
    code, refused, err = run_plan(capsys, *planned.args, "--target", "orin-nano-8gb", "--weights", "int4-g32")
    assert code == 2 and "TensorRT-LLM W4A16 kernels take symmetric groups of 64 / 128" in err
    assert "--target cpu" in err and "--profile ort" in err
    assert cabin_plan([*planned.args, "--target", "orin-nano-8gb"]) == 0
    table = capsys.readouterr().out
    assert "weight formats on orin-nano-8gb (tensorrt runtime):" in table
    assert any(line.split()[:1] == ["int4-g32"] and "no: " in line for line in table.splitlines())
