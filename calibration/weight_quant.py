"""Weight-only quantization of a checkpoint through NVIDIA ModelOpt, calibrated on dialogues.

The checkpoint's weights go into its family's transformers model (cabinllm.calibration.hf_model);
``modelopt.torch.quantization.quantize`` with ``INT8_WEIGHT_ONLY_CFG`` (W8A16) or ``INT4_AWQ_CFG`` (W4A16_AWQ,
group size set per model) runs the calibration forward passes, and ``modelopt.torch.export.
export_tensorrt_llm_checkpoint`` writes the TensorRT-LLM checkpoint (``export_checkpoint``), read back as it was
written: tensor names, dtypes, shapes and the ``quantization`` block are ModelOpt's own, norms included (Gemma's
as 1 + weight, as ours). Where ModelOpt's layout is not ours, ``checkpoint_tensors`` puts it back: Phi-3's fused
gate_up_proj split into fc and gate, a shared (tied Gemma) lm_head written out. ``round_to_nearest`` is the AWQ
baseline: the same int4 groups and format with scales amax / 7 and a prequant scale of 1.
"""
from __future__ import annotations

import contextlib
import copy
import json
import sys
import tempfile
import unittest.mock
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from cabinllm.calibration.gguf_weights import to_int4_g32, to_int8_head
from cabinllm.calibration.hf_model import reference, transformers_model
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.checkpoint import CONFIG_FILE, WEIGHTS_FILE, ModelConfig, layer_prefix, linear_inputs
from cabinllm.runtime.formats.weight_formats import (PREQUANT, SCALE, W8A16, WEIGHT_FORMATS, Int4G32, W4A16Awq,
                                                     WeightFormat, awq_group_size)
from cabinllm.runtime.model.linear import INT4_MAX, INT4_MIN, pack_int4
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.sources.weight_plan import SourceModel

# cabin-eval's weights axis: fp32 is the model as loaded; int4-g32 takes a GGUF's blocks as stored (lossless), and
# with INT8_HEAD also its Q8_0 embedding as the int8 head; int4-g32-a8 the same blocks on int8 activations
INT8_HEAD = "+int8-head"
EVAL_WEIGHTS = ("fp32", "int8", "int4-awq", "int4-rtn", "int4-g32", "int4-g32" + INT8_HEAD, "int4-g32-a8",
                "int4-g32-a8" + INT8_HEAD)
CALIBRATED_WEIGHTS = ("int8", "int4-awq")  # the entries ModelOpt quantizes on calibration dialogues
RTN = "int4-rtn"
DEFAULT_CALIB_DIALOGUES = 8
DEFAULT_CALIB_TOKENS = 256
AWQ_VOCAB_MULTIPLE = 64  # ModelOpt pads an AWQ export's vocabulary to a multiple of 64
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

    if config.weight_format.quant_algo is not None:
        raise ConfigError(f"the weights are already quantized ({config.weight_format.quant_algo}); quantize a "
                         "full-precision model")
    group = awq_group_size(list(linear_inputs(config).values())) if isinstance(fmt, W4A16Awq) else None
    decoder = reference(config).decoder
    if group is not None and decoder.startswith("gemma"):
        config, weights = pad_vocabulary(config, weights)
    model = transformers_model(config, weights)

    def forward_loop(model) -> None:
        for ids in tqdm(calibration, desc=f"calibrating {fmt.name} weights", unit="dialogue", file=sys.stderr,
                        disable=not progress):
            model(torch.tensor([ids]))

    # ModelOpt prints its progress; stdout is kept for the tools' own output (cabin-eval's JSON)
    with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
        mtq.quantize(model, modelopt_config(fmt, group), forward_loop)
        with tempfile.TemporaryDirectory(prefix="cabin-modelopt-") as tmp:
            export_checkpoint(model, decoder, Path(tmp))
            exported, tensors = read_export(Path(tmp))
    # The tensors, quantization block, dtype and (padded) vocabulary are the export's; the other keys stay the
    # model's: ModelOpt 0.47 reads rope_theta where transformers 4.x kept it, and under transformers 5 leaves
    # rotary_base out, which TensorRT-LLM then takes as 10000.
    quantized = replace(config, quantization=exported["quantization"], vocab_size=exported["vocab_size"],
                        dtype=exported["dtype"])
    return quantized, checkpoint_tensors(quantized, tensors)


