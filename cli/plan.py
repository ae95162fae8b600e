"""``cabin-plan``: will the model fit the target next to the other models, and for how long a dialogue?"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from cabinllm.builders.audio_plan import SPEECH_SECONDS
from cabinllm.builders.dialogue_turns import MediaCost, TurnTokens
from cabinllm.builders.graph_plan import ENGINE_PLACEHOLDER, GRAPHS_PLACEHOLDER, GraphPlan
from cabinllm.builders.planner import MIB, KVPlan, Plan, PlanRequest, weight_choices, working_plan
from cabinllm.builders.targets import GIB, Backend, get_target
from cabinllm.cli.args import (add_kv_cache, cli_message, entry_point, float_range, int_range, os_error_message,
                               output_name, reserve_gib)
from cabinllm.runtime.errors import CabinError, ConfigError, PlanRefused
from cabinllm.runtime.formats.weight_formats import HEAD_FORMATS, WEIGHT_FORMATS
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.modes import KV_MODES
from cabinllm.runtime.sources.model_source import load_model_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-plan."""
    parser = argparse.ArgumentParser(prog="cabin-plan", description=(
        "Plan a model's memory on a target: weights, KV bytes per token for each KV dtype the target "
        "allows, activations, KV pool, dialogue turns and the trtllm-build limits, or on an NPU target the "
        "cabin-export arguments (KV window and prompt-graph tokens) and the cabin-chat budget."))
    parser.add_argument("--model", default="default",
                        help="'default' (the embedded SmolLM2-135M-Instruct, the default), a .gguf file, an HF model "
                             "folder, or a bare HF config.json")
    parser.add_argument("--target", required=True, help="target profile from builders/data/targets.toml, e.g. "
                        "orin-nano-8gb, or an NPU target such as sa8775p-36gb")
    parser.add_argument("--reserve-gb", type=reserve_gib, help="GiB held for co-resident models (ASR, TTS, vision); "
                        "default: the profile's")
    parser.add_argument("--weights", default="fp16", choices=tuple(WEIGHT_FORMATS), help="weight storage (default fp16)")
    parser.add_argument("--head", default="fp16", choices=tuple(HEAD_FORMATS),
                        help="embedding and lm_head storage: fp16, or int8 with a scale per 32 (the reference "
                             "engine only; default fp16)")
    add_kv_cache(parser, "plan one KV dtype only (refused when the target cannot run it)", tuple(KV_MODES),
                 default_help="every KV dtype the target takes")
    parser.add_argument("--max-beam-width", type=int_range(1), default=1, metavar="N",
                        help="beams the TensorRT engine searches (trtllm-build --max_beam_width); the KV pool then "
                             "holds a search over the longest prompt (default 1: no beam search)")
    parser.add_argument("--backend", choices=("tensorrt", "cuda"),
                        help="what runs the model on a GPU target: its TensorRT-LLM engine (tensorrt) or the CUDA "
                             "runner, torch with our Triton kernels (cuda: cabin-chat --device cuda); default: the "
                             "target's own")
    parser.add_argument("--speech-seconds", type=float_range(0.1, 600.0), default=SPEECH_SECONDS, metavar="S",
                        help="seconds of speech a user's turn holds, for an audio-language model (Qwen2-Audio: 25 "
                             f"tokens a second; default {SPEECH_SECONDS:g})")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (default: a table)")
    return parser.parse_args(argv)


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan for the arguments; PlanRefused (with the nearest working plan) when it cannot work."""
    config = load_model_config(args.model)
    target = get_target(args.target)
    if args.backend == "cuda":
        target = target.on_cuda()
    elif args.backend and args.backend != target.backend.value:
        raise ConfigError(f"--backend {args.backend}: {target.name} runs {target.backend.value}; leave --backend out")
    request = PlanRequest(args.model, target, args.weights, args.reserve_gb, args.kv_cache, args.max_beam_width,
                          args.head, args.speech_seconds)
    return working_plan(request, config)


def format_table(plan: Plan) -> str:
    """The plan as text: the memory budget, then one column per KV dtype, then the warnings and the commands."""
    t, c, turn = plan.target, plan.config, plan.turn
    line = f", TensorRT-LLM {t.trtllm_line}" if t.trtllm_line else ""
    sm = f", SM{t.sm}" if t.sm else ""
    npu = (f"; Hexagon HTP v{t.npu.htp_arch} ({' or '.join(t.npu.precisions)}): cabin-export --profile "
           f"{t.npu.onnx_profile} --htp-arch {t.npu.htp_arch}, --ort-provider {t.npu.ort_provider}" if t.npu else "")
    held = f" (floats as {t.weights_in_memory})" if t.weights_in_memory else ""
    head = f" + {plan.request.head} head" if plan.request.head != "fp16" else ""
    lines = [
        f"{plan.request.model} ({c.architecture}, {c.num_hidden_layers} layers, {c.num_key_value_heads} KV heads x "
        f"{c.head_size}, context {c.max_position_embeddings}) on {t.name}: {t.description}{sm}{line}{npu}",
        f"memory: {t.memory_gib:.2f} GiB - OS {t.os_reserve_gib:.2f} - co-resident {plan.co_resident_bytes / GIB:.2f}"
        f" - runtime {t.runtime_overhead_gib:.2f} - {plan.request.weights} weights{head}{held} {plan.weights_bytes / GIB:.2f}"
        f"{f' - vision {plan.images.memory_bytes / GIB:.2f}' if plan.images else ''}"
        f"{f' - audio {plan.audio.memory_bytes / GIB:.2f}' if plan.audio else ''}"
        f" = {plan.budget_bytes / GIB:.2f} GiB for activations and KV",
        f"weight formats on {t.name} ({t.backend.value} runtime):",
        *(f"  {w['weights']:<9} {_mib(w['bytes']) if w['bytes'] else '-':>7} MiB  "
          f"{w['conversion'] if w['taken'] else 'no: ' + w['why_not']}" for w in weight_choices(c, t, plan.request.head)),
        f"one turn = {turn.per_turn} tokens (user {turn.user} + assistant {turn.assistant}), system prompt "
        f"{turn.system}; measured on {turn.measured_on} with the {turn.tokenizer} tokenizer",
        *_picture_lines(plan),
        *_speech_lines(plan),
        "",
    ]
    rows = GRAPH_ROWS if t.backend is Backend.ONNX else ENGINE_ROWS
    if plan.images:
        rows = rows + _media_rows(plan.images, "picture", "a picture", turn)
    if plan.audio:
        rows = rows + _media_rows(plan.audio, "turn of speech", "speech", turn)
    if not any(kv.window_bytes for kv in plan.kv.values()):
        rows = [row for row in rows if row[0] != WINDOW_ROW]
    width = max(len(name) for name, _ in rows) + 2
    col = max(13, *(len(name) + 2 for name in plan.kv))
    lines.append(" " * width + "".join(f"{name:>{col}}" for name in plan.kv))
    for name, cell in rows:
        lines.append(f"{name:<{width}}" + "".join(f"{cell(kv):>{col}}" for kv in plan.kv.values()))
    if plan.warnings:
        lines += ["", "warnings:"] + [f"  - {w}" for w in plan.warnings]
    for kv in plan.kv.values():
        if kv.trtllm_build_args:
            lines.append(f"trtllm-build for {kv.kv_dtype} KV (run in the engine folder): "
                         f"trtllm-build {' '.join(kv.trtllm_build_args)}")
        if t.backend is Backend.CUDA and kv.fits:
            lines.append(f"{kv.kv_dtype} KV on the CUDA runner: cabin-chat --engine {ENGINE_PLACEHOLDER} --device cuda "
                         f"--kv-cache {kv.kv_dtype} --kv-budget-mb {cdiv(kv.kv_pool_bytes, MIB)}")
        if kv.graphs:
            lines.append(f"{kv.kv_dtype} KV: {kv.graphs.export_command()}")
            lines.append(f"  then on the board: {kv.graphs.chat_command()}")
    if t.backend is Backend.ONNX and any(kv.graphs for kv in plan.kv.values()):
        weights = f" --weights {plan.request.weights}" if plan.request.weights != "fp16" else ""
        lines.append(f"{ENGINE_PLACEHOLDER}: the folder cabin-build --target {t.name}{weights} writes; "
                     f"{GRAPHS_PLACEHOLDER}: where the graphs go")
    return "\n".join(lines)


def _picture_lines(plan: Plan) -> list[str]:
    """What a vision-language model's pictures cost, in words (none for a text model)."""
    i = plan.images
    if i is None:
        return []
    return [f"pictures: a {i.picture[0]}x{i.picture[1]} camera frame takes {i.tokens} tokens ({i.tokens_low} with "
            f"detail low), counted by the model's processor; vision tower + projector {_mib(i.vision_weight_bytes)} "
            f"MiB (fp16), encoder output cache {_mib(i.feature_cache_bytes)} MiB"]


