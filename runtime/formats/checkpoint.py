"""The TensorRT-LLM checkpoint format: config keys, weight names, load and save.

A checkpoint is a folder with ``config.json`` and ``rank0.safetensors``; the
names and keys match what ``trtllm-build`` reads (see ARCHITECTURE.md, "Formats we match").
"""
from __future__ import annotations

import errno
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from cabinllm.runtime.errors import CheckpointError, WeightFormatError
from cabinllm.runtime.formats.weight_formats import (HEAD_TENSORS, LINEAR_LAYERS, WeightFormat, checkpoint_format,
                                                     head_format)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "rank0.safetensors"
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")  # the gated MLP's activation: Llama family, exact GELU, Gemma
REBUILD = "rebuild the engine with cabin-build"
_COUNT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_size", "intermediate_size", "max_position_embeddings")
# ModelOpt writes separate K and V scales beside TensorRT-LLM's shared kv_cache_scaling_factor; nothing reads them
_OPTIONAL = ("attention.k_cache_scaling_factor", "attention.v_cache_scaling_factor")
# fields newer than the format, written only where a model has them, so other models' files stay as they were
_WRITTEN_WHEN_SET = ("nope_layers",)
_ROPE_SCALINGS = ("default", "linear", "llama3", "longrope", "mrope")  # cabinllm.runtime.model.rope computes these


