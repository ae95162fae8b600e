"""``cabin-build``: turn a model into an engine folder (TensorRT-LLM checkpoint + reference engine)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from builders.engine_build import BuildRequest, build_engine
from runtime.checkpoint import CheckpointError
from runtime.kv_cache import KV_MODES
from runtime.kv_scales import ScalesError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-build."""
    parser = argparse.ArgumentParser(
        prog="cabin-build",
        description="Import a model (GGUF file or Hugging Face folder) into a TensorRT-LLM checkpoint "
                    "and write an engine folder with tokenizer, KV scales and manifest.json.",
    )
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), a .gguf file or an HF model folder")
    parser.add_argument("--output", required=True, type=Path, help="engine folder to write, e.g. engines/smollm2-int8")
    parser.add_argument("--kv-cache", default="int8", choices=KV_MODES,
                        help="KV cache storage the engine is built for (default int8). INT8 scales come from a "
                             "quick abs-max measurement on built-in sample dialogues")
    parser.add_argument("--dtype", default="float16", choices=("float16", "float32"), help="stored weight dtype")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    request = BuildRequest(args.model, args.output, args.kv_cache, args.dtype, args.force)
    try:
        build_engine(request, log=lambda msg: print(msg, file=sys.stderr))
    except (CheckpointError, ScalesError, FileExistsError, ValueError) as err:
        print(f"cabin-build: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
