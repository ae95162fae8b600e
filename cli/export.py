"""``cabin-export``: turn an engine folder into graphs for another runtime (today: static-shape ONNX)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cabinllm.builders.graph_plan import GraphPlan
from cabinllm.builders.onnx_export import OnnxExportRequest, export_onnx
from cabinllm.builders.onnx_profiles import ONNX_PROFILES, PRECISIONS
from cabinllm.builders.planner import PlanRequest, working_plan
from cabinllm.builders.qnn_precision import PrecisionPlan, read_plan
from cabinllm.builders.qnn_quantize import CalibrationData
from cabinllm.builders.targets import Backend, get_target, load_targets
from cabinllm.cli.args import add_kv_cache, cli_message, entry_point, os_error_message, positive_int
from cabinllm.runtime.backends.qnn import HTP_PRECISIONS
from cabinllm.runtime.errors import CabinError, CheckpointError, TargetError
from cabinllm.runtime.formats.engine_folder import MANIFEST_FILE, read_manifest
from cabinllm.runtime.kv.modes import ONNX_KV_MODES
from cabinllm.runtime.sources.model_source import load_model_config

EXPORT_FORMATS = {"onnx": export_onnx}  # --format -> exporter
DEFAULT_CONTEXT, DEFAULT_CHUNK, DEFAULT_KV, DEFAULT_PROFILE = 2048, 64, "int8", "npu"  # without --target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-export."""
    parser = argparse.ArgumentParser(
        prog="cabin-export",
        description="Export an engine folder (cabin-build) to two static-shape ONNX graphs: a prompt graph of --chunk "
                    "tokens and a token graph of 1, over a fixed KV window of --context tokens passed in and out, "
                    "with manifest.json beside them. Run them with cabin-chat --backend onnxruntime.")
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--format", default="onnx", choices=tuple(EXPORT_FORMATS), help="graph format (default onnx)")
    parser.add_argument("--output", required=True, type=Path, help="graph folder to write (replaced as a whole)")
    parser.add_argument("--target", help="an NPU target from builders/data/targets.toml (e.g. sa8775p-36gb): take "
                        "--context, --chunk, --kv-cache, --profile, --precision and --htp-arch from cabin-plan's plan of the engine's model "
                        "there; a flag given as well wins (default: none)")
    parser.add_argument("--context", type=positive_int,
                        help=f"KV window the graphs see, in tokens: the longest dialogue they hold (default "
                             f"{DEFAULT_CONTEXT}, or the --target plan's)")
    parser.add_argument("--chunk", type=positive_int,
                        help=f"tokens of the prompt graph (default {DEFAULT_CHUNK}, or the --target plan's)")
    add_kv_cache(parser, "K/V form in and out of the graphs (int8: QDQ with the engine's calibrated scales)",
                 ONNX_KV_MODES, default_help=f"{DEFAULT_KV}, or the first the --target plan fits")
    parser.add_argument("--profile", choices=tuple(ONNX_PROFILES),
                        help="; ".join(f"{p.name}: {p.description}" for p in ONNX_PROFILES.values())
                        + f" (default {DEFAULT_PROFILE}, or the --target's)")
    parser.add_argument("--precision", choices=tuple(PRECISIONS),
                        help="; ".join(f"{p.name}: {p.description}" for p in PRECISIONS.values())
                        + " (default: the profile's first, npu a16w8 and ort fp16, or the --target's)")
    parser.add_argument("--htp-arch", type=int, choices=tuple(HTP_PRECISIONS),
                        help="compile both graphs for this Hexagon HTP architecture into QNN context binaries beside "
                             "them (needs onnxruntime-qnn; 68: SA8295P, a16w8 only; 73: SA8775P) (default: none, or "
                             "the --target's)")
    parser.add_argument("--calibration-data", default=CalibrationData.data,
                        help="a16w8: dialogues the activations are calibrated on: builtin, sharegpt or a JSONL file "
                             f"(default {CalibrationData.data})")
    parser.add_argument("--calibration-dialogues", type=positive_int, default=CalibrationData.num_dialogues,
                        help=f"a16w8: how many (default {CalibrationData.num_dialogues})")
    parser.add_argument("--calibration-tokens", type=positive_int, default=CalibrationData.max_tokens,
                        help=f"a16w8: tokens per dialogue at most (default {CalibrationData.max_tokens})")
    parser.add_argument("--precision-plan", type=Path,
                        help="a16w8: the weights to store in 16 bits, a plan written by python -m "
                             "cabinllm.benchmarks.studies.npu_sensitivity for this model and HTP (default: none, "
                             "every weight in 8 bits)")
    return parser.parse_args(argv)


def export_request(args: argparse.Namespace) -> OnnxExportRequest:
    """The export the arguments ask for: the flags given, then the --target plan's values, then the defaults."""
    planned = target_graphs(args.engine, args.target, args.kv_cache) if args.target else None
    context = args.context or (planned.context if planned else DEFAULT_CONTEXT)
    chunk = args.chunk or (planned.chunk if planned else DEFAULT_CHUNK)
    kv_cache = args.kv_cache or (planned.kv_cache if planned else DEFAULT_KV)
    profile = args.profile or (planned.profile if planned else DEFAULT_PROFILE)
    precision = args.precision or (planned.precision if planned else None)
    htp_arch = args.htp_arch or (planned.htp_arch if planned else None)
    calibration = CalibrationData(args.calibration_data, args.calibration_dialogues, args.calibration_tokens)
    plan = read_plan(args.precision_plan) if args.precision_plan else PrecisionPlan()
    return OnnxExportRequest(args.engine, args.output, context, chunk, kv_cache, profile, precision, htp_arch,
                             calibration, plan)


def target_graphs(engine: Path, target_name: str, kv_cache: str | None) -> GraphPlan:
    """The graphs cabin-plan plans for the engine's model on an NPU target (the first KV dtype that fits, unless
    one is given); TargetError for a target that is not an NPU one, PlanRefused when nothing fits."""
    target = get_target(target_name)
    if read_manifest(engine) is None:
        raise CheckpointError(f"{engine}: not an engine folder (no readable {MANIFEST_FILE}); build one with "
                              f"cabin-build --target {target_name} --output {engine}")
    if target.backend is not Backend.ONNX:
        npu = [t.name for t in load_targets().values() if t.backend is Backend.ONNX]
        raise TargetError(f"--target {target_name} runs {target.backend.value} engines, not ONNX graphs; give an NPU "
                          f"target ({', '.join(npu)}) or leave --target out")
    plan = working_plan(PlanRequest(str(engine), target, kv_dtype=kv_cache), load_model_config(str(engine)))
    return next(kv.graphs for kv in plan.kv.values() if kv.graphs)


@entry_point("cabin-export")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    try:
        request = export_request(args)
        EXPORT_FORMATS[args.format](request, log=lambda msg: print(msg, file=sys.stderr))
    except (CabinError, FileExistsError) as err:
        print(f"cabin-export: error: {cli_message(err)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        print(f"cabin-export: error: {err.name} is not installed; pip install 'cabinllm[onnx]'", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"cabin-export: error: {os_error_message(err, args.output)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