def _speech_lines(plan: Plan) -> list[str]:
    """What an audio-language model's speech costs, in words (none for another model)."""
    a = plan.audio
    if a is None:
        return []
    return [f"speech: {a.seconds:g} s a turn takes {a.tokens} tokens, counted by the model's processor; audio encoder "
            f"+ projector {_mib(a.encoder_weight_bytes)} MiB (fp16), encoder output cache "
            f"{_mib(a.feature_cache_bytes)} MiB"]


def _media_rows(cost: MediaCost, per: str, turns: str, turn: TurnTokens) -> list[tuple[str, Callable[[KVPlan], str]]]:
    """Table rows of a medium's KV (``per``: "picture", ...) and of the turns with one (``turns``: "a picture", ...)
    that one conversation holds."""
    return [(f"KV MiB per {per}", lambda kv: f"{cost.kv_bytes(kv.bytes_per_token) / MIB:,.2f}"),
            (f"turns with {turns}", lambda kv: f"{cost.turns(kv.max_seq_len, turn):,}")]


def _mib(value: int) -> str:
    return f"{value / MIB:,.0f}"


def _graphs(cell: Callable[[GraphPlan], str]) -> Callable[[KVPlan], str]:
    """A table cell of the graphs' plan; '-' where the dtype does not fit."""
    return lambda kv: cell(kv.graphs) if kv.graphs else "-"