def pad_vocabulary(config: ModelConfig, weights: dict[str, torch.Tensor],
                   multiple: int = AWQ_VOCAB_MULTIPLE) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The embedding and lm_head padded with zero rows to a multiple of ``multiple`` tokens, as ModelOpt pads them
    for an AWQ export (``pad_embedding_lm_head``), which it cannot do itself where it shares the table (a tied
    Gemma lm_head: it has no lm_head to pad)."""
    padded = -(-config.vocab_size // multiple) * multiple
    if padded == config.vocab_size:
        return config, weights
    out = dict(weights)
    for name in ("transformer.vocab_embedding.weight", "lm_head.weight"):
        out[name] = torch.nn.functional.pad(weights[name], (0, 0, 0, padded - config.vocab_size))
    return replace(config, vocab_size=padded), out


# decoder types ModelOpt 0.47 writes a TensorRT-LLM config.json for without tensorrt_llm installed
_CONFIG_DECODERS = ("gpt", "gemma", "llama", "qwen")


def export_checkpoint(model, decoder: str, folder: Path) -> None:
    """ModelOpt's TensorRT-LLM export of a quantized transformers model into ``folder`` (fp16, one rank).

    For a decoder type whose TensorRT-LLM model ModelOpt does not describe (gemma3: "not supported by
    TensorRT-LLM yet", its pytorch backend runs it), ModelOpt converts every tensor and then fails on the config;
    there its config converter is replaced, for this call, by one writing what ``quantize_weights`` reads back:
    the quantization block (lm_head excluded, as ModelOpt excludes it), vocabulary size and dtype.
    """
    from modelopt.torch.export import export_tensorrt_llm_checkpoint, model_config_export

    def bare_config(model_config, quant_config, hf_config=None) -> dict:
        excluded = quant_config.setdefault("exclude_modules", [])
        if "lm_head" not in excluded:
            excluded.append("lm_head")
        return {"architecture": model_config.architecture, "decoder": decoder, "rank": model_config.rank,
                "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}, "dtype": model_config.dtype,
                "vocab_size": model_config.vocab_size, "quantization": quant_config}

    if decoder not in _CONFIG_DECODERS and not hasattr(model_config_export, "convert_to_tensorrt_llm_config"):
        raise ConfigError(f"this nvidia-modelopt cannot export {decoder} checkpoints here; install nvidia-modelopt "
                          "0.47 (pip install 'nvidia-modelopt==0.47.*')")
    patch = contextlib.nullcontext() if decoder in _CONFIG_DECODERS else unittest.mock.patch.object(
        model_config_export, "convert_to_tensorrt_llm_config", bare_config)
    with patch:
        export_tensorrt_llm_checkpoint(model, decoder, torch.float16, export_dir=folder, inference_tensor_parallel=1)


def read_export(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The ``config.json`` dict and tensors of a ModelOpt export folder (+ ``rank0.safetensors``) as written."""
    from safetensors.torch import load_file

    data = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    return data, load_file(str(folder / WEIGHTS_FILE))


def checkpoint_tensors(config: ModelConfig, exported: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of quantized ``config``: ModelOpt's ``exported`` ones, with what its layout writes otherwise
    in ours (its export holds every norm, q/k norms and Gemma's 1 + weight ones included).

    - a fused gate_up_proj (Phi-3) exports as one ``mlp.fc`` of 2 x intermediate rows, gate_proj's first:
      its rows are split into ``mlp.fc`` and ``mlp.gate`` (a packed int4 weight holds two rows per byte row,
      the per-input prequant scale is both halves');
    - a shared embedding table (Gemma's tied lm_head) exports no ``lm_head``: it is the (padded) embedding.
    """
    out = dict(exported)
    inter = config.intermediate_size
    for layer in range(config.num_hidden_layers):
        base = f"{layer_prefix(layer)}.mlp"
        fused = out.get(f"{base}.fc.weight")
        if f"{base}.gate.weight" in out or fused is None:
            continue
        packed = isinstance(config.weight_format, W4A16Awq)
        for suffix in [s for s in config.weight_format.tensors if f"{base}.fc.{s}" in out]:
            tensor = out.pop(f"{base}.fc.{suffix}")
            if suffix == PREQUANT:
                out[f"{base}.fc.{suffix}"], out[f"{base}.gate.{suffix}"] = tensor, tensor.clone()
                continue
            rows = inter // 2 if packed and suffix == "weight" else inter
            if tensor.shape[0] != 2 * rows:
                raise ConfigError(f"ModelOpt exported {base}.fc.{suffix} with {tensor.shape[0]} rows, neither the "
                                  f"MLP's fc nor fc and gate fused; this ModelOpt version is not supported")
            out[f"{base}.fc.{suffix}"], out[f"{base}.gate.{suffix}"] = tensor[:rows].clone(), tensor[rows:].clone()
    if "lm_head.weight" not in out and "transformer.vocab_embedding.weight" in out:
        out["lm_head.weight"] = out["transformer.vocab_embedding.weight"].clone()
    return out


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
                 progress: bool = True,
                 source: SourceModel | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The checkpoint cabin-eval measures for one entry of EVAL_WEIGHTS, made from full-precision weights:
    fp32 as given, int8 and int4-awq quantized by ModelOpt on ``calibration``, int4-rtn by round to nearest on
    AWQ's groups, int4-g32 (and its int8 head) from the blocks of ``source`` where it has them, else rounded."""
    if name not in EVAL_WEIGHTS:
        raise ConfigError(f"unknown weights {name!r}; choose from {', '.join(EVAL_WEIGHTS)}")
    if name == EVAL_WEIGHTS[0]:
        return config, weights
    if name == RTN:
        return round_to_nearest(config, weights)
    if name.startswith(Int4G32.name):
        config, weights, _ = to_int4_g32(config, weights, source, WEIGHT_FORMATS[name.removesuffix(INT8_HEAD)])
        return to_int8_head(config, weights, source)[:2] if name.endswith(INT8_HEAD) else (config, weights)
    return quantize_weights(config, weights, WEIGHT_FORMATS[name], calibration, progress)


def stored_bytes(weights: dict[str, torch.Tensor]) -> int:
    """Bytes of a checkpoint's tensors as an fp16 checkpoint stores them: weights, norms and prequant scales in
    fp16, int8 tensors and the float32 weight scales as they are; KV scaling factors left out."""
    def size(name: str, t: torch.Tensor) -> int:
        keep = not t.is_floating_point() or name.endswith(SCALE)
        return t.numel() * (t.element_size() if keep else 2)

    return sum(size(name, t) for name, t in weights.items() if not name.endswith("cache_scaling_factor"))