@dataclass
class ModelConfig:
    """The TensorRT-LLM ``config.json`` of a decoder-only model of a family in cabinllm.runtime.model.families.

    Beyond Llama: ``qk_layernorm`` (Qwen3, Gemma 3: RMSNorm of each q and k head before RoPE),
    ``rotary_dim`` channels of each head rotated (Phi-3: ``partial_rotary_factor`` of the head), and Gemma 3's
    ``inter_layernorms`` (norms after attention and around the MLP), ``query_pre_attn_scalar``, embeddings scaled by
    sqrt(hidden_size), and local layers attending over ``sliding_window`` tokens with their own RoPE base
    (``rope_local_base_freq``): every ``sliding_window_pattern``-th layer is global, the others local;
    ``nope_layers`` (SmolLM3) run attention without RoPE.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    intermediate_size: int
    max_position_embeddings: int
    rotary_base: float = 10000.0
    rotary_scaling: dict | None = None
    norm_epsilon: float = 1e-5
    hidden_act: str = "silu"
    dtype: str = "float16"
    position_embedding_type: str = "rope_gpt_neox"
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    qk_layernorm: bool = False
    rotary_dim: int | None = None  # None: the whole head
    inter_layernorms: bool = False
    query_pre_attn_scalar: float | None = None  # None: head_size
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    nope_layers: list[int] | None = None  # layers whose q and k RoPE leaves as they are (NoPE); None: none
    mapping: dict = field(default_factory=lambda: {"world_size": 1, "tp_size": 1, "pp_size": 1})
    quantization: dict = field(default_factory=lambda: {"quant_algo": None, "kv_cache_quant_algo": None})

    @property
    def weight_format(self) -> WeightFormat:
        """The stored format of the linear weights, from ``quantization`` (cabinllm.runtime.formats.weight_formats)."""
        return checkpoint_format(self.quantization, linear_inputs(self), "config")

    @property
    def rotated_channels(self) -> int:
        """Channels of each q/k head that RoPE rotates (the first ones)."""
        return self.head_size if self.rotary_dim is None else self.rotary_dim

    @property
    def embedding_multiplier(self) -> float:
        """What the embedding lookup is multiplied by: sqrt(hidden_size) where the architecture scales it (Gemma),
        else 1."""
        return math.sqrt(self.hidden_size) if _architecture(self.architecture).embedding_scaled else 1.0

    def layer_rotates(self, layer: int) -> bool:
        """Whether RoPE turns layer ``layer``'s queries and keys (every layer but ``nope_layers``)."""
        return not self.nope_layers or layer not in self.nope_layers

    def layer_window(self, layer: int) -> int | None:
        """Tokens layer ``layer`` attends over (itself included), or None for the whole history."""
        if self.sliding_window is None:
            return None
        pattern = self.sliding_window_pattern
        return None if pattern and (layer + 1) % pattern == 0 else self.sliding_window

    @property
    def kv_channels(self) -> int:
        """Channels of K (or V) per token per layer: kv heads x head size."""
        return self.num_key_value_heads * self.head_size

    def to_dict(self) -> dict:
        """The JSON form, as written to ``config.json``: the fields, plus the extra keys the architecture's
        TensorRT-LLM model reads (``CheckpointArchitecture.trtllm_keys``)."""
        data = {k: v for k, v in asdict(self).items() if not (k in _WRITTEN_WHEN_SET and v is None)}
        return {**data, **_architecture(self.architecture).trtllm_keys(self)}

    def check(self, source: str, fix: str = REBUILD) -> None:
        """CheckpointError naming the first value the reference engine cannot run with: its key, value and ``fix``."""
        problem = self._problem()
        if problem is not None:
            key, need = problem
            value = json.dumps(getattr(self, key), default=repr)
            raise CheckpointError(f"{source}: {key} is {value}; it must be {need}; {fix}")

    def _problem(self) -> tuple[str, str] | None:
        """(key, what its value must be) of the first unusable value, or None."""
        for key in _COUNT_KEYS:
            if not _is_int(getattr(self, key)) or getattr(self, key) <= 0:
                return key, "a positive integer"
        if self.num_attention_heads % self.num_key_value_heads:
            return "num_key_value_heads", f"a divisor of num_attention_heads ({self.num_attention_heads})"
        if self.head_size % 2:
            return "head_size", "even (RoPE rotates pairs of channels)"
        rotary = self.rotary_dim
        if rotary is not None and not (_is_int(rotary) and 0 < rotary <= self.head_size and rotary % 2 == 0):
            return "rotary_dim", f"null or an even positive integer up to head_size ({self.head_size})"
        nope = self.nope_layers
        if nope is not None and not (isinstance(nope, list) and all(_is_int(i) for i in nope)
                                     and sorted(set(nope)) == nope and 0 <= min(nope, default=0)
                                     and max(nope, default=0) < self.num_hidden_layers):
            return "nope_layers", (f"null or a rising list of distinct layer indices below num_hidden_layers "
                                   f"({self.num_hidden_layers})")
        for key in ("sliding_window", "sliding_window_pattern"):
            value = getattr(self, key)
            if value is not None and not (_is_int(value) and value > 0):
                return key, "null or a positive integer"
        for key in ("query_pre_attn_scalar", "rope_local_base_freq", "final_logit_softcapping"):
            value = getattr(self, key)
            if value is not None and not _is_positive_number(value):
                return key, "null or a finite positive number"
        for key in ("rotary_base", "norm_epsilon"):
            if not _is_positive_number(getattr(self, key)):
                return key, "a finite positive number"
        for key in ("qkv_bias", "tie_word_embeddings", "qk_layernorm", "inter_layernorms"):
            if not isinstance(getattr(self, key), bool):
                return key, "true or false"
        if self.hidden_act not in HIDDEN_ACTS:
            return "hidden_act", " or ".join(f'"{act}"' for act in HIDDEN_ACTS)
        if self.position_embedding_type != "rope_gpt_neox":
            return "position_embedding_type", '"rope_gpt_neox"'
        for key in ("mapping", "quantization"):
            if not isinstance(getattr(self, key), dict):
                return key, "an object"
        need = _rotary_scaling_problem(self.rotary_scaling)
        section = (self.rotary_scaling or {}).get("mrope_section") if not need else None
        if section and 2 * sum(section) != self.rotated_channels:
            need = f"an object whose mrope_section sums to half the rotated channels ({self.rotated_channels // 2})"
        return ("rotary_scaling", need) if need else None

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "ModelConfig":
        """Parse and check a ``config.json`` dict; unknown keys are ignored, missing or unusable ones are an error."""
        if not isinstance(data, dict):
            raise CheckpointError(f"{source}: not a JSON object; {REBUILD}")
        arch = data.get("architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                f"{source}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        known = {f.name for f in fields(cls)}
        kwargs = {k: _OURS.get((k, v), v) if isinstance(v, str) else v for k, v in data.items() if k in known}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in kwargs]
        if missing:
            raise CheckpointError(f"{source}: missing config keys {missing}; re-run cabin-build to regenerate it")
        config = cls(**kwargs)
        config.check(source)
        try:
            checkpoint_format(config.quantization, linear_inputs(config), source)
        except WeightFormatError as err:
            raise CheckpointError(str(err)) from None
        return config


