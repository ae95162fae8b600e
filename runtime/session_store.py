"""Saving a dialogue session (messages, KV of its tokens, fingerprints) and restoring it without re-prefill.

One safetensors file: the K/V of every token in their stored form (int8 codes stay
int8) and a JSON header with the conversation and the fingerprints of the model and
of the static KV scales. The write is atomic: a crash mid-save leaves the previous
save in place, and a file cut short fails to parse and is reported as such.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from runtime.atomic import atomic_write_bytes
from runtime.engine import Engine
from runtime.kv_cache import STATIC_INT8_MODES, PagedKVCache
from runtime.overflow import OverflowPolicy
from runtime.sampling import SamplingParams

SESSION_FORMAT = "cabin-session/1"
PER_TOKEN_MODES = ("fp32", "fp16", "int8", "int8-separate", "int8-dynamic")


class SessionFileError(ValueError):
    """A session file is unreadable, cut short, or belongs to another model or other scales."""


def scales_fingerprint(cache: PagedKVCache) -> str:
    """Hash of the static INT8 scales the cache quantizes with ('none' for other modes)."""
    if cache.mode not in STATIC_INT8_MODES:
        return "none"
    data = json.dumps([cache.k_scale, cache.v_scale]).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _token_tensors(cache: PagedKVCache) -> dict[str, torch.Tensor]:
    """The cache's per-token storage tensors, each shaped (layers, blocks, tokens_per_block, ...)."""
    if cache.mode not in PER_TOKEN_MODES:
        raise SessionFileError(f"saving sessions needs per-token KV storage ({', '.join(PER_TOKEN_MODES)}), "
                               f"not {cache.mode}")
    names = ["k_data", "v_data"] + (["k_sdata", "v_sdata"] if cache.mode == "int8-dynamic" else [])
    return {name: getattr(cache, name) for name in names}


def save_session(session, path: str | Path) -> None:
    """Write a session to path atomically."""
    from safetensors.torch import save

    cache, seq = session.cache, session.seq_id
    num_tokens = len(session.fed)
    tensors = {}
    if num_tokens:
        slots = cache.slots(seq, 0, num_tokens)
        for name, t in _token_tensors(cache).items():
            tensors[name] = t.flatten(1, 2)[:, slots].contiguous()
    header = {
        "format": SESSION_FORMAT,
        "model_fingerprint": session.engine.fingerprint,
        "scales_fingerprint": scales_fingerprint(cache),
        "kv_mode": cache.mode,
        "kv_budget_bytes": cache.stats().bytes_reserved,
        "tokens_per_block": cache.tokens_per_block,
        "system_prompt": session.system_prompt,
        "messages": session.messages,
        "fed": session.fed,
        "pending": session.pending,
        "transcript": session.transcript,
        "turns": session.turns,
        "overflow": vars(session.overflow),
        "params": vars(session.params),
    }
    atomic_write_bytes(Path(path), save(tensors, metadata={"session": json.dumps(header, ensure_ascii=False)}))


def restore_session(path: str | Path, engine: Engine, cache: PagedKVCache | None = None):
    """Load a saved session into a cache (a new one like the saved one if none is given)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    from runtime.session import DialogueSession

    path = Path(path)
    try:
        blob = path.read_bytes()
        tensors = load(blob)
        header = json.loads(_metadata(blob)["session"])
    except (OSError, SafetensorError, ValueError, KeyError) as err:
        raise SessionFileError(f"{path}: not a complete session file ({err}); it may have been cut short, "
                               "use an earlier save") from err
    if header.get("format") != SESSION_FORMAT:
        raise SessionFileError(f"{path}: format {header.get('format')!r}, expected {SESSION_FORMAT}")
    if header["model_fingerprint"] != engine.fingerprint:
        raise SessionFileError(f"{path}: saved with model {header['model_fingerprint']}, this engine runs "
                               f"{engine.fingerprint}; restore it with the engine it was saved from")
    if cache is None:
        cache = engine.new_cache(header["kv_mode"], header["kv_budget_bytes"], header["tokens_per_block"])
    if cache.mode != header["kv_mode"] or scales_fingerprint(cache) != header["scales_fingerprint"]:
        raise SessionFileError(f"{path}: saved with {header['kv_mode']} KV and scales {header['scales_fingerprint']}, "
                               f"the cache uses {cache.mode} and {scales_fingerprint(cache)}")
    session = DialogueSession(engine, cache, SamplingParams(**header["params"]), header["system_prompt"],
                              OverflowPolicy(**header["overflow"]))
    fed = header["fed"]
    if fed:
        reused = cache.allocate(session.seq_id, fed)
        slots = cache.slots(session.seq_id, reused, len(fed))
        for name, t in _token_tensors(cache).items():
            t.flatten(1, 2)[:, slots] = tensors[name][:, reused:]
    session.messages, session.fed, session.pending = header["messages"], fed, header["pending"]
    session.transcript, session.turns = header["transcript"], header["turns"]
    return session


def _metadata(blob: bytes) -> dict:
    """The string metadata of a safetensors blob."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + size])["__metadata__"]
