"""What a model takes in memory: weights by storage format, KV bytes per token by dtype, activations.

Weights are counted from the TensorRT-LLM checkpoint's tensor shapes, so a tied
``lm_head`` counts twice: the checkpoint (and the engine) holds its own copy.
A model whose local layers attend over a sliding window (Gemma 3) holds their K/V for the window only: its bytes
per token count the global layers, ``kv_window_bytes`` the local ones. Weight-only int8/int4 quantize the linear
layers only (embedding, lm_head and norms
stay fp16, as TensorRT-LLM's weight-only modes do); int8 adds one float32 scale per
output channel, int4-awq one per group of 128 (or 64) inputs and an fp16 prequant scale per input,
as ModelOpt exports them; int4-g32 an fp16 scale and minimum per 32 inputs. The int8 head (reference engine)
stores embedding and lm_head as int8 with an fp16 scale per 32.
"""
from __future__ import annotations

import math

from cabinllm.builders.targets import Backend
from cabinllm.runtime.formats.checkpoint import ModelConfig, expected_shapes, linear_shapes
from cabinllm.runtime.formats.weight_formats import AWQ_GROUP_SIZES, HEAD_FORMATS, HEAD_TENSORS, awq_group_size
from cabinllm.runtime.formats.weight_formats import weight_format as weight_format_of
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.modes import bytes_per_token
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.kv.window import WindowPlan

_BYTES = {"fp32": 4, "fp16": 2}


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the checkpoint (a tied lm_head counted as its own copy)."""
    return sum(math.prod(shape) for name, shape in _weight_shapes(config).items())


def weights_bytes(config: ModelConfig, weight_format: str, in_memory: str | None = None, head: str = "fp16") -> int:
    """Bytes of the weights stored as ``weight_format`` (cabinllm.runtime.formats.weight_formats: the checkpoint's
    tensors, scales included; AWQ with the group size cabin-build picks) and the embedding and lm_head as ``head``
    (HEAD_FORMATS), float tensors (norms, an fp16 head, Qwen2's qkv bias) held as ``in_memory`` (fp32) when
    given."""
    fmt, head_fmt = weight_format_of(weight_format), HEAD_FORMATS[head]
    float_bytes = _BYTES[in_memory] if in_memory is not None else 2
    linears = linear_shapes(config)
    awq = fmt.group_sizes == AWQ_GROUP_SIZES  # the group size cabin-build picks; int4-g32's is fixed
    quantization = {"group_size": awq_group_size([s[1] for s in linears.values()])} if awq else {}
    total = 0
    for name, shape in _weight_shapes(config).items():
        suffix = ".".join(name.split(".")[3:-1])
        if suffix in linears and name.endswith(".weight"):  # a linear's bias is a float tensor
            total += fmt.weight_bytes(shape[0], shape[1], quantization, float_bytes)
        elif name.removesuffix(".weight") in HEAD_TENSORS:
            total += head_fmt.head_bytes(shape[0], shape[1], float_bytes)
        else:
            total += math.prod(shape) * float_bytes
    return total


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str, tokens_per_block: int, windowed: bool = True) -> int:
    """KV cache bytes of one token, K and V (scales of int8-dynamic included): of every layer, or where some layers
    attend over a sliding window (Gemma 3's local layers) and ``windowed``, of the others (``kv_window_bytes``
    counts the local ones)."""
    layout = KVLayout.of(config)
    plan = WindowPlan.of(layout, tokens_per_block)
    if plan is not None and windowed:
        layout = plan.layout(layout, plan.global_layers)
    return bytes_per_token(layout, kv_dtype, tokens_per_block)


def kv_window_bytes(config: ModelConfig, kv_dtype: str, tokens_per_block: int, tokens: int) -> int:
    """KV bytes the sliding-window layers of one sequence of ``tokens`` tokens hold: at most the window, in whole
    blocks and one more for a window that straddles them (0 for a model without such layers)."""
    layout = KVLayout.of(config)
    plan = WindowPlan.of(layout, tokens_per_block)
    if plan is None:
        return 0
    held = min(cdiv(tokens, tokens_per_block), cdiv(plan.window, tokens_per_block) + 1) * tokens_per_block
    return held * bytes_per_token(plan.layout(layout, plan.local_layers), kv_dtype, tokens_per_block)


def activation_bytes(config: ModelConfig, num_tokens: int, context: int, batch: int, backend: Backend) -> int:
    """Peak activation memory of one forward step over ``num_tokens`` tokens (an estimate).

    The largest live tensors of a layer (residual, normed input and the wider of the
    attention and MLP intermediates) plus the fp32 logits. TensorRT and the CUDA runner compute in fp16
    with attention in tiles and return the last tokens' logits; the reference engine
    computes in fp32 and materialises attention scores, the mask and one layer's
    dequantised K/V; an ONNX graph (cabin-export) does the same in fp32 over its window
    and the new tokens, holds scores and probabilities at once, and returns every
    token's logits.
    """
    h, q_out = config.hidden_size, config.num_attention_heads * config.head_size
    widest = max(2 * config.intermediate_size, q_out + 2 * config.kv_channels + q_out)
    per_token = 2 * h + widest
    logits = batch * config.vocab_size * 4
    if backend in (Backend.TENSORRT, Backend.CUDA):  # fp16, attention in tiles (no score matrix)
        return num_tokens * per_token * 2 + logits
    kv_read = 2 * context * config.kv_channels * 4
    if backend is Backend.ONNX:
        keys = context + num_tokens
        scores = 2 * config.num_attention_heads * num_tokens * keys * 4 + num_tokens * keys * 4  # + the fp32 mask
        return num_tokens * per_token * 4 + scores + kv_read + num_tokens * logits
    group = config.num_attention_heads // config.num_key_value_heads
    scores = config.num_attention_heads * num_tokens * context * 4 + group * num_tokens * context
    return num_tokens * per_token * 4 + scores + kv_read + logits


def _weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {n: s for n, s in expected_shapes(config).items() if not n.endswith("kv_cache_scaling_factor")}
