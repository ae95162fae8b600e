"""Static INT8 KV scales on disk (``kv_scales.json``) and the model fingerprint they belong to.

Schema version 2 (version 1 files, without ranges, are still read)::

    {"version": 2, "model_fingerprint": "...", "method": "max|percentile|mse|...",
     "equalized": false, "data": {...},
     "layers": [{"layer": 0, "k": s_k, "v": s_v, "kv_cache_scaling_factor": max(s_k, s_v),
                 "k_amax": ..., "v_amax": ..., "k_head_amax": [...], "v_head_amax": [...],
                 "k_channel_amax": [[...]], "v_channel_amax": [[...]],   # [kv_heads][head_size]
                 "k_channel_clip": [[...]], "v_channel_clip": [[...]],   # optional, by the method
                 "k_clip_rate": ..., "v_clip_rate": ...}, ...]}

Scales are amax / 127 with K measured after RoPE. ``equalized`` says the scales
belong to weights with KV equalization folded in (cabinllm.calibration.equalize).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cabinllm.runtime.errors import ScalesError
from cabinllm.runtime.formats.atomic import atomic_write_text
from cabinllm.runtime.formats.checkpoint import ModelConfig

SCALES_VERSION = 2
READABLE_VERSIONS = (1, 2)
_SHAPE_KEYS = ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_size", "intermediate_size")


@dataclass
class KVScales:
    """Static INT8 scales (amax / 127), one per layer for K and one for V."""

    k: list[float]
    v: list[float]

    def shared(self) -> list[float]:
        """One scale per layer for K and V together, as TensorRT-LLM stores it."""
        return [max(k, v) for k, v in zip(self.k, self.v)]


@dataclass
class LayerRanges:
    """Measured K (post-RoPE) and V of one layer per channel, ``[kv_heads][head_size]``: abs-max, the clip the
    calibration method chose (None: the abs-max), and the share of the layer's values its K/V scales clip."""

    k_channel_amax: list[list[float]]
    v_channel_amax: list[list[float]]
    k_clip_rate: float = 0.0
    v_clip_rate: float = 0.0
    k_channel_clip: list[list[float]] | None = None
    v_channel_clip: list[list[float]] | None = None


@dataclass
class ScalesFile:
    """Everything a ``kv_scales.json`` holds."""

    scales: KVScales
    fingerprint: str
    method: str
    data: dict = field(default_factory=dict)
    ranges: list[LayerRanges] | None = None
    equalized: bool = False


def model_fingerprint(config: ModelConfig, weights: dict[str, torch.Tensor]) -> str:
    """Hash of the config's shape keys and the weights' names and shapes."""
    parts = {k: getattr(config, k) for k in _SHAPE_KEYS}
    parts["weights"] = sorted((name, list(t.shape)) for name, t in weights.items()
                              if not name.endswith("kv_cache_scaling_factor"))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _layer_entry(index: int, k: float, v: float, ranges: LayerRanges | None) -> dict:
    entry = {"layer": index, "k": k, "v": v, "kv_cache_scaling_factor": max(k, v)}
    if ranges is None:
        return entry
    for name, channels in (("k", ranges.k_channel_amax), ("v", ranges.v_channel_amax)):
        entry[f"{name}_amax"] = max(max(head) for head in channels)
        entry[f"{name}_head_amax"] = [max(head) for head in channels]
        entry[f"{name}_channel_amax"] = [list(head) for head in channels]
        clip = getattr(ranges, f"{name}_channel_clip")
        if clip is not None:
            entry[f"{name}_channel_clip"] = [list(head) for head in clip]
    entry["k_clip_rate"], entry["v_clip_rate"] = ranges.k_clip_rate, ranges.v_clip_rate
    return entry


def save_scales(path: str | Path, scales: KVScales, fingerprint: str, method: str, data_summary: dict,
                ranges: list[LayerRanges] | None = None, equalized: bool = False) -> None:
    """Write scales atomically; each layer carries K, V, the shared TensorRT-LLM scale and, if given, its ranges.

    ScalesError, and nothing written, when a scale is 0, negative or not finite: INT8 divides by the scale, so
    such a scale would store every K/V value of its layer as NaN, infinity or 0.
    """
    if ranges is not None and len(ranges) != len(scales.k):
        raise ValueError(f"{len(ranges)} layer ranges for {len(scales.k)} layers of scales")
    unusable = ("not written, as INT8 K/V with that scale would be NaN or 0: the layer's measured range is empty "
                "or broken, check the model's weights and the calibration data")
    _check_positive(path, "k", scales.k, unusable)
    _check_positive(path, "v", scales.v, unusable)
    layers = [_layer_entry(i, k, v, ranges[i] if ranges else None)
              for i, (k, v) in enumerate(zip(scales.k, scales.v))]
    doc = {"version": SCALES_VERSION, "model_fingerprint": fingerprint, "method": method, "equalized": equalized,
           "data": data_summary, "layers": layers}
    atomic_write_text(Path(path), json.dumps(doc, indent=2))


