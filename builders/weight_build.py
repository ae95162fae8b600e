"""The weight step of cabin-build: which weight format a build writes, and quantizing to it (ModelOpt for
TensorRT-LLM's formats, the source's GGUF blocks for int4-g32 and the int8 head).

Order of a quantized build: KV equalization is folded into the full-precision weights first (scales_source),
then the linear weights are quantized (cabinllm.calibration.weight_quant: ModelOpt, calibrated on dialogues;
cabinllm.calibration.gguf_weights: int4-g32), then the head (``--head int8``), then the KV scales are attached
(kv_attach). The checkpoint's tensors and ``quantization`` block are what ModelOpt's
export wrote (in our layout where its TensorRT-LLM layout differs: Phi-3's fused MLP, Gemma's shared lm_head); the
other config keys stay the imported model's (cabinllm.calibration.weight_quant.quantize_weights), for every
family cabinllm.calibration.hf_model rebuilds as a transformers model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from cabinllm.builders.targets import Target
from cabinllm.calibration.gguf_weights import Conversion, to_int4_g32, to_int8_head
from cabinllm.calibration.weight_quant import calibration_tokens, quantize_weights
from cabinllm.runtime.errors import CheckpointError, ConfigError
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.scales_file import load_scales_file, save_scales
from cabinllm.runtime.formats.weight_formats import HEAD_FORMATS, Int4G32, WeightFormat, head_format, weight_format
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.sources.model_source import open_source

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


def check_head(head: str, target: Target) -> None:
    """ConfigError for an unknown head format or an int8 head on a target whose runtime reads the head in fp16."""
    if head not in HEAD_FORMATS:
        raise ConfigError(f"unknown --head {head!r}; choose one of {', '.join(HEAD_FORMATS)}")
    if why := target.head_refusal(head):
        raise ConfigError(why)


def quantize_step_text(fmt: WeightFormat, data: str | None) -> str:
    """What the weight step does, for the progress display."""
    if isinstance(fmt, Int4G32):
        return f"converting linear weights to {fmt.name} (the source's Q4_0 / Q4_1 blocks as stored, others rounded)"
    return (f"quantizing weights to {fmt.name} ({fmt.quant_algo}, ModelOpt) calibrated on {data or DEFAULT_DATA} "
            "dialogues")


def quantized_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor], fmt: WeightFormat,
                         checkpoint: Path, data: str | None,
                         source: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Conversion | None]:
    """Full-precision ``config``/``weights`` (KV equalization already folded in) quantized to ``fmt``: by ModelOpt,
    calibrated on ``data`` (default builtin) read with the tokenizer in ``checkpoint``; int4-g32 from the blocks of
    the ``source`` model (with the record of what was taken and what rounded)."""
    if isinstance(fmt, Int4G32):
        return to_int4_g32(config, weights, open_source(source), fmt)
    tokens = calibration_tokens(data or DEFAULT_DATA, ChatTokenizer(checkpoint))
    return *quantize_weights(config, weights, fmt, tokens), None


def head_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor], head: str,
                    source: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Conversion | None]:
    """The weights with the embedding and lm_head in the ``head`` format (fp16: as they are)."""
    if head == "fp16" or head_format(config.quantization).name == head:
        return config, weights, None
    return to_int8_head(config, weights, open_source(source))


def refingerprint_scales(path: Path, old: str, new: str, config: ModelConfig) -> None:
    """Rewrite a build's scales file for the quantized checkpoint's fingerprint (the scales are unchanged)."""
    found = load_scales_file(path, old, config.num_hidden_layers)
    save_scales(path, found.scales, new, found.method, found.data, found.ranges, found.equalized)


def weights_record(fmt: WeightFormat, config: ModelConfig, data: str | None, quantized_here: bool,
                   linears: Conversion | None = None, head: Conversion | None = None) -> dict:
    """The manifest's record of the weights: format, quant_algo, group size, head and how they were made."""
    modelopt = quantized_here and linears is None
    record = {"format": fmt.name, "quant_algo": fmt.quant_algo, "group_size": fmt.group_size(config.quantization),
              "quantized_by": "nvidia-modelopt" if modelopt else "cabinllm" if quantized_here else None,
              "calibration": (data or DEFAULT_DATA) if modelopt else None,
              "head": head_format(config.quantization).name}
    for key, done in (("linears", linears), ("head_tables", head)):
        if done is not None:
            record[key] = done.record()
    return record
