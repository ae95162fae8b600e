"""The weight step of cabin-build: which weight format a build writes, and quantizing to it with ModelOpt.

Order of a quantized build: KV equalization is folded into the full-precision weights first (scales_source),
then the linear weights are quantized (cabinllm.calibration.weight_quant: ModelOpt, calibrated on dialogues), then the
KV scales are attached (kv_attach). The checkpoint's tensors and ``quantization`` block are what ModelOpt's
export wrote (in our layout where its TensorRT-LLM layout differs: Phi-3's fused MLP, Gemma's shared lm_head); the
other config keys stay the imported model's (cabinllm.calibration.weight_quant.quantize_weights), for every
family cabinllm.calibration.hf_model rebuilds as a transformers model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from cabinllm.calibration.weight_quant import calibration_tokens, quantize_weights
from cabinllm.runtime.errors import CheckpointError
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.scales_file import load_scales_file, save_scales
from cabinllm.runtime.formats.weight_formats import WeightFormat, weight_format
from cabinllm.runtime.model.tokenizer import ChatTokenizer

FULL_PRECISION = "fp16"
DEFAULT_DATA = "builtin"


def build_weight_format(requested: str, source: ModelConfig) -> WeightFormat:
    """The weight format a build writes: the requested one, or the format an imported checkpoint already has
    (``fp16`` asked); CheckpointError when a quantized checkpoint is asked for another format."""
    try:
        fmt = weight_format(requested)
    except ValueError as err:
        raise CheckpointError(f"--weights: {err}") from None
    stored = source.weight_format
    if stored.quant_algo is None or stored.name == fmt.name:
        return fmt
    if fmt.name == FULL_PRECISION:
        return stored
    raise CheckpointError(f"the model is a {stored.quant_algo} checkpoint; build it with --weights {stored.name} "
                          f"(or {FULL_PRECISION}), or give the full-precision model to quantize it to {fmt.name}")


def check_equalize(fmt: WeightFormat, source: ModelConfig, equalize: bool) -> None:
    """CheckpointError when KV equalization would be folded into already-quantized weights."""
    if equalize and source.weight_format.quant_algo is not None:
        raise CheckpointError(f"--equalize folds factors into full-precision weights, and this checkpoint is "
                              f"{source.weight_format.quant_algo}; equalize the full-precision model and quantize "
                              f"it with --weights {fmt.name}")


def needs_quantizing(fmt: WeightFormat, config: ModelConfig) -> bool:
    """Whether the imported weights must still be quantized to ``fmt``."""
    return fmt.quant_algo is not None and config.weight_format.quant_algo is None


def quantize_step_text(fmt: WeightFormat, data: str | None) -> str:
    """What the weight step does, for the progress display."""
    return (f"quantizing weights to {fmt.name} ({fmt.quant_algo}, ModelOpt) calibrated on {data or DEFAULT_DATA} "
            "dialogues")


def quantized_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor], fmt: WeightFormat,
                         checkpoint: Path, data: str | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Full-precision ``config``/``weights`` (KV equalization already folded in) quantized to ``fmt`` by ModelOpt,
    calibrated on ``data`` (default builtin) read with the tokenizer in ``checkpoint``."""
    tokens = calibration_tokens(data or DEFAULT_DATA, ChatTokenizer(checkpoint))
    return quantize_weights(config, weights, fmt, tokens)


def refingerprint_scales(path: Path, old: str, new: str, config: ModelConfig) -> None:
    """Rewrite a build's scales file for the quantized checkpoint's fingerprint (the scales are unchanged)."""
    found = load_scales_file(path, old, config.num_hidden_layers)
    save_scales(path, found.scales, new, found.method, found.data, found.ranges, found.equalized)


def weights_record(fmt: WeightFormat, config: ModelConfig, data: str | None, quantized_here: bool) -> dict:
    """The manifest's record of the weights: format, quant_algo, group size and how they were made."""
    return {"format": fmt.name, "quant_algo": fmt.quant_algo, "group_size": fmt.group_size(config.quantization),
            "quantized_by": "nvidia-modelopt" if quantized_here else None,
            "calibration": (data or DEFAULT_DATA) if quantized_here else None}