def _no_keys(config: ModelConfig) -> dict:
    """An architecture whose TensorRT-LLM model reads ModelConfig's fields only."""
    return {}


@dataclass(frozen=True)
class CheckpointArchitecture:
    """What one architecture's TensorRT-LLM checkpoint holds beyond ModelConfig's fields, as TensorRT-LLM's own
    converter writes it: ``trtllm_keys``, the keys its TensorRT-LLM model reads that are not fields or fields it
    spells its own way (``from_dict`` reads those back as ours); ``fused_mlp``, its MLP's fc and gate stored as one
    ``mlp.fc`` of [up; gate] rows (``to_disk``); ``embedding_scaled``, its embedding lookup multiplied by
    sqrt(hidden_size). Each family of cabinllm.runtime.model.families registers its own."""

    name: str
    trtllm_keys: Callable[[ModelConfig], dict] = _no_keys
    fused_mlp: bool = False
    embedding_scaled: bool = False


# the architectures a checkpoint may have, by name: filled in by cabinllm.runtime.model.families, which the
# package cabinllm.runtime imports before any of its rooms is used
ARCHITECTURES: dict[str, CheckpointArchitecture] = {}


def register_architecture(architecture: CheckpointArchitecture) -> None:
    """Make checkpoints of ``architecture`` readable and writable."""
    ARCHITECTURES[architecture.name] = architecture


def _architecture(name: str) -> CheckpointArchitecture:
    """The registered architecture ``name``; CheckpointError for one no family registered."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise CheckpointError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}") from None


# field values TensorRT-LLM spells its own way (CheckpointArchitecture.trtllm_keys) -> ours
_OURS = {("hidden_act", "swiglu"): "silu", ("position_embedding_type", "long_rope"): "rope_gpt_neox"}


def to_disk(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as TensorRT-LLM's converter stores them: a ``fused_mlp`` architecture's MLP as one ``mlp.fc`` of
    [up; gate] rows (Phi-3's), every other architecture's as they are."""
    if not _architecture(config.architecture).fused_mlp:
        return weights
    out, axes = dict(weights), _fused_axes(config)
    for layer in range(config.num_hidden_layers):
        p = f"{layer_prefix(layer)}.mlp"
        for suffix, axis in axes.items():
            gate_proj, up_proj = out.pop(f"{p}.fc.{suffix}"), out.pop(f"{p}.gate.{suffix}")
            if axis is None and not torch.equal(gate_proj, up_proj):
                raise CheckpointError(f"layer {layer}: mlp.fc and mlp.gate have different {suffix}, so "
                                      f"{config.architecture}'s fused MLP cannot hold them; quantize them with one "
                                      "input scale")
            out[f"{p}.fc.{suffix}"] = up_proj if axis is None else torch.cat([up_proj, gate_proj], dim=axis)
    return out


