"""The reference forward pass of a Llama-family decoder over a paged KV cache.

Computes in fp32 on the CPU whatever dtype the checkpoint stores. One sequence
at a time: prefill of N tokens and decode of 1 are the same call.

Linear weights keep the checkpoint's (out, in) layout and weight format (runtime.weight_formats;
int8 / int4 ones are dequantized on the fly by runtime.quant_linear); the MLP's fc and gate
weights are one (2 * inter, in) matrix where the format allows, applied in one call. Decoding one token
is bound by reading those weights and the KV history, so that case runs on the
native kernels of runtime.native_kernels: a matrix-vector product per linear
layer and attention that reads the cache's elements in their blocks (int4 is
dequantized first). Prefill and machines where the kernels cannot be built run
the torch path below (same math).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.block_manager import Sequence
from runtime.checkpoint import ModelConfig, layer_prefix
from runtime.kv_cache import PagedKVCache
from runtime.kv_storage import KVLayout, KVStorage
from runtime.native_kernels import MatVec, decode_attention, matvec, native_kernels_enabled
from runtime.quant_linear import Linear, linear as _linear, stack
from runtime.rope import apply_rope, rope_table


@dataclass
class StepContext:
    """What every layer of one forward step reads: where the new tokens go and what they attend to."""

    start_pos: int
    num_tokens: int
    slots: torch.Tensor  # flat KV slot of each new token
    block_table: torch.Tensor  # the sequence's blocks
    storage: KVStorage
    native: bool  # a one-token step on the native kernels
    matvec: MatVec | None  # the one-token linear kernel, where it could be built

    @property
    def context(self) -> int:
        """Tokens attended to by the last new token, itself included."""
        return self.start_pos + self.num_tokens


class Transformer:
    """Weights of a TensorRT-LLM checkpoint plus the math to run them."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        w = {k: v for k, v in weights.items() if not k.endswith("cache_scaling_factor")}
        self.embedding = w["transformer.vocab_embedding.weight"].float()
        self.final_norm = w["transformer.ln_f.weight"].float()
        self.lm_head = w.pop("lm_head.weight").float().contiguous()
        self.layers = [_layer_weights(w, i, config) for i in range(config.num_hidden_layers)]
        self.cos, self.sin = rope_table(config.head_size, config.max_position_embeddings,
                                        config.rotary_base, config.rotary_scaling)
        self.native_kernels = native_kernels_enabled()

    @property
    def kv_layout(self) -> KVLayout:
        """Shape of this model's KV cache."""
        c = self.config
        return KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_size)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], start_pos: int, cache: PagedKVCache, seq: Sequence,
                all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions [start_pos, start_pos + N) of a sequence whose slots are allocated.

        Writes their K/V into the cache and returns logits of the last token
        (shape (vocab,)) or of every token (shape (N, vocab)).
        """
        c = self.config
        n = len(token_ids)
        end = start_pos + n
        if end > c.max_position_embeddings:
            raise ValueError(f"position {end} exceeds the model's context of {c.max_position_embeddings} tokens")
        x = self.embedding[torch.tensor(token_ids, dtype=torch.long)]
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        native = n == 1 and self.native_kernels
        mv = matvec() if native else None
        ctx = StepContext(start_pos, n, cache.slots(seq, start_pos, end), cache.block_table(seq), cache.storage,
                          native, mv)
        for index, layer in enumerate(self.layers):
            h = _rms_norm(x, layer["input_norm"], c.norm_epsilon)
            x = x + self._attention(index, layer, h, cos, sin, ctx)
            h = _rms_norm(x, layer["post_norm"], c.norm_epsilon)
            fc, gate = _linear(h, layer["fc_gate"], mv).chunk(2, dim=-1)
            x = x + _linear(F.silu(fc) * gate, layer["proj"], mv)
        if not all_logits:
            x = x[-1:]
        logits = _linear(_rms_norm(x, self.final_norm, c.norm_epsilon), self.lm_head, mv)
        return logits if all_logits else logits[0]

    def _attention(self, index: int, layer: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   ctx: StepContext) -> torch.Tensor:
        c = self.config
        n, heads, kv_heads, d = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_size
        mv = ctx.matvec
        qkv = _linear(h, layer["qkv"], mv, layer.get("qkv_bias"))
        qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        q, k = apply_rope(qk.view(n, heads + kv_heads, d), cos, sin).split([heads, kv_heads], dim=1)
        ctx.storage.write(index, ctx.slots, k, v.view(n, kv_heads, d))
        stored = ctx.storage.stored_kv(index, ctx.block_table, ctx.context) if ctx.native else None
        kernel = decode_attention(stored.k.dtype, d, heads // kv_heads) if stored is not None else None
        if kernel is not None:
            out = kernel(q[0], stored, ctx.context)
        else:
            keys, values, k_scale, v_scale = ctx.storage.read_unscaled(index, ctx.block_table, ctx.context)
            out = grouped_attention(q * k_scale if k_scale != 1.0 else q, keys, values, ctx.start_pos)
            out = out * v_scale if v_scale != 1.0 else out
        return _linear(out, layer["dense"], mv)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Causal attention of q (n, heads, d) at positions [start_pos, start_pos + n) over keys/values
    (context, kv_heads, d) of positions [0, context); returns (n, heads * d).

    Decode (n == 1) folds each KV group's query heads into rows of one call, so K/V are never
    repeated; prefill repeats K/V per query head and uses the fused causal kernel.
    """
    n, heads, d = q.shape
    context, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    if n == 1:
        q = q.view(kv_heads, group, d)[None]
        out = F.scaled_dot_product_attention(q, keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
        return out.reshape(1, heads * d)
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    q = q.transpose(0, 1)[None]
    if start_pos == 0 and n == context:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    else:
        mask = torch.arange(context)[None, :] <= torch.arange(start_pos, start_pos + n)[:, None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out[0].transpose(0, 1).reshape(n, heads * d)


def _layer_weights(w: dict[str, torch.Tensor], layer: int, config: ModelConfig) -> dict[str, torch.Tensor | Linear]:
    """One layer's norms and linear ops in the checkpoint's weight format (runtime.weight_formats); fc and gate
    stacked in one op."""
    p, fmt = layer_prefix(layer), config.weight_format

    def op(name: str) -> Linear:
        return fmt.linear({s: w.pop(f"{p}.{name}.{s}") for s in fmt.tensors}, config.quantization)

    out = {
        "input_norm": w[f"{p}.input_layernorm.weight"].float(),
        "qkv": op("attention.qkv"),
        "dense": op("attention.dense"),
        "post_norm": w[f"{p}.post_layernorm.weight"].float(),
        "fc_gate": stack(op("mlp.fc"), op("mlp.gate")),
        "proj": op("mlp.proj"),
    }
    if config.qkv_bias:
        out["qkv_bias"] = w[f"{p}.attention.qkv.bias"].float()
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