def load_scales_file(path: str | Path, fingerprint: str, num_layers: int,
                     kv_shape: tuple[int, int] | None = None) -> ScalesFile:
    """Read and check a scales file (any readable version) against the model it will be used with.

    ``kv_shape`` (kv heads, head size), when given, is checked against the stored channel ranges.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        layers = sorted(doc["layers"], key=lambda entry: entry["layer"])
        k = [float(entry["k"]) for entry in layers]
        v = [float(entry["v"]) for entry in layers]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ScalesError(f"{path}: not a readable kv_scales.json ({err!r}); re-run calibration") from err
    if doc.get("version") not in READABLE_VERSIONS:
        raise ScalesError(f"{path}: schema version {doc.get('version')}, this CabinLLM reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))}; re-run calibration with this version")
    if doc.get("model_fingerprint") != fingerprint:
        raise ScalesError(f"{path}: made for model {doc.get('model_fingerprint')}, not this one ({fingerprint}); "
                          "calibrate this model instead")
    found = [entry["layer"] for entry in layers]
    if found != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(found))
        raise ScalesError(f"{path}: needs one entry for each of layers 0..{num_layers - 1}"
                          + (f"; missing layer(s) {missing}" if missing else f"; found {found}")
                          + "; re-run calibration")
    _check_positive(path, "k", k, "re-run calibration")
    _check_positive(path, "v", v, "re-run calibration")
    ranges = _read_ranges(path, layers, kv_shape)
    return ScalesFile(KVScales(k=k, v=v), fingerprint, str(doc.get("method", "")), dict(doc.get("data") or {}),
                      ranges, bool(doc.get("equalized", False)))


def _check_positive(path: str | Path, name: str, values: list[float], fix: str) -> None:
    """ScalesError naming the first scale that is not a finite positive number."""
    bad = [i for i, s in enumerate(values) if not (math.isfinite(s) and s > 0)]
    if bad:
        raise ScalesError(f"{path}: layer {bad[0]} {name} scale {values[bad[0]]} is not a finite positive number; "
                          f"{fix}")


def _channel_table(path: Path, entry: dict, key: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    """One [kv_heads][head_size] table of an entry, checked for shape and finite non-negative values."""
    try:
        table = torch.tensor(entry[key], dtype=torch.float64)
    except (TypeError, ValueError) as err:
        raise ScalesError(f"{path}: layer {entry['layer']} {key} is not a table of numbers ({err}); "
                          "re-run calibration") from err
    if table.dim() != 2 or (shape is not None and tuple(table.shape) != shape):
        raise ScalesError(f"{path}: layer {entry['layer']} {key} has shape {list(table.shape)}, expected "
                          f"[kv_heads, head_size]{' = ' + str(list(shape)) if shape else ''}; "
                          "calibrate this model instead")
    if not (torch.isfinite(table).all() and (table >= 0).all()):
        raise ScalesError(f"{path}: layer {entry['layer']} {key} has a value that is negative or not finite; "
                          "re-run calibration")
    return table


def _read_ranges(path: Path, layers: list[dict], kv_shape: tuple[int, int] | None) -> list[LayerRanges] | None:
    if not all("k_channel_amax" in entry and "v_channel_amax" in entry for entry in layers):
        return None
    ranges = []
    for entry in layers:
        k = _channel_table(path, entry, "k_channel_amax", tuple(kv_shape) if kv_shape else None)
        tables = {key: _channel_table(path, entry, key, tuple(k.shape)).tolist()
                  for key in ("v_channel_amax", "k_channel_clip", "v_channel_clip") if key in entry}
        ranges.append(LayerRanges(k.tolist(), tables["v_channel_amax"], _clip_rate(path, entry, "k_clip_rate"),
                                  _clip_rate(path, entry, "v_clip_rate"), tables.get("k_channel_clip"),
                                  tables.get("v_channel_clip")))
    return ranges


def _clip_rate(path: Path, entry: dict, key: str) -> float:
    """A layer's share of clipped values (0 when the file does not say), checked to lie in [0, 1]."""
    rate = entry.get(key, 0.0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise ScalesError(f"{path}: layer {entry['layer']} {key} is {rate!r}, not a share between 0 and 1; "
                          "re-run calibration")
    return float(rate)


def load_scales(path: str | Path, fingerprint: str, num_layers: int) -> KVScales:
    """Read and check a scales file against the model it will be used with; only the scales."""
    return load_scales_file(path, fingerprint, num_layers).scales