def from_disk(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``to_disk`` undone: a fused ``mlp.fc`` split into ``mlp.fc`` (the activated gate_proj) and ``mlp.gate``
    (up_proj), as every architecture's runtime reads them."""
    if not _architecture(config.architecture).fused_mlp or f"{layer_prefix(0)}.mlp.gate.weight" in weights:
        return weights
    out, axes = dict(weights), _fused_axes(config)
    for layer in range(config.num_hidden_layers):
        p = f"{layer_prefix(layer)}.mlp"
        for suffix, axis in axes.items():
            fused = out.pop(f"{p}.fc.{suffix}", None)
            if fused is None:
                continue  # validate_weights names it
            up_proj, gate_proj = (fused, fused) if axis is None else fused.chunk(2, dim=axis)
            out[f"{p}.fc.{suffix}"], out[f"{p}.gate.{suffix}"] = gate_proj.contiguous(), up_proj.contiguous()
    return out


def _fused_axes(config: ModelConfig) -> dict[str, int | None]:
    """Per stored tensor of an MLP input linear, the axis its output rows run along (None: one per input)."""
    fmt, shape = config.weight_format, linear_shapes(config)["mlp.fc"]
    single = fmt.stored(shape[0], shape[1], config.quantization)
    double = fmt.stored(2 * shape[0], shape[1], config.quantization)
    return {suffix: next((i for i, (a, b) in enumerate(zip(single[suffix].shape, double[suffix].shape)) if a != b),
                         None) for suffix in fmt.tensors}


def _rotary_scaling_problem(scaling: object) -> str | None:
    """What a ``rotary_scaling`` value lacks for cabinllm.runtime.model.rope, or None when it is usable."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in _ROPE_SCALINGS:
        return f"null or an object whose rope_type is one of {', '.join(_ROPE_SCALINGS)}"
    if kind == "mrope":
        section = scaling.get("mrope_section")
        return None if isinstance(section, list) and len(section) == 3 and all(_is_int(n) and n > 0 for n in section) \
            else "an object with mrope_section: 3 positive integers (pairs turned by time, height, width)"
    if kind != "default" and not _is_positive_number(scaling.get("factor")):
        return "an object with a finite positive factor"
    original = scaling.get("original_max_position_embeddings")
    if kind in ("llama3", "longrope") and not (_is_int(original) and original > 0):
        return "an object with a positive integer original_max_position_embeddings"
    if kind == "longrope" and not all(isinstance(scaling.get(k), list) for k in ("short_factor", "long_factor")):
        return "an object with short_factor and long_factor lists (one factor per rotated pair)"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


SOURCE_FIX = "the model's config is unusable; fix it or use another copy of the model"


def default_head_size(hidden_size: object, heads: object) -> object:
    """hidden_size // heads for positive integers; otherwise hidden_size, for ``ModelConfig.check`` to name."""
    ok = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (hidden_size, heads))
    return hidden_size // heads if ok else hidden_size


def layer_prefix(layer: int) -> str:
    """Name prefix of one decoder layer's tensors."""
    return f"transformer.layers.{layer}"


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear layer of one decoder layer, by its name suffix (``attention.qkv``, ...)."""
    h, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_size
    return {"attention.qkv": (q_out + 2 * config.kv_channels, h), "attention.dense": (h, q_out),
            "mlp.fc": (inter, h), "mlp.gate": (inter, h), "mlp.proj": (h, inter)}


def linear_inputs(config: ModelConfig) -> dict[str, int]:
    """Input size of each linear layer, by name suffix (what a group size must divide)."""
    return {layer: shape[1] for layer, shape in linear_shapes(config).items()}


def stored_tensors(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...] | None]]:
    """Every tensor the checkpoint stores in its weight format: name -> (shape, allowed dtypes or None for any
    float dtype)."""
    fmt, head = config.weight_format, head_format(config.quantization)
    shapes = expected_shapes(config)
    out: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...] | None]] = {}
    for name, shape in shapes.items():
        base = name.rsplit(".weight", 1)[0] if name.endswith(".weight") else None
        tables = head.stored(*shape) if base in HEAD_TENSORS else None
        if tables is not None:
            out |= {f"{base}.{suffix}": (stored.shape, stored.dtypes) for suffix, stored in tables.items()}
            continue
        if base is None or not base.endswith(LINEAR_LAYERS):
            out[name] = (shape, None)
            continue
        for suffix, stored in fmt.stored(shape[0], shape[1], config.quantization).items():
            out[f"{base}.{suffix}"] = (stored.shape, stored.dtypes)
    return out


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the checkpoint must hold, with its shape (linear weights are (out, in))."""
    h, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_size
    qkv_out = q_out + 2 * config.kv_channels
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.vocab_embedding.weight": (config.vocab_size, h),
        "transformer.ln_f.weight": (h,),
        "lm_head.weight": (config.vocab_size, h),
    }
    for layer in range(config.num_hidden_layers):
        p = layer_prefix(layer)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.attention.qkv.weight"] = (qkv_out, h)
        shapes[f"{p}.attention.dense.weight"] = (h, q_out)
        shapes[f"{p}.post_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.fc.weight"] = (inter, h)
        shapes[f"{p}.mlp.gate.weight"] = (inter, h)
        shapes[f"{p}.mlp.proj.weight"] = (h, inter)
        if config.qk_layernorm:
            shapes[f"{p}.attention.q_layernorm.weight"] = (config.head_size,)
            shapes[f"{p}.attention.k_layernorm.weight"] = (config.head_size,)
        if config.inter_layernorms:
            shapes[f"{p}.pre_feedforward_layernorm.weight"] = (h,)
            shapes[f"{p}.post_feedforward_layernorm.weight"] = (h,)
        if config.qkv_bias:
            shapes[f"{p}.attention.qkv.bias"] = (qkv_out,)
        if config.quantization.get("kv_cache_quant_algo"):
            shapes[f"{p}.attention.kv_cache_scaling_factor"] = (1,)
    return shapes


