"""The one registry of KV cache modes: every list of modes (CLI choices, eval, bench, planner,
session files, trtllm-build flags) is derived from ``KV_MODES``.

Adding a mode: write its storage class (``cabinllm.runtime.kv.storage``, or a module of its own as
``cabinllm.runtime.kv.int4``), list it below, and give it a decode kernel if it needs one.
"""
from __future__ import annotations

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.kv.int4 import Int4KV
from cabinllm.runtime.kv.storage import (Fp8KV, Fp16KV, Fp32KV, Int8DynamicKV, Int8KV, Int8SeparateKV, KVLayout,
                                         KVStorage)

KVMode = type[KVStorage]
KV_MODES: dict[str, KVMode] = {mode.name: mode for mode in (
    Fp32KV, Fp16KV, Int8KV, Int8SeparateKV, Int8DynamicKV, Int4KV, Fp8KV)}
REFERENCE_KV_MODES = tuple(name for name, mode in KV_MODES.items() if mode.reference)
ONNX_KV_MODES = tuple(name for name, mode in KV_MODES.items() if mode.onnx_graph)


def kv_mode(name: str) -> KVMode:
    """The storage class of a mode name; ValueError naming the known modes otherwise."""
    try:
        return KV_MODES[name]
    except KeyError:
        raise ConfigError(f"unknown KV cache mode {name!r}; choose one of {', '.join(KV_MODES)}") from None


def bytes_per_token(layout: KVLayout, name: str, tokens_per_block: int) -> int:
    """Bytes one token of a mode takes in the blocks, all layers, K and V, scales included."""
    return kv_mode(name).bytes_per_token(layout, tokens_per_block)
