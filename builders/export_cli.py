"""``cabin-export``: turn an engine folder into graphs for another runtime (today: static-shape ONNX)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from builders.onnx_export import OnnxExportRequest, export_onnx
from builders.onnx_profiles import ONNX_PROFILES
from runtime.checkpoint import CheckpointError
from runtime.cli_args import os_error_message, positive_int
from runtime.kv_modes import ONNX_KV_MODES
from runtime.kv_scales import ScalesError

EXPORT_FORMATS = {"onnx": export_onnx}  # --format -> exporter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-export."""
    parser = argparse.ArgumentParser(
        prog="cabin-export", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Export an engine folder (cabin-build) to two static-shape ONNX graphs: a prompt graph of --chunk "
                    "tokens and a token graph of 1, over a fixed KV window of --context tokens passed in and out, "
                    "with manifest.json beside them. Run them with cabin-chat --backend onnxruntime.")
    parser.add_argument("--engine", required=True, type=Path, help="engine folder written by cabin-build")
    parser.add_argument("--format", default="onnx", choices=tuple(EXPORT_FORMATS), help="graph format")
    parser.add_argument("--output", required=True, type=Path, help="graph folder to write (replaced as a whole)")
    parser.add_argument("--context", type=positive_int, default=2048,
                        help="KV window the graphs see, in tokens: the longest dialogue they hold")
    parser.add_argument("--chunk", type=positive_int, default=64, help="tokens of the prompt graph")
    parser.add_argument("--kv-cache", default="int8", choices=ONNX_KV_MODES,
                        help="K/V form in and out of the graphs (int8: QDQ with the engine's calibrated scales)")
    parser.add_argument("--profile", default="npu", choices=tuple(ONNX_PROFILES),
                        help="; ".join(f"{p.name}: {p.description}" for p in ONNX_PROFILES.values()))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    request = OnnxExportRequest(args.engine, args.output, args.context, args.chunk, args.kv_cache, args.profile)
    try:
        EXPORT_FORMATS[args.format](request, log=lambda msg: print(msg, file=sys.stderr))
    except (CheckpointError, ScalesError, FileExistsError, ValueError) as err:
        print(f"cabin-export: error: {err}", file=sys.stderr)
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
