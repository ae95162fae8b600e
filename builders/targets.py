"""Target profiles (``builders/data/targets.toml``): memory, backend, KV dtypes and the engine line or NPU graph limits
per device. Every value is parsed and checked here, once."""
from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from importlib import resources
from pathlib import Path

from cabinllm.builders.onnx_profiles import ONNX_PROFILES, PRECISIONS
from cabinllm.runtime.backends.onnxruntime import ORT_PROVIDERS
from cabinllm.runtime.backends.qnn import HTP_PRECISIONS
from cabinllm.runtime.errors import TargetError
from cabinllm.runtime.formats.weight_formats import WEIGHT_FORMATS, weight_format
from cabinllm.runtime.kernels.triton import FP8_CAPABILITY
from cabinllm.runtime.kv.cache import DEFAULT_TOKENS_PER_BLOCK
from cabinllm.runtime.kv.modes import ONNX_KV_MODES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TARGETS_FILE = Path(str(resources.files("cabinllm.builders") / "data" / "targets.toml"))
TARGETS_ENV = "CABIN_TARGETS"
GIB = 1 << 30


class Backend(str, Enum):
    """What runs the model on a target."""

    TENSORRT = "tensorrt"  # a trtllm-build engine
    REFERENCE = "reference"  # the torch reference engine
    ONNX = "onnx"  # cabin-export's static graphs, run by ONNX Runtime on an NPU
    CUDA = "cuda"  # the CUDA runner on the board's GPU: torch, our Triton kernels, CUDA graphs (--device cuda)


# The KV dtypes the CUDA runner's kernels store that a plan offers (runtime/model/cuda.py; fp8 from FP8_CAPABILITY); it
# holds every weight format as stored (quantized ones multiplied by its Triton linears).
CUDA_KV_DTYPES = ("fp16", "int8", "int8-dynamic", "fp8")


@dataclass(frozen=True)
class NpuProfile:
    """How an ONNX target runs cabin-export's graphs (the ``[NAME.npu]`` table)."""

    onnx_profile: str  # cabin-export --profile
    ort_provider: str  # cabin-chat --ort-provider
    htp_arch: int  # the Hexagon HTP's architecture (cabin-export --htp-arch): which precisions it runs
    default_chunk: int  # prompt-graph tokens the plan takes when memory allows
    graph_memory_gib: float | None = None  # most the graphs' QNN context may hold on the NPU (one copy of the fp16
    # weights, both graphs' windows and activations)
    # precision -> what it measured on this HTP (perplexity_pct, top1_pct, tokens, model, source)
    measured: dict[str, dict] = field(default_factory=dict)

    def cost(self, precision: str) -> str:
        """One line of what a precision measured on this HTP, or that it was not measured."""
        m = self.measured.get(precision)
        if m is None:
            return f"{precision}: not measured on HTP v{self.htp_arch}"
        return (f"{precision}: {m['perplexity_pct']:+.2f}% perplexity, top-1 {m['top1_pct']:.1f}% against fp32 over "
                f"{m['tokens']:,} held-out tokens of {m['model']} ({m['source']})")

    @property
    def precisions(self) -> tuple[str, ...]:
        """The graph precisions (cabin-export --precision) this NPU runs, the default first."""
        return HTP_PRECISIONS[self.htp_arch]

    @property
    def float16(self) -> bool:
        """The NPU computes float graphs (in fp16); else only quantized (A16W8) ones."""
        return "fp16" in self.precisions

    def precision_for(self, kv_dtype: str) -> str:
        """The first precision this NPU runs that takes K/V in ``kv_dtype``."""
        return next(p for p in self.precisions if kv_dtype in PRECISIONS[p].kv_caches)


@dataclass(frozen=True)
class Target:
    """One device the engine is built for."""

    name: str
    description: str
    memory_gib: float
    os_reserve_gib: float
    co_resident_gib: float
    runtime_overhead_gib: float
    kv_dtypes: tuple[str, ...]
    weight_formats: tuple[str, ...]
    backend: Backend
    tokens_per_block: int
    sm: int | None = None
    trtllm_line: str | None = None
    weights_in_memory: str | None = None  # the dtype the runtime holds weights in, when it is not the stored one
    unsupported_kv: dict[str, str] = field(default_factory=dict)
    npu: NpuProfile | None = None  # ONNX targets only
    cuda_overhead_gib: float | None = None  # a GPU target's runtime overhead under the CUDA runner

    def on_cuda(self) -> "Target":
        """This device run by the CUDA runner (``cabin-plan --backend cuda``); TargetError where it has no GPU."""
        if self.sm is None or self.cuda_overhead_gib is None:
            raise TargetError(f"{self.name} has no CUDA GPU profile (sm and cuda_overhead_gib in its table); the "
                              "CUDA runner plans for the Jetson Orin and Thor targets")
        fp8 = divmod(self.sm, 10) >= FP8_CAPABILITY
        return replace(self, backend=Backend.CUDA, weight_formats=tuple(WEIGHT_FORMATS),
                       kv_dtypes=CUDA_KV_DTYPES if fp8 else tuple(d for d in CUDA_KV_DTYPES if d != "fp8"),
                       runtime_overhead_gib=self.cuda_overhead_gib, trtllm_line=None, weights_in_memory=None,
                       tokens_per_block=DEFAULT_TOKENS_PER_BLOCK,
                       unsupported_kv={} if fp8 else {"fp8": f"{self.name} is SM{self.sm}: fp8 KV needs SM89 or newer"})

    def weights_refusal(self, weights: str) -> str | None:
        """Why this target's runtime does not take a weight format, or None."""
        if weights in self.weight_formats:
            return None
        if self.backend is Backend.TENSORRT and not weight_format(weights).trtllm:
            why = (f"{self.name}'s TensorRT-LLM W4A16 kernels take symmetric groups of 64 / 128 only, not "
                   f"{weights}'s blocks of 32 with a minimum; it runs on the reference engine (--target cpu) and "
                   f"ONNX Runtime (cabin-export --profile ort)")
        else:
            why = f"{weights} weights are not available on {self.name}"
        return f"{why}; it takes {', '.join(self.weight_formats)}"

    def head_refusal(self, head: str) -> str | None:
        """Why this target's runtime does not take a head format (an int8 head runs on the reference engine only),
        or None."""
        if head == "fp16" or self.backend is Backend.REFERENCE:
            return None
        return (f"--head {head} runs on the reference engine only ({self.name}'s {self.backend.value} runtime reads "
                "the embedding and lm_head in fp16); use --head fp16 or --target cpu")

    def to_dict(self) -> dict:
        """JSON-ready form (``npu`` only where there is one)."""
        out = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}
        out["backend"] = self.backend.value
        if self.npu is None:
            del out["npu"]
        else:
            out["npu"] = {**asdict(self.npu), "precisions": list(self.npu.precisions)}
        return out


