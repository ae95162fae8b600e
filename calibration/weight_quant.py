"""Weight-only quantization of a checkpoint through NVIDIA ModelOpt, calibrated on dialogues.

The checkpoint's weights go into a transformers LlamaForCausalLM (cabinllm.calibration.hf_model);
``modelopt.torch.quantization.quantize`` with ``INT8_WEIGHT_ONLY_CFG`` (W8A16) or ``INT4_AWQ_CFG`` (W4A16_AWQ,
group size set per model) runs the calibration forward passes, and ``modelopt.torch.export.
export_tensorrt_llm_checkpoint`` writes the TensorRT-LLM checkpoint, read back as it was written: tensor names,
dtypes, shapes and the ``quantization`` block are ModelOpt's own. ``round_to_nearest`` is the AWQ baseline:
the same int4 groups and format with scales amax / 7 and a prequant scale of 1.
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from cabinllm.calibration.hf_model import transformers_model
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE, ModelConfig, layer_prefix, linear_inputs
from cabinllm.runtime.formats.weight_formats import (PREQUANT, SCALE, W8A16, WEIGHT_FORMATS, W4A16Awq, WeightFormat,
                                                     awq_group_size)
from cabinllm.runtime.model.linear import INT4_MAX, INT4_MIN, pack_int4
from cabinllm.runtime.model.tokenizer import ChatTokenizer

EVAL_WEIGHTS = ("fp32", "int8", "int4-awq", "int4-rtn")  # cabin-eval's weights axis: fp32 is the model as loaded
RTN = "int4-rtn"
DEFAULT_CALIB_DIALOGUES = 8
DEFAULT_CALIB_TOKENS = 256
_EXPORT_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def calibration_tokens(data: str, tokenizer: ChatTokenizer, count: int = DEFAULT_CALIB_DIALOGUES,
                       max_tokens: int = DEFAULT_CALIB_TOKENS, seed: int = 0) -> list[list[int]]:
    """Token ids of ``count`` train dialogues of ``data`` (builtin, sharegpt or a file), as cabin-calibrate reads
    them."""
    dialogues, _ = prepare_dialogues(data, "train", count, seed, tokenizer, max_tokens)
    return [d.token_ids for d in dialogues]


def modelopt_config(fmt: WeightFormat, group_size: int | None) -> dict:
    """ModelOpt's quantization config for a weight format (AWQ with ``group_size`` inputs per scale)."""
    import modelopt.torch.quantization as mtq

    if isinstance(fmt, W8A16):
        return copy.deepcopy(mtq.INT8_WEIGHT_ONLY_CFG)
    if not isinstance(fmt, W4A16Awq):
        raise ConfigError(f"{fmt.name} weights are not quantized; nothing to calibrate")
    config = copy.deepcopy(mtq.INT4_AWQ_CFG)
    for entry in config["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and isinstance(entry.get("cfg"), dict):
            entry["cfg"]["block_sizes"] = {**entry["cfg"]["block_sizes"], -1: group_size}
    return config


def quantize_weights(config: ModelConfig, weights: dict[str, torch.Tensor], fmt: WeightFormat,
                     calibration: list[list[int]],
                     progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The TensorRT-LLM checkpoint (config, weights) ModelOpt exports for full-precision ``config``/``weights``
    quantized to ``fmt``, calibrated on the token sequences of ``calibration`` (config keys other than the
    quantization block, dtype and vocabulary size kept from ``config``)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    if config.weight_format.quant_algo is not None:
        raise ConfigError(f"the weights are already quantized ({config.weight_format.quant_algo}); quantize a "
                         "full-precision model")
    group = awq_group_size(list(linear_inputs(config).values())) if isinstance(fmt, W4A16Awq) else None
    try:
        model = transformers_model(config, weights)
    except ValueError as err:
        raise ConfigError(f"{err}; --weights {fmt.name} quantizes Llama-family models without biases") from None

    def forward_loop(model) -> None:
        for ids in tqdm(calibration, desc=f"calibrating {fmt.name} weights", unit="dialogue", file=sys.stderr,
                        disable=not progress):
            model(torch.tensor([ids]))

    # ModelOpt prints its progress; stdout is kept for the tools' own output (cabin-eval --json)
    with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
        mtq.quantize(model, modelopt_config(fmt, group), forward_loop)
        with tempfile.TemporaryDirectory(prefix="cabin-modelopt-") as tmp:
            export_tensorrt_llm_checkpoint(model, "llama", torch.float16, export_dir=tmp,
                                           inference_tensor_parallel=1)
            exported, tensors = read_export(Path(tmp))
    # The tensors, quantization block, dtype and (padded) vocabulary are the export's; the other keys stay the
    # model's: ModelOpt 0.47 reads rope_theta where transformers 4.x kept it, and under transformers 5 leaves
    # rotary_base out, which TensorRT-LLM then takes as 10000.
    return replace(config, quantization=exported.quantization, vocab_size=exported.vocab_size,
                   dtype=exported.dtype), tensors


def read_export(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and tensors of a ModelOpt export folder (``config.json`` + ``rank0.safetensors``) as written."""
    from safetensors.torch import load_file

    data = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    return ModelConfig.from_dict(data, str(folder / CONFIG_FILE)), load_file(str(folder / WEIGHTS_FILE))


def round_to_nearest(config: ModelConfig, weights: dict[str, torch.Tensor],
                     group_size: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """W4A16 by round-to-nearest on AWQ's groups (scale amax / 7 per group, prequant scale 1), in the
    W4A16_AWQ checkpoint format; float tensors keep their dtype."""
    group = group_size or awq_group_size(list(linear_inputs(config).values()))
    out = dict(weights)
    for layer in range(config.num_hidden_layers):
        for name in linear_inputs(config):
            base = f"{layer_prefix(layer)}.{name}"
            w = out.pop(f"{base}.weight").float()
            rows, inputs = w.shape
            amax = w.view(rows, inputs // group, group).abs().amax(-1).clamp(min=1e-8)
            scale = amax / INT4_MAX
            q = (w / scale.repeat_interleave(group, dim=1)).round().clamp(INT4_MIN, INT4_MAX)
            out[f"{base}.weight"] = pack_int4(q)
            out[f"{base}.{SCALE}"] = scale
            out[f"{base}.{PREQUANT}"] = torch.ones(inputs, dtype=_EXPORT_DTYPES[config.dtype])
    quantization = {**config.quantization, "quant_algo": W4A16Awq.quant_algo, "group_size": group,
                    "has_zero_point": False, "pre_quant_scale": True, "exclude_modules": ["lm_head"]}
    return replace(config, quantization=quantization), out


def eval_weights(name: str, config: ModelConfig, weights: dict[str, torch.Tensor], calibration: list[list[int]],
                 progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The checkpoint cabin-eval measures for one entry of EVAL_WEIGHTS, made from full-precision weights:
    fp32 as given, int8 and int4-awq quantized by ModelOpt on ``calibration``, int4-rtn by round to nearest on
    AWQ's groups."""
    if name not in EVAL_WEIGHTS:
        raise ConfigError(f"unknown weights {name!r}; choose from {', '.join(EVAL_WEIGHTS)}")
    if name == EVAL_WEIGHTS[0]:
        return config, weights
    if name == RTN:
        return round_to_nearest(config, weights)
    return quantize_weights(config, weights, WEIGHT_FORMATS[name], calibration, progress)


def stored_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Bytes of a checkpoint's tensors as an fp16 checkpoint stores them: weights, norms and prequant scales in
    fp16, int8 tensors and the float32 weight scales as they are; KV scaling factors left out."""
    def size(name: str, t: torch.Tensor) -> int:
        keep = not t.is_floating_point() or name.endswith(SCALE)
        return t.numel() * (t.element_size() if keep else 2)

    return sum(size(name, t) for name, t in weights.items() if not name.endswith("cache_scaling_factor"))