WINDOW_ROW = "KV window MiB (local layers)"
ENGINE_ROWS: list[tuple[str, Callable[[KVPlan], str]]] = [
    ("KV bytes/token", lambda kv: f"{kv.bytes_per_token:,}"),
    (WINDOW_ROW, lambda kv: _mib(kv.window_bytes)),
    ("activations MiB", lambda kv: _mib(kv.activation_bytes)),
    ("KV tokens memory holds", lambda kv: f"{kv.max_kv_tokens:,}"),
    ("max_seq_len", lambda kv: f"{kv.max_seq_len:,}"),
    ("max_input_len", lambda kv: f"{kv.max_input_len:,}"),
    ("max_num_tokens", lambda kv: f"{kv.max_num_tokens:,}"),
    ("tokens_per_block", lambda kv: str(kv.tokens_per_block)),
    ("max_beam_width", lambda kv: str(kv.max_beam_width)),
    ("KV blocks", lambda kv: f"{kv.num_blocks:,}"),
    ("KV pool MiB", lambda kv: _mib(kv.kv_pool_bytes)),
    ("memory left GiB", lambda kv: f"{kv.memory_left_bytes / GIB:,.2f}"),
    ("est. turns", lambda kv: f"{kv.est_turns:,}"),
    ("prefill tokens/turn", lambda kv: f"{kv.prefill_tokens_per_turn['mean']:,}"),
    ("block reuse", lambda kv: "yes" if kv.block_reuse else "no"),
    ("fits", lambda kv: "yes" if kv.fits else "NO"),
]
GRAPH_ROWS: list[tuple[str, Callable[[KVPlan], str]]] = [
    ("KV bytes/token", lambda kv: f"{kv.bytes_per_token:,}"),
    ("--context (KV window)", lambda kv: f"{kv.max_seq_len:,}"),
    ("--chunk (prompt graph)", lambda kv: f"{kv.max_num_tokens:,}"),
    ("KV tokens memory holds", lambda kv: f"{kv.max_kv_tokens:,}"),
    ("graphs' KV in/out MiB", _graphs(lambda g: _mib(g.kv_io_bytes))),
    ("host window MiB", _graphs(lambda g: _mib(g.window_bytes))),
    ("host paged cache MiB", _graphs(lambda g: _mib(g.cache_bytes))),
    ("activations MiB", lambda kv: _mib(kv.activation_bytes)),
    ("NPU context MiB (both graphs)", _graphs(lambda g: _mib(g.npu_graph_bytes) if g.npu_graph_bytes else "-")),
    ("memory left GiB", lambda kv: f"{kv.memory_left_bytes / GIB:,.2f}"),
    ("est. turns", lambda kv: f"{kv.est_turns:,}"),
    ("prefill tokens/turn", lambda kv: f"{kv.prefill_tokens_per_turn['mean']:,}"),
    ("fits", lambda kv: "yes" if kv.fits else "NO"),
]


@entry_point("cabin-plan")
def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 with the plan, 2 with a refusal (reason and nearest working config) or bad input."""
    args = parse_args(argv)
    try:
        plan = plan_from_args(args)
    except PlanRefused as refused:
        if args.json:
            nearest = refused.nearest.to_json() if refused.nearest else None
            print(json.dumps({"refused": {"reason": refused.reason, "nearest": nearest}}, indent=2))
        print(f"cabin-plan: refused: {refused}", file=sys.stderr)
        return 2
    except CabinError as err:
        print(f"cabin-plan: error: {cli_message(err)}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(plan.to_json(), indent=2) if args.json else format_table(plan), flush=True)
    except OSError as err:  # a full disk under --json > FILE
        print(f"cabin-plan: error: {os_error_message(err, output_name(sys.stdout))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
