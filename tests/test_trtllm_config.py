"""The config.json CabinLLM writes for a Qwen2 model, read the way TensorRT-LLM's Qwen build reads it (issue 12.1).

``trtllm-build`` turns config.json into a config object with ``PretrainedConfig.from_dict`` and builds
``QWenForCausalLM`` for ``Qwen2ForCausalLM``. The stand-ins below copy that field handling from NVIDIA/TensorRT-LLM
(stored copies read for this test: ``tensorrt_llm/models/modeling_utils.py`` at 01ea6d79, ``models/qwen/config.py``
at 0428c188, ``models/qwen/model.py`` at 04a2cacb; not the 0.12 tree, where issue 12 reports the same qwen_type
read). Line numbers are those copies', counted by hand; modeling_utils.py is cited by class and method. The stand-ins raise where TensorRT-LLM raises: a key it takes without a default that is missing is an
AttributeError when the model reads it, an unknown key of a typed sub-config a TypeError.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.sources.model_source import import_model

from fakes.tiny_model import write_tiny_llama

# functional.PositionEmbeddingType: from_string accepts these names (a subset: the ones a decoder checkpoint uses).
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope_gptj", "rope_gpt_neox", "long_rope", "alibi",
                            "alibi_with_scale", "relative", "chatglm", "yarn", "mrope")


@dataclasses.dataclass
class QuantConfig:
    """modeling_utils.QuantConfig: a dataclass; from_dict is ``cls(**config)``, so an unknown key is a TypeError."""

    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int = 128
    smoothquant_val: float = 0.5
    clamp_val: list | None = None
    use_meta_recipe: bool = False
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list | None = None


@dataclasses.dataclass
class Mapping:
    """mapping.Mapping: from_dict is ``cls(**config)`` (the fields a single-GPU checkpoint writes)."""

    world_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    cp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    moe_tp_size: int = -1
    moe_ep_size: int = -1


@dataclasses.dataclass
class MoeConfig:
    """layers.moe.MoeConfig: no experts unless the config names some; has_moe() is ``num_experts > 1``."""

    num_experts: int = 0
    top_k: int = 0
    normalization_mode: int = 0

    def has_moe(self) -> bool:
        return self.num_experts > 1


class PretrainedConfig:
    """modeling_utils.PretrainedConfig.__init__ (``class PretrainedConfig:`` and the keyword-only signature that
    follows it): architecture, dtype, hidden_size, num_hidden_layers and num_attention_heads have no default; the
    rest of the named keys do; every other key lands in ``**kwargs`` and becomes an attribute by the closing
    ``for key, value in kwargs.items(): setattr(self, key, value)`` loop ("Implicitly setting ..." warning)."""

    def __init__(self, *, architecture, dtype, hidden_size, num_hidden_layers, num_attention_heads, vocab_size=None,
                 hidden_act="gelu", logits_dtype="float32", norm_epsilon=1e-5,
                 position_embedding_type="learned_absolute", max_position_embeddings=None, rotary_embedding_dim=None,
                 num_key_value_heads=None, intermediate_size=None, mapping=None, quantization=None,
                 use_parallel_embedding=False, embedding_sharding_dim=0, head_size=None, qk_layernorm=False,
                 runtime_defaults=None, **kwargs):
        self.architecture, self.dtype, self.vocab_size = architecture, dtype, vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.hidden_act = num_attention_heads, hidden_act
        self.logits_dtype, self.norm_epsilon, self.runtime_defaults = logits_dtype, norm_epsilon, runtime_defaults
        # str -> PositionEmbeddingType.from_string, then ``assert isinstance(..., PositionEmbeddingType)``
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise KeyError(position_embedding_type)
        self.position_embedding_type = position_embedding_type
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.intermediate_size = hidden_size * 4 if intermediate_size is None else intermediate_size
        self.max_position_embeddings = max_position_embeddings
        # mapping / quantization: None -> default object, dict -> X.from_dict(dict) (= X(**dict))
        self.mapping = Mapping(**(mapping or {}))
        self.quantization = QuantConfig(**(quantization or {}))
        self.use_parallel_embedding, self.embedding_sharding_dim = use_parallel_embedding, embedding_sharding_dim
        self.head_size = hidden_size // num_attention_heads if head_size is None else head_size
        self.qk_layernorm = qk_layernorm
        if rotary_embedding_dim is None:
            rotary_embedding_dim = kwargs.get("rotary_dim", int(self.head_size * kwargs.get("rotary_pct", 1.0)))
        self.rotary_embedding_dim = rotary_embedding_dim
        for key, value in kwargs.items():
            setattr(self, key, value)

    @classmethod
    def from_dict(cls, config: dict) -> "PretrainedConfig":
        """modeling_utils.PretrainedConfig.from_dict: ``MODEL_MAP[config['architecture']]`` picks the model class,
        its ``config_class`` the config class, then ``config_cls(**config)`` with every key of config.json."""
        model_cls = MODEL_MAP[config["architecture"]]
        return model_cls.config_class(**config)


class QWenConfig(PretrainedConfig):
    """models/qwen/config.py QWenConfig.__init__ (lines 25-55): its own keys mlp_bias=False, attn_bias=True,
    rotary_base=10000.0, rotary_scaling=None, disable_weight_only_quant_plugin, use_logn_attn, moe, num_labels
    (lines 27-42); moe=None builds a MoeConfig from the legacy moe_num_experts / moe_top_k / moe_normalization_mode
    keys, popped with defaults (lines 43-53); the rest goes to PretrainedConfig.__init__ (line 55). ``qwen_type`` is
    not among its keys: from_hugging_face passes it (``qwen_type=qwen_type``, line ~188, from the HF model_type) as
    an extra key, so a checkpoint config without it gives a QWenConfig without the attribute."""

    def __init__(self, *, mlp_bias=False, attn_bias=True, rotary_base=10000.0, rotary_scaling=None,
                 disable_weight_only_quant_plugin=False, use_logn_attn=False, moe=None, num_labels=1, **kwargs):
        self.mlp_bias, self.attn_bias = mlp_bias, attn_bias
        self.rotary_base, self.rotary_scaling = rotary_base, rotary_scaling
        self.disable_weight_only_quant_plugin, self.num_labels = disable_weight_only_quant_plugin, num_labels
        self.use_logn_attn = use_logn_attn
        if moe is None:
            moe = MoeConfig(num_experts=kwargs.pop("moe_num_experts", 0), top_k=kwargs.pop("moe_top_k", 0),
                            normalization_mode=kwargs.pop("moe_normalization_mode", 0))
        elif isinstance(moe, dict):
            moe = MoeConfig(**moe)
        self.moe = moe
        super().__init__(**kwargs)


class QWenForCausalLM:
    config_class = QWenConfig


MODEL_MAP = {"Qwen2ForCausalLM": QWenForCausalLM}  # models/__init__.py: 'Qwen2ForCausalLM': QWenForCausalLM


def qwen_build_parameters(config: QWenConfig) -> dict[str, tuple[int, ...]]:
    """Read every config attribute models/qwen/model.py reads to build a Qwen2 model, and return the parameters
    (checkpoint names and shapes) that model has; an attribute the config lacks raises AttributeError as there.

    QWenDecoderLayer.__init__ (lines 43-120): dtype, mapping.tp_size, hidden_size, norm_epsilon, num_hidden_layers,
    head_size, num_attention_heads, num_key_value_heads, max_position_embeddings, ``bias=config.attn_bias`` (line 67),
    position_embedding_type, rotary_base, rotary_scaling (lines 52-74); ``config.moe.has_moe()`` (line 78);
    ``config.qwen_type == 'qwen2_moe'`` (line 85) and the intermediate size by qwen_type (lines 104-110: 'qwen' halves
    it, 'qwen2_moe' takes moe_intermediate_size); hidden_act and ``bias=config.mlp_bias`` (lines 112-116).
    QWenModel.__init__: vocab_size, hidden_size, dtype, norm_epsilon. QWenForCausalLM.__init__: architecture
    ('Qwen2ForSequenceClassification' gets a score head) and qwen_type again (LoRA module names).
    """
    tp = config.mapping.tp_size
    h, d = config.hidden_size, config.head_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    _ = (config.dtype, config.norm_epsilon, config.max_position_embeddings, config.position_embedding_type,
         config.rotary_base, config.rotary_scaling, config.hidden_act)  # read as they are; no defaults to fall back on
    if config.moe.has_moe():
        raise NotImplementedError("MoE")
    if config.qwen_type == "qwen2_moe":
        raise NotImplementedError("shared experts")
    if config.qwen_type == "qwen":
        inter = config.intermediate_size // 2
    elif config.qwen_type == "qwen2_moe":
        inter = config.moe_intermediate_size
    else:
        inter = config.intermediate_size
    padded = -(-config.vocab_size // tp) * tp  # _utils.pad_vocab_size: up to a multiple of tp_size
    head_rows = config.num_labels if config.architecture == "Qwen2ForSequenceClassification" else padded
    params = {"transformer.vocab_embedding.weight": (config.vocab_size, h), "transformer.ln_f.weight": (h,),
              "lm_head.weight": (head_rows, h)}
    for layer in range(config.num_hidden_layers):
        p = f"transformer.layers.{layer}"
        params.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_layernorm.weight": (h,),
                       f"{p}.attention.qkv.weight": (q + 2 * kv, h), f"{p}.attention.dense.weight": (h, q),
                       f"{p}.mlp.fc.weight": (inter, h), f"{p}.mlp.gate.weight": (inter, h),
                       f"{p}.mlp.proj.weight": (h, inter)})
        if config.attn_bias:  # Attention(bias=...) adds the qkv bias; dense_bias=False
            params[f"{p}.attention.qkv.bias"] = (q + 2 * kv,)
        if config.mlp_bias:  # GatedMLP(bias=...) adds fc, gate and proj biases
            params.update({f"{p}.mlp.fc.bias": (inter,), f"{p}.mlp.gate.bias": (inter,), f"{p}.mlp.proj.bias": (h,)})
    return params


def write_tiny_qwen2(folder: Path) -> Path:
    """The tiny HF Llama folder turned into a Qwen2 one: architectures ["Qwen2ForCausalLM"] plus q/k/v biases."""
    write_tiny_llama(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for layer in range(config["num_hidden_layers"]):
        for name in "qkv":
            rows = weights[f"model.layers.{layer}.self_attn.{name}_proj.weight"].shape[0]
            weights[f"model.layers.{layer}.self_attn.{name}_proj.bias"] = torch.randn(rows, generator=gen)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen2")
    out = root / "ckpt"
    out.mkdir()
    import_model(write_tiny_qwen2(root / "hf"), out, dtype="float16")
    return out


def test_qwen2_config_builds_through_the_qwen_model(qwen2_checkpoint):
    data = json.loads((qwen2_checkpoint / "config.json").read_text())
    config = PretrainedConfig.from_dict(data)
    assert isinstance(config, QWenConfig)
    assert (config.qwen_type, config.attn_bias, config.mlp_bias) == ("qwen2", True, False)
    params = qwen_build_parameters(config)
    # PretrainedModel.load: a parameter the model has but the checkpoint lacks is a RuntimeError ("Required but
    # not provided tensors"); shapes must match too.
    weights = load_file(str(qwen2_checkpoint / "rank0.safetensors"))
    assert {name: tuple(t.shape) for name, t in weights.items()} == params


def test_the_stand_in_rejects_a_qwen2_config_without_qwen_type(qwen2_checkpoint):
    """What CabinLLM wrote before issue 12.1 (the ModelConfig fields alone): the build dies on config.qwen_type."""
    old = dataclasses.asdict(ModelConfig.from_dict(json.loads((qwen2_checkpoint / "config.json").read_text())))
    with pytest.raises(AttributeError, match="qwen_type"):
        qwen_build_parameters(PretrainedConfig.from_dict(old))


def test_config_json_still_round_trips(qwen2_checkpoint):
    data = json.loads((qwen2_checkpoint / "config.json").read_text())
    config = ModelConfig.from_dict(data)
    assert config.to_dict() == data and config.qkv_bias
