"""Target profiles (``engines/targets.toml``): memory, SM version, KV dtypes and TensorRT-LLM line per device."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TARGETS_FILE = Path(__file__).resolve().parents[1] / "engines" / "targets.toml"
TARGETS_ENV = "CABIN_TARGETS"
GIB = 1 << 30


class TargetError(ValueError):
    """An unknown target or a malformed profile; the message lists what is known."""


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
    backend: str  # "tensorrt" (trtllm-build engine) or "reference" (the torch runtime)
    tokens_per_block: int
    sm: int | None = None
    trtllm_line: str | None = None
    weights_in_memory: str | None = None  # the dtype the runtime holds weights in, when it is not the stored one
    unsupported_kv: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


def targets_path() -> Path:
    """The profiles file: ``$CABIN_TARGETS`` or ``engines/targets.toml``."""
    return Path(os.environ.get(TARGETS_ENV, TARGETS_FILE))


def load_targets(path: Path | None = None) -> dict[str, Target]:
    """Every profile in the file, by name."""
    path = path or targets_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise TargetError(f"{path}: unreadable target profiles ({err}); restore engines/targets.toml") from err
    known = {f.name for f in fields(Target)}
    targets = {}
    for name, profile in data.items():
        unknown = set(profile) - known
        if unknown:
            raise TargetError(f"{path}: [{name}] has unknown keys {sorted(unknown)}; known: {sorted(known - {'name'})}")
        try:
            kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in profile.items()}
            targets[name] = Target(name=name, **kwargs)
        except TypeError as err:
            raise TargetError(f"{path}: [{name}] is incomplete ({err})") from err
    return targets


def get_target(name: str, path: Path | None = None) -> Target:
    """The profile called ``name``; TargetError listing the known ones otherwise."""
    targets = load_targets(path)
    if name not in targets:
        raise TargetError(f"unknown target {name!r}; known targets: {', '.join(targets)} "
                          f"(profiles in {path or targets_path()})")
    return targets[name]
