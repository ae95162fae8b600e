"""TensorRT-LLM's ``trtllm-build``: find it, tell its version, choose the flags that version takes, run it.

TensorRT-LLM is never imported at module load: it is optional, and heavy where it exists.

The flags each line takes, with the lines of TensorRT-LLM's source they were checked against:
docs/trtllm-backend.md, "Building".
"""
from __future__ import annotations

import importlib.util
import re
import sys
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path

from cabinllm.runtime.errors import TrtllmError
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR, TRT_ENGINE_DIR, TRTLLM_LOG_FILE
from cabinllm.runtime.kv.modes import kv_mode
from cabinllm.runtime.model.families import family

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LEGACY_FLAGS = "v0.12"
MODERN_FLAGS = "1.x"
TRTLLM_BUILD = "trtllm-build"


@dataclass(frozen=True)
class TrtllmInstall:
    """An installed trtllm-build and the TensorRT-LLM version behind it."""

    executable: str
    version: str

    @property
    def flags(self) -> str:
        """The flag set this version takes: ``v0.12`` or ``1.x``."""
        return flag_set(self.version)


@dataclass(frozen=True)
class EngineShape:
    """The build-time limits of an engine, from the memory plan."""

    kv_dtype: str
    dtype: str  # checkpoint weight dtype, e.g. float16
    tokens_per_block: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    max_beam_width: int = 1  # beams a search may keep (trtllm-build --max_beam_width)
    max_multimodal_len: int = 0  # a vision-language model's image rows over the batch (the prompt table's size)

    @property
    def paged_context_fmha(self) -> bool:
        """Paged context FMHA (needed for KV block reuse and chunked prefill); never with INT8 KV."""
        return kv_mode(self.kv_dtype).trtllm_paged_context_fmha


ARCHITECTURES_FILE = Path(str(resources.files("cabinllm.builders") / "data" / "trtllm_architectures.toml"))


@lru_cache(maxsize=1)
def _architectures() -> dict:
    return tomllib.loads(ARCHITECTURES_FILE.read_text(encoding="utf-8"))


def cannot_build(config: ModelConfig, line: str) -> str | None:
    """Why TensorRT-LLM ``line`` (a release, e.g. 0.12.0-jetson) cannot build this model, or None when it can: the
    family's ``trtllm`` lines (cabinllm.runtime.model.families), then what the line lacks
    (``builders/data/trtllm_architectures.toml``)."""
    flags = flag_set(line)
    table, lines = _architectures()[flags], family(config.architecture).trtllm
    if lines.get(flags, "") is not None:
        return lines.get(flags) or f"TensorRT-LLM {line} does not build {config.architecture}"
    if config.rotary_dim is not None and not table["partial_rotary"]:
        return table["why"]["partial_rotary"]
    return None


def flag_set(version: str) -> str:
    """``v0.12`` for TensorRT-LLM before 0.13, ``1.x`` from 0.13 on (``--kv_cache_type`` arrived then)."""
    match = re.match(r"(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise TrtllmError(f"unrecognised TensorRT-LLM version {version!r}; expected e.g. 0.12.0 or 1.0.0")
    major, minor = int(match.group(1)), int(match.group(2) or 0)
    return LEGACY_FLAGS if (major, minor) < (0, 13) else MODERN_FLAGS


def installed_version() -> str | None:
    """The importable tensorrt_llm's version: package metadata first, else the module's ``__version__``."""
    try:
        return metadata.version("tensorrt_llm")
    except metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec("tensorrt_llm") is None:
        return None
    return getattr(importlib.import_module("tensorrt_llm"), "__version__", None)


def find_trtllm() -> TrtllmInstall | None:
    """The trtllm-build on PATH with its TensorRT-LLM version, or None when it is not installed."""
    executable = shutil.which(TRTLLM_BUILD)
    if executable is None:
        return None
    version = installed_version()
    if version is None:
        raise TrtllmError(f"{executable} is on PATH but this Python cannot import tensorrt_llm to tell its "
                          "version; install cabinllm into the Python environment that has TensorRT-LLM")
    return TrtllmInstall(executable, version)


def build_args(shape: EngineShape, flags: str) -> list[str]:
    """trtllm-build's arguments for an engine of this shape, in the given flag set, run inside the engine folder."""
    paged = ["--paged_kv_cache", "enable"] if flags == LEGACY_FLAGS else ["--kv_cache_type", "paged"]
    gemm = shape.dtype if flags == LEGACY_FLAGS else "auto"
    fmha = "enable" if shape.paged_context_fmha else "disable"
    return [
        "--checkpoint_dir", CHECKPOINT_DIR, "--output_dir", TRT_ENGINE_DIR,  # relative: run inside the folder
        "--gemm_plugin", gemm, *paged, "--tokens_per_block", str(shape.tokens_per_block),
        "--use_paged_context_fmha", fmha,
        "--max_batch_size", str(shape.max_batch_size), "--max_beam_width", str(shape.max_beam_width),
        "--max_input_len", str(shape.max_input_len),
        "--max_seq_len", str(shape.max_seq_len), "--max_num_tokens", str(shape.max_num_tokens),
        *(["--max_multimodal_len", str(shape.max_multimodal_len)] if shape.max_multimodal_len else []),
    ]


def run_trtllm_build(install: TrtllmInstall, args: list[str], folder: Path, failed_log: Path) -> list[str]:
    """Run trtllm-build inside ``folder`` logging to ``folder/trtllm-build.log``; returns the command.

    On failure the log is copied to ``failed_log`` (outside the folder, which the caller
    discards) and TrtllmError quotes its last lines.
    """
    command = [install.executable, *args]
    log_path = folder / TRTLLM_LOG_FILE
    with log_path.open("w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        result = subprocess.run(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        shutil.copyfile(log_path, failed_log)
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-20:])
        raise TrtllmError(f"trtllm-build failed with exit code {result.returncode}; full log kept in {failed_log}; "
                          f"its last lines:\n{tail}")
    return command


def local_sm() -> int | None:
    """This machine's GPU SM version (87 for Orin, 110 for Thor), or None when no CUDA GPU is visible."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
