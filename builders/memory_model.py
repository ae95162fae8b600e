"""What a model takes in memory: weights by storage format, KV bytes per token by dtype, activations.

Weights are counted from the TensorRT-LLM checkpoint's tensor shapes, so a tied
``lm_head`` counts twice: the checkpoint (and the engine) holds its own copy.
Weight-only int8/int4 quantize the linear layers only (embedding, lm_head and norms
stay fp16, as TensorRT-LLM's weight-only modes do); int8 adds one fp16 scale per
output channel, int4 one per group of 128 inputs.
"""
from __future__ import annotations

import math

from runtime.checkpoint import ModelConfig, expected_shapes
from runtime.kv_modes import bytes_per_token
from runtime.kv_storage import KVLayout

WEIGHT_FORMATS = ("fp16", "int8", "int4")
INT4_GROUP = 128
_LINEAR = ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight", "mlp.gate.weight", "mlp.proj.weight")
_BYTES = {"fp32": 4, "fp16": 2}


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the checkpoint (a tied lm_head counted as its own copy)."""
    return sum(math.prod(shape) for name, shape in _weight_shapes(config).items())


def weights_bytes(config: ModelConfig, weight_format: str, in_memory: str | None = None) -> int:
    """Bytes of the weights stored as ``weight_format`` (fp16, int8, int4), or held as ``in_memory`` (fp32)."""
    if in_memory is not None:
        return parameter_count(config) * _BYTES[in_memory]
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    total = 0
    for name, shape in _weight_shapes(config).items():
        params = math.prod(shape)
        if weight_format == "fp16" or not name.endswith(_LINEAR):
            total += 2 * params
        elif weight_format == "int8":
            total += params + 2 * shape[0]
        else:
            total += params // 2 + 2 * shape[0] * math.ceil(shape[1] / INT4_GROUP)
    return total


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str, tokens_per_block: int) -> int:
    """KV cache bytes of one token, all layers, K and V (scales of int8-dynamic included)."""
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_size)
    return bytes_per_token(layout, kv_dtype, tokens_per_block)


def activation_bytes(config: ModelConfig, num_tokens: int, context: int, batch: int, backend: str) -> int:
    """Peak activation memory of one forward step over ``num_tokens`` tokens (an estimate).

    The largest live tensors of a layer (residual, normed input and the wider of the
    attention and MLP intermediates) plus the last tokens' fp32 logits. TensorRT
    computes in fp16 with fused attention; the reference engine computes in fp32 and
    materialises attention scores, the mask and one layer's dequantised K/V.
    """
    h, q_out = config.hidden_size, config.num_attention_heads * config.head_size
    widest = max(2 * config.intermediate_size, q_out + 2 * config.kv_channels + q_out)
    per_token = 2 * h + widest
    logits = batch * config.vocab_size * 4
    if backend == "tensorrt":
        return num_tokens * per_token * 2 + logits
    group = config.num_attention_heads // config.num_key_value_heads
    scores = config.num_attention_heads * num_tokens * context * 4 + group * num_tokens * context
    kv_read = 2 * context * config.kv_channels * 4
    return num_tokens * per_token * 4 + scores + kv_read + logits


def _weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {n: s for n, s in expected_shapes(config).items() if not n.endswith("kv_cache_scaling_factor")}
