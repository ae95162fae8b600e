"""Hugging Face transformers ``generate`` as a peer: its default dynamic cache and its quantized caches."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cabinllm.benchmarks.runners.base import (KVFootprint, Runner, RunTiming, Unavailable, footprint_lengths,
                                              missing_module)

RESIDUAL = 128  # QuantizedCache's fp32 window of new tokens (its default, set explicitly)
GROUP = 64  # its quantization group size (its default)
WEIGHTS = "fp32, the same tensors as ours (cabinllm.calibration.hf_model)"


@dataclass
class CacheSetting:
    """One way to run transformers' KV cache."""

    name: str
    kv: str
    cache_config: dict | None  # None: the default DynamicCache; else QuantizedCache's cache_config
    module: str | None = None  # what must import for it
    package: str | None = None


def _grouped(backend: str, nbits: int, module: str, package: str) -> CacheSetting:
    return CacheSetting(f"transformers {backend} int{nbits}",
                        f"QuantizedCache {backend} int{nbits}, groups of {GROUP}, fp32 residual of {RESIDUAL} tokens",
                        {"backend": backend, "nbits": nbits, "q_group_size": GROUP, "residual_length": RESIDUAL},
                        module, package)


SETTINGS = (
    CacheSetting("transformers dynamic", "fp32 DynamicCache (the default)", None),
    _grouped("quanto", 4, "optimum.quanto", "optimum-quanto"),
    _grouped("hqq", 4, "hqq", "hqq"),
    _grouped("hqq", 8, "hqq", "hqq"),
    CacheSetting("transformers fp8", "QuantizedCache fp8 e4m3, one scale per tensor", {"backend": "fp8"}),
)


class _Clock:
    """A generate() streamer that only notes when each put arrives: the prompt first, then every new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, _value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush."""


def tensor_bytes(obj: object) -> int:
    """Bytes of every tensor reachable from obj through tuples, lists, dicts and the inner tensors of tensor
    subclasses (quanto's packed tensors)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def cache_bytes(cache) -> int:
    """Bytes a transformers cache holds, over all its layers."""
    return sum(tensor_bytes(list(vars(layer).values())) for layer in cache.layers)


def transformers_runners(model, settings: tuple[CacheSetting, ...] = SETTINGS) -> list[Runner | Unavailable]:
    """A runner per cache setting whose backend imports; the others as Unavailable with the reason."""
    out: list[Runner | Unavailable] = []
    for setting in settings:
        reason = missing_module(setting.module, setting.package) if setting.module else None
        out.append(Unavailable(setting.name, "transformers", reason) if reason else _runner(model, setting))
    return out


def _generate(model, setting: CacheSetting, prompt: list[int], new_tokens: int, **extra):
    kwargs = {} if setting.cache_config is None else {"cache_implementation": "quantized",
                                                      "cache_config": dict(setting.cache_config)}
    with torch.inference_mode():
        return model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, **kwargs, **extra)


def _runner(model, setting: CacheSetting) -> Runner:
    config = model.config
    fp_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4

    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        clock = _Clock()
        start = time.perf_counter()
        _generate(model, setting, prompt, new_tokens, streamer=clock)
        first = clock.times[1]
        return RunTiming(len(prompt), first - start, len(clock.times) - 2, clock.times[-1] - first)

    def footprint(budget: int, prompt: list[int]) -> KVFootprint:
        n1, n2 = footprint_lengths(prompt)
        b1, b2 = (cache_bytes(_generate(model, setting, prompt[:n], 1, return_dict_in_generate=True).cache)
                  for n in (n1, n2))
        per_token = (b2 - b1) / (n2 - n1)
        fixed = max(0, round(b1 - per_token * n1))
        how = f"measured: cache tensors after prefills of {n1} and {n2} tokens"
        if setting.cache_config and setting.cache_config["backend"] != "fp8":
            fixed += (RESIDUAL - 1) * fp_bytes_per_token  # the fp32 residual fills up between flushes
            how += f"; fixed = the fp32 residual window ({RESIDUAL - 1} tokens) it fills between flushes"
        return KVFootprint(per_token, fixed, int((budget - fixed) // per_token), how)

    def turn(history: list[int], _fresh: bool) -> float:
        return run(history, 1).prefill_s

    return Runner(setting.name, "transformers", setting.kv, WEIGHTS, run, footprint, turn,
                  turn_note="generate() on the whole history each turn (no prefix cache across calls)")
