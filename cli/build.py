"""``cabin-build``: turn a model into an engine folder for a target (checkpoint, KV scales, plan, TensorRT engine)."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from cabinllm.builders.engine_build import DEFAULT_SYSTEM_PROMPT, BuildRequest, build_engine
from cabinllm.builders.targets import Backend, get_target
from cabinllm.cli.args import add_kv_cache, cli_message, entry_point, int_range, os_error_message, reserve_gib
from cabinllm.runtime.errors import CabinError, ConfigError
from cabinllm.runtime.formats.chat_script import text_problem
from cabinllm.runtime.formats.weight_formats import HEAD_FORMATS, WEIGHT_FORMATS
from cabinllm.runtime.kv.modes import KV_MODES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-build."""
    parser = argparse.ArgumentParser(
        prog="cabin-build",
        description="Import a model (GGUF file, Hugging Face folder or TensorRT-LLM checkpoint folder) into a "
                    "TensorRT-LLM checkpoint (weights full precision, W8A16 or W4A16_AWQ) with KV cache "
                    "quantization, plan its memory on the target, run trtllm-build where it is installed (else "
                    "record it as the step to run on the device; on an NPU target, record the planned cabin-export "
                    "command) and write an engine folder with manifest.json.",
    )
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct, the default), a .gguf file, an HF model "
                             "folder or a TensorRT-LLM checkpoint folder (with its tokenizer files)")
    parser.add_argument("--target", default="cpu", help="target profile from builders/data/targets.toml (default "
                        "cpu); an NPU target (e.g. sa8775p-36gb) takes the graphs cabin-export writes from the "
                        "folder next")
    parser.add_argument("--output", required=True, type=Path, help="engine folder to write, e.g. engines/smollm2-int8")
    add_kv_cache(parser, "KV cache storage the engine is built for; must be one the target takes", tuple(KV_MODES),
                 default=BuildRequest.kv_cache)
    parser.add_argument("--scales", type=Path, help="calibrated kv_scales.json for this model (default: a quick "
                        "abs-max measurement on built-in sample exchanges)")
    parser.add_argument("--calibrate", metavar="DATA", help="calibrate KV scales now on dialogues: builtin "
                        "(cockpit set), sharegpt, or a .jsonl / ShareGPT .json file (instead of --scales)")
    parser.add_argument("--equalize", action=argparse.BooleanOptionalAction,
                        help="fold KV equalization into the weights: factors from the calibrated per-channel "
                             "ranges, and the turn that stores the calibration data's first token's K/V exactly "
                             "(default: on for an NPU target with int8 KV and no --scales, calibrated on builtin "
                             "unless --calibrate names other data: measured, INT8 KV alone costs +0.47%% perplexity "
                             "equalized, +2.40%% not; off elsewhere)")
    parser.add_argument("--reserve-gb", type=reserve_gib,
                        help="GiB held for co-resident models; default: the profile's")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                        help="stored dtype of full-precision weights (default float16)")
    parser.add_argument("--weights", default="fp16", choices=tuple(WEIGHT_FORMATS),
                        help="weight format: fp16 (full precision, as --dtype), int8 (W8A16) or int4-awq (W4A16_AWQ, "
                             "group 128 where the input sizes allow, else 64), quantized with ModelOpt on the "
                             "--calibrate dialogues (default builtin); int4-g32 (4-bit, scale and minimum per 32 "
                             "inputs: a GGUF's Q4_0 / Q4_1 tensors taken as stored, others rounded to Q4_1; CPU and "
                             "ONNX targets only); int4-g32-a8 (the same blocks, each layer's input rounded to int8 "
                             "per 32 as llama.cpp computes: faster decode on the CPU, --target cpu only); a "
                             "TensorRT-LLM checkpoint given as --model keeps its own (default fp16)")
    parser.add_argument("--head", default="fp16", choices=tuple(HEAD_FORMATS),
                        help="embedding and lm_head storage: fp16, or int8 with an fp16 scale per 32 (a GGUF's "
                             "Q8_0 table taken as stored, others rounded to Q8_0; half the bytes the decode step "
                             "reads for the head; --target cpu only) (default fp16)")
    parser.add_argument("--max-beam-width", type=int_range(1), default=1, metavar="N",
                        help="beams the TensorRT engine can search (trtllm-build --max_beam_width; its KV pool is "
                             "planned for them); TensorRT targets only (default 1: no beam search)")
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT,
                        help="the engine's default system prompt, recorded in manifest.json (cabin-chat --system "
                             "overrides it; \"\" for none); default: %(default)r")
    parser.add_argument("--force", action="store_true", help="rebuild even when the output is up to date, or "
                        "replace an engine folder built from other inputs")
    return parser.parse_args(argv)


def npu_target(name: str | None) -> bool:
    """Whether a --target names an NPU (ONNX) target."""
    return name is not None and get_target(name).backend is Backend.ONNX


@entry_point("cabin-build")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    try:
        npu_default = (args.equalize is None and args.scales is None and args.kv_cache == "int8"
                       and npu_target(args.target))
        equalize = bool(args.equalize) or npu_default
        if equalize and args.kv_cache == "fp8":
            warnings.warn("equalization is made for int8's grid: on the default model it raised fp8 KV's KL from "
                          "0.0097 to 0.0117 (docs/kv-cache.md, fp8 against int8); --no-equalize keeps fp8 on the "
                          "model's own weights")
        calibrate = args.calibrate or ("builtin" if npu_default else None)
        request = BuildRequest(args.model, args.output, args.kv_cache, args.dtype, args.force, args.target,
                               args.scales, equalize, args.reserve_gb, calibrate, args.system_prompt, args.weights,
                               args.max_beam_width, args.head)
        if problem := text_problem(args.system_prompt):
            raise ConfigError(f"--system-prompt {problem}")
        build_engine(request, log=lambda msg: print(msg, file=sys.stderr))
    except (CabinError, FileExistsError) as err:
        print(f"cabin-build: error: {cli_message(err)}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"cabin-build: error: {os_error_message(err, args.output)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
