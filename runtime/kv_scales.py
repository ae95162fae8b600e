"""Static INT8 KV scales on disk (``kv_scales.json``) and the model fingerprint they belong to."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from runtime.atomic import atomic_write_text
from runtime.checkpoint import ModelConfig
from runtime.kv_cache import KVScales

SCALES_VERSION = 1
_SHAPE_KEYS = ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_size", "intermediate_size")


class ScalesError(ValueError):
    """A scales file is unreadable, malformed or made for another model."""


def model_fingerprint(config: ModelConfig, weights: dict[str, torch.Tensor]) -> str:
    """Hash of the config's shape keys and the weights' names and shapes."""
    parts = {k: getattr(config, k) for k in _SHAPE_KEYS}
    parts["weights"] = sorted((name, list(t.shape)) for name, t in weights.items()
                              if not name.endswith("kv_cache_scaling_factor"))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def save_scales(path: str | Path, scales: KVScales, fingerprint: str, method: str, data_summary: dict) -> None:
    """Write scales atomically; each layer carries K, V and the shared TensorRT-LLM scale."""
    layers = [{"layer": i, "k": k, "v": v, "kv_cache_scaling_factor": s}
              for i, (k, v, s) in enumerate(zip(scales.k, scales.v, scales.shared()))]
    doc = {"version": SCALES_VERSION, "model_fingerprint": fingerprint, "method": method,
           "data": data_summary, "layers": layers}
    atomic_write_text(Path(path), json.dumps(doc, indent=2))


def load_scales(path: str | Path, fingerprint: str, num_layers: int) -> KVScales:
    """Read and check a scales file against the model it will be used with."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        layers = sorted(doc["layers"], key=lambda entry: entry["layer"])
        k = [float(entry["k"]) for entry in layers]
        v = [float(entry["v"]) for entry in layers]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ScalesError(f"{path}: not a readable kv_scales.json ({err!r}); re-run calibration") from err
    if doc.get("version") != SCALES_VERSION:
        raise ScalesError(f"{path}: schema version {doc.get('version')}, this CabinLLM reads {SCALES_VERSION}")
    if doc.get("model_fingerprint") != fingerprint:
        raise ScalesError(f"{path}: made for model {doc.get('model_fingerprint')}, not this one ({fingerprint}); "
                          "calibrate this model instead")
    if [entry["layer"] for entry in layers] != list(range(num_layers)):
        raise ScalesError(f"{path}: needs one entry for each of layers 0..{num_layers - 1}")
    bad = [i for i, s in enumerate(k + v) if not (math.isfinite(s) and s > 0)]
    if bad:
        raise ScalesError(f"{path}: scale #{bad[0]} is not a finite positive number; re-run calibration")
    return KVScales(k=k, v=v)
