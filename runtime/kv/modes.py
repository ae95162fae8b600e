"""The one registry of KV cache modes: every list of modes (CLI choices, eval, bench, planner,
session files, trtllm-build flags) is derived from ``KV_MODES``.

Adding a mode: write its storage class (``cabinllm.runtime.kv.storage``, or a module of its own as
``cabinllm.runtime.kv.int4``), list it below, and give it a decode kernel if it needs one. Renaming one: list its
former name in ``KV_MODE_ALIASES``, so that files and flags that still say it keep working.
"""
from __future__ import annotations

import functools
import warnings

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.kv.int4 import Int4KV
from cabinllm.runtime.kv.storage import (Fp8KV, Fp16KV, Fp32KV, Int8DynamicKV, Int8KV, Int8SeparateKV, KVLayout,
                                         KVStorage)

KVMode = type[KVStorage]
KV_MODES: dict[str, KVMode] = {mode.name: mode for mode in (
    Fp32KV, Fp16KV, Int8KV, Int8SeparateKV, Int8DynamicKV, Int4KV, Fp8KV)}
REFERENCE_KV_MODES = tuple(name for name, mode in KV_MODES.items() if mode.reference)
ONNX_KV_MODES = tuple(name for name, mode in KV_MODES.items() if mode.onnx_graph)
KV_MODE_ALIASES: dict[str, str] = {"int8-shared": "int8"}  # former name -> the registry's, still read


def kv_mode_name(name: str) -> str:
    """The registry's name of a mode: ``name`` itself, or the name a former one has now (with a warning, once)."""
    current = KV_MODE_ALIASES.get(name)
    if current is None:
        return name
    _warn_renamed(name, current)
    return current


@functools.cache
def _warn_renamed(former: str, current: str) -> None:
    warnings.warn(f"KV mode {former!r} is now called {current!r} and read as it; say {current!r} in flags and files",
                  FutureWarning, stacklevel=3)


def kv_mode(name: str) -> KVMode:
    """The storage class of a mode name (or of a former name); ConfigError naming the known modes otherwise."""
    try:
        return KV_MODES[kv_mode_name(name)]
    except KeyError:
        raise ConfigError(f"unknown KV cache mode {name!r}; choose one of {', '.join(KV_MODES)}") from None


def bytes_per_token(layout: KVLayout, name: str, tokens_per_block: int) -> int:
    """Bytes one token of a mode takes in the blocks, all layers, K and V, scales included."""
    return kv_mode(name).bytes_per_token(layout, tokens_per_block)
