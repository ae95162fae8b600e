"""Quick static INT8 KV scales from a few built-in in-car exchanges (max of |K| and |V| per layer).

This is the fallback when no calibrated ``kv_scales.json`` is given: it runs the
model once in full precision over the samples below and takes each layer's
abs-max. Calibration on real dialogues (cabin-calibrate) gives better scales.
"""
from __future__ import annotations

import torch

from runtime.kv_cache import KVScales, PagedKVCache
from runtime.kv_quant import INT8_MAX
from runtime.model import Transformer
from runtime.tokenizer import ChatTokenizer

SAMPLE_DIALOGUES = [
    [
        {"role": "system", "content": "You are the in-car assistant. Answer briefly and safely."},
        {"role": "user", "content": "Take me to the nearest charging station with a fast charger."},
        {"role": "assistant", "content": "The nearest fast charger is 3.2 km away on Harbor Road, 150 kW. Starting navigation."},
        {"role": "user", "content": "Set the cabin to 21 degrees and play some jazz."},
        {"role": "assistant", "content": "Cabin set to 21 °C. Playing a jazz station."},
        {"role": "user", "content": "What does the yellow tyre warning light mean?"},
    ],
    [
        {"role": "system", "content": "你是车载语音助手，回答要简短。"},
        {"role": "user", "content": "导航到最近的加油站，然后把空调调到二十二度。"},
        {"role": "assistant", "content": "已找到两公里外的加油站，正在导航。空调已调到二十二度。"},
        {"role": "user", "content": "给妈妈发消息：我大概半小时后到。"},
    ],
]


def quick_kv_scales(model: Transformer, tokenizer: ChatTokenizer) -> KVScales:
    """Per-layer K and V scales (amax / 127) measured on the built-in sample dialogues."""
    layout = model.kv_layout
    k_amax = torch.zeros(layout.num_layers)
    v_amax = torch.zeros(layout.num_layers)
    for index, messages in enumerate(SAMPLE_DIALOGUES):
        ids = tokenizer.encode(tokenizer.render(messages))
        cache = PagedKVCache(layout, "fp32", layout.bytes_per_token("fp32") * (len(ids) + 32), 32)
        cache.allocate(index, ids)
        model.forward(ids, 0, cache, index)
        table = cache.block_table(index)
        for layer in range(layout.num_layers):
            k, v = cache.read(layer, table, len(ids))
            k_amax[layer] = max(k_amax[layer], k.abs().max())
            v_amax[layer] = max(v_amax[layer], v.abs().max())
    return KVScales(k=(k_amax / INT8_MAX).tolist(), v=(v_amax / INT8_MAX).tolist())