def validate_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise CheckpointError naming the first missing, misshapen or unexpected tensor."""
    if config.num_hidden_layers > len(weights):  # before listing the tensors of that many layers
        raise CheckpointError(f"{source}: the config says num_hidden_layers {config.num_hidden_layers} but there are "
                              f"only {len(weights)} tensors; the config and the weights disagree, {REBUILD}")
    try:
        expected = stored_tensors(config)
    except WeightFormatError as err:
        raise CheckpointError(str(err)) from None
    algo = config.quantization.get("quant_algo")
    for name, (shape, dtypes) in expected.items():
        if name not in weights:
            what = f"the {algo} checkpoint has no {name.rsplit('.', 1)[-1]} for it" if algo else "it is missing"
            raise CheckpointError(f"{source}: tensor {name} is missing ({what}); the checkpoint is incomplete, "
                                  "export or rebuild it")
        actual = tuple(weights[name].shape)
        if actual != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {list(actual)}, expected {list(shape)}")
        if dtypes is not None and weights[name].dtype not in dtypes:
            raise CheckpointError(f"{source}: tensor {name} is {weights[name].dtype}, a {algo or 'full-precision'} "
                                  f"checkpoint stores it as {dtypes[0]}; export the checkpoint again")
    unexpected = sorted(name for name in set(weights) - set(expected) if not name.endswith(_OPTIONAL))
    if unexpected:
        raise CheckpointError(f"{source}: tensor {unexpected[0]} is not part of the model the config describes "
                              f"({len(unexpected)} such tensors); the config and the weights disagree, {REBUILD}")


def load_checkpoint(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read and validate a TensorRT-LLM checkpoint folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(f"{path}: not found; point to a folder made by cabin-build")
    try:
        config = ModelConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")), str(config_path))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err}); rebuild the checkpoint") from err
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{weights_path}: unreadable safetensors file ({err}); it may be truncated, rebuild it") from err
    weights = from_disk(config, weights)
    validate_weights(config, weights, str(weights_path))
    return config, weights


def save_checkpoint(folder: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``rank0.safetensors`` into an existing (temporary) folder."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    validate_weights(config, weights, str(folder))
    folder = Path(folder)
    (folder / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2), encoding="utf-8")
    path = folder / WEIGHTS_FILE
    try:
        save_file({k: v.contiguous() for k, v in to_disk(config, weights).items()}, str(path))
    except SafetensorError as err:  # its I/O errors come as text: "... No space left on device (os error 28)"
        code = re.search(r"os error (\d+)", str(err))
        raise OSError(int(code.group(1)) if code else errno.EIO, str(err), str(path)) from err
    path.chmod(0o644)  # readable by the runtime's user on the board