def targets_path() -> Path:
    """The profiles file: ``$CABIN_TARGETS`` or ``builders/data/targets.toml``."""
    return Path(os.environ.get(TARGETS_ENV, TARGETS_FILE))


def load_targets(path: Path | None = None) -> dict[str, Target]:
    """Every profile in the file, by name."""
    path = path or targets_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise TargetError(f"{path}: unreadable target profiles ({err}); restore builders/data/targets.toml") from err
    return {name: _parse(name, profile, path) for name, profile in data.items()}


def _parse(name: str, profile: dict, path: Path) -> Target:
    """One profile, checked: known keys, a known backend, an ``npu`` table exactly on ONNX targets."""
    _check_keys(name, profile, {f.name for f in fields(Target)} - {"name"}, path)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in profile.items()}
    try:
        kwargs["backend"] = Backend(profile.get("backend"))
    except ValueError:
        raise TargetError(f"{path}: [{name}] backend {profile.get('backend')!r} is not one of "
                          f"{', '.join(b.value for b in Backend)}") from None
    npu = profile.get("npu")
    if (npu is not None) != (kwargs["backend"] is Backend.ONNX):
        raise TargetError(f"{path}: [{name}] needs a [{name}.npu] table exactly when backend = \"onnx\"")
    try:
        if npu is not None:
            _check_keys(f"{name}.npu", npu, {f.name for f in fields(NpuProfile)}, path)
            kwargs["npu"] = NpuProfile(**npu)
        target = Target(name=name, **kwargs)
    except TypeError as err:
        raise TargetError(f"{path}: [{name}] is incomplete ({err})") from err
    if target.npu is not None:
        _check_npu(target, path)
    return target


def _check_keys(table: str, values: dict, known: set[str], path: Path) -> None:
    unknown = set(values) - known
    if unknown:
        raise TargetError(f"{path}: [{table}] has unknown keys {sorted(unknown)}; known: {sorted(known)}")


def _check_npu(target: Target, path: Path) -> None:
    """TargetError when an ONNX target names a profile, provider or KV dtype the export and runtime lack."""
    npu, where = target.npu, f"{path}: [{target.name}.npu]"
    if npu.onnx_profile not in ONNX_PROFILES:
        raise TargetError(f"{where} onnx_profile {npu.onnx_profile!r} is not one of {', '.join(ONNX_PROFILES)}")
    if npu.ort_provider not in ORT_PROVIDERS:
        raise TargetError(f"{where} ort_provider {npu.ort_provider!r} is not one of {', '.join(ORT_PROVIDERS)}")
    if npu.htp_arch not in HTP_PRECISIONS:
        raise TargetError(f"{where} htp_arch {npu.htp_arch} is not one of {', '.join(map(str, HTP_PRECISIONS))}")
    kv_precisions = {kv: [p for p in npu.precisions if kv in PRECISIONS[p].kv_caches] for kv in target.kv_dtypes}
    if not all(kv_precisions.values()):
        raise TargetError(f"{where}: HTP v{npu.htp_arch} runs {', '.join(npu.precisions)} graphs, which take none of "
                          f"kv_dtypes {[kv for kv, ps in kv_precisions.items() if not ps]}")
    if npu.default_chunk < 1:
        raise TargetError(f"{where} default_chunk must be at least 1, got {npu.default_chunk}")
    if not set(target.kv_dtypes) <= set(ONNX_KV_MODES):
        raise TargetError(f"{path}: [{target.name}] kv_dtypes {list(target.kv_dtypes)}: the graphs take "
                          f"{', '.join(ONNX_KV_MODES)} only")


def get_target(name: str, path: Path | None = None) -> Target:
    """The profile called ``name``; TargetError listing the known ones otherwise."""
    targets = load_targets(path)
    if name not in targets:
        raise TargetError(f"unknown target {name!r}; known targets: {', '.join(targets)} "
                          f"(profiles in {path or targets_path()})")
    return targets[name]
