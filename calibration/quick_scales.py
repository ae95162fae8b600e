"""Quick static INT8 KV scales from a few built-in in-car exchanges (max of |K| and |V| per layer).

This is the fallback when no calibrated ``kv_scales.json`` is given: it runs the
model once in full precision over ``data/sample_exchanges.jsonl`` and takes each
layer's abs-max. Calibration on real dialogues (cabin-calibrate) gives better scales.
"""
from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import torch

from cabinllm.calibration.dialogue_data import LoadReport
from cabinllm.calibration.jsonl import load_jsonl
from cabinllm.runtime.errors import ScalesError
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.kv.quant import INT8_MAX
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.transformer import Transformer

SAMPLES_FILE = "sample_exchanges.jsonl"


def sample_exchanges_path() -> Path:
    """The sample exchanges shipped as package data."""
    return Path(str(resources.files("cabinllm.calibration") / "data" / SAMPLES_FILE))


def quick_kv_scales(model: Transformer, tokenizer: ChatTokenizer) -> KVScales:
    """Per-layer K and V scales (amax / 127) measured on the built-in sample exchanges.

    ScalesError when a layer's abs-max is 0 or not finite: INT8 would store every value of that layer as 0 (or
    NaN), so the engine could not answer; the measurement names the layer and the cause instead.
    """
    layout = model.kv_layout
    k_amax = torch.zeros(layout.num_layers)
    v_amax = torch.zeros(layout.num_layers)
    for dialogue in load_jsonl(sample_exchanges_path(), LoadReport(SAMPLES_FILE)):
        run = run_tokens(model, tokenizer.encode(tokenizer.render(dialogue.messages)))
        for layer in range(layout.num_layers):
            k, v = run.kv(layer)
            k_amax[layer] = torch.maximum(k_amax[layer], k.abs().max())  # NaN propagates (max() would drop it)
            v_amax[layer] = torch.maximum(v_amax[layer], v.abs().max())
    for name, amax in (("K", k_amax), ("V", v_amax)):
        for layer, value in enumerate(amax.tolist()):
            if not math.isfinite(value):
                raise ScalesError(f"layer {layer} {name} reaches {value} on the sample exchanges: the model's "
                                  "activations overflow, so it cannot run; check its weights")
            if value == 0:
                raise ScalesError(f"layer {layer} {name} is 0 for every token of the sample exchanges (are its "
                                  f"{name} projection weights zero?): a scale of 0 would turn every stored value "
                                  "into NaN; check the model's weights")
    return KVScales(k=(k_amax / INT8_MAX).tolist(), v=(v_amax / INT8_MAX).tolist())
