"""The reference forward pass of a decoder (Llama, Qwen, Gemma 3, Phi-3 families) over a paged KV cache.

Computes in fp32 on the CPU whatever dtype the checkpoint stores. A step runs the
new tokens of one or more sequences (``Span``s) together: each linear layer reads
its weights once for all of them, and each span attends over its own sequence's
blocks. Prefill of N tokens and decode of 1 are the same call; batched decode is a
step of several one-token spans.

Linear weights keep the checkpoint's (out, in) layout and weight format (cabinllm.runtime.formats.weight_formats;
int8 / int4 ones are dequantized on the fly by cabinllm.runtime.model.linear, an fp16 lm_head is read as fp16 by the
kernels); the MLP's fc and gate
weights are one (2 * inter, in) matrix where the format allows, applied in one call. A decode step is
bound by reading those weights and the KV history, so a step of a few tokens runs
on the native kernels of cabinllm.runtime.kernels.bindings: a product of the step's tokens
with each linear layer's weights, read once (int8 / int4 weights dequantized in
registers), and, per one-token span, attention that reads the cache's elements in their blocks (int4
is dequantized first). Each token's row is computed exactly as it would be alone. A step of one token of
one sequence over a cache of static scales (fp32, fp16, int8) runs every layer in one native call
(decode_step.c), which spares the ~40 small torch ops per layer that otherwise cost a third of the step.
Longer prefill and machines where the kernels cannot be built run the torch path below (same math).

What the families add runs on the torch path around the same kernels: q/k norms before RoPE (Qwen3, Gemma 3),
partial rotary (Phi-3), Gemma 3's extra norms, GELU, embedding and query scales, and its local layers' window
(attention over the last ``sliding_window`` positions only), layers without RoPE (SmolLM3's NoPE layers). The
fused one-call decode step knows q/k norms, partial rotary and GELU besides Llama (Qwen3 and Phi-4-mini take it),
not Gemma 3 or NoPE layers.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.checkpoint import ModelConfig, layer_prefix
from cabinllm.runtime.kernels.bindings import (MATVEC_MAX_TOKENS, KernelLayer, MatVec, StepWeights, decode_attention,
                                               decode_step, matvec, native_kernels_enabled)
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.kv.storage import KVLayout, KVStorage
from cabinllm.runtime.formats.weight_formats import HEAD_TENSORS, SCALE, head_format
from cabinllm.runtime.model.linear import Int8G32Table, Linear, halves, kernel_linear, linear_op, stack
from cabinllm.runtime.model.linear import linear as _linear
from cabinllm.runtime.model.interface import MediaTable, ModelRunner, Span
from cabinllm.runtime.model.rope import Rope, apply_rope, mrope_offset, mrope_positions
from cabinllm.runtime.model.threads import CPU_THREADS


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


@dataclass
class StepContext:
    """What every layer of one forward step reads: where the new tokens go and what each span attends to."""

    spans: list[Span]
    slots: torch.Tensor  # flat KV slot of each new token, spans in order
    block_tables: list[torch.Tensor]  # each span's sequence's blocks
    storage: KVStorage
    native: bool  # one-token spans run attention on the native kernels
    matvec: MatVec | None  # the linear kernel, for a step of a few tokens where it could be built


class Transformer:
    """Weights of a TensorRT-LLM checkpoint plus the math to run them: the reference ``ModelRunner``."""

    batched = True

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        w = {k: v for k, v in weights.items() if not k.endswith("cache_scaling_factor")}
        self.native_kernels = native_kernels_enabled()
        self.embedding, self.lm_head = _head_tables(w, config, self.native_kernels)
        self.final_norm = w["transformer.ln_f.weight"].float()
        self.layers = [_layer_weights(w, i, config) for i in range(config.num_hidden_layers)]
        rotary, local = config.rotated_channels, config.rope_local_base_freq
        self.rope = Rope(rotary, config.rotary_base, config.rotary_scaling)
        self.local_rope = None if local is None else Rope(rotary, local)  # Gemma 3's local layers
        # SDPA scales by 1 / sqrt(head_size); Gemma's query_pre_attn_scalar asks for another scale
        scalar = config.query_pre_attn_scalar
        self.query_scale = 1.0 if scalar is None else math.sqrt(config.head_size / scalar)  # q's factor
        self._act = ACTIVATIONS[config.hidden_act]

    @property
    def kv_layout(self) -> KVLayout:
        """Shape of this model's KV cache."""
        return KVLayout.of(self.config)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 embedding rows of these token ids (an int8 table's rows dequantized)."""
        return self.embedding.rows(ids) if isinstance(self.embedding, Int8G32Table) else self.embedding[ids]

    def forward(self, token_ids: list[int], start_pos: int, cache: PagedKVCache, seq: Sequence,
                all_logits: bool = False, media: MediaTable | None = None) -> torch.Tensor:
        """Run tokens at positions [start_pos, start_pos + N) of a sequence whose slots are allocated.

        Writes their K/V into the cache and returns logits of the last token
        (shape (vocab,)) or of every token (shape (N, vocab)).
        """
        logits = self.step([Span(token_ids, start_pos, seq)], cache, all_logits, media)
        return logits if all_logits else logits[0]

    @torch.inference_mode()
    def step(self, spans: list[Span], cache: PagedKVCache, all_logits: bool = False,
             media: MediaTable | None = None) -> torch.Tensor:
        """Run the new tokens of several sequences (slots allocated) in one pass over the weights; the positions of
        their sequences' pictures (``Sequence.media``) take the rows of ``media`` (by digest) for input.

        Writes their K/V into the cache and returns the logits of each span's last token (shape
        (spans, vocab)), or of every token (shape (tokens, vocab)).
        """
        c = self.config
        CPU_THREADS.before_step()
        pieces = begin_step(self, spans, cache, all_logits, media)
        if pieces is not None:
            return pieces
        ids = [t for span in spans for t in span.token_ids]
        decoding = len(spans) <= MATVEC_MAX_TOKENS and all(len(span.token_ids) == 1 for span in spans)
        x = self._fused_step(spans, cache) if decoding and self.native_kernels else None
        if x is not None:
            return _linear(rms_norm(x, self.final_norm, c.norm_epsilon), self.lm_head, matvec())
        positions = torch.cat([self._positions(span) for span in spans], dim=-1)
        x = self.embed(torch.tensor(ids, dtype=torch.long))
        x = x * c.embedding_multiplier if c.embedding_multiplier != 1.0 else x
        if any(span.seq.media for span in spans):
            _place_media(x, spans, media or {})
        ropes = [rope.rows(positions) for rope in (self.rope, self.local_rope) if rope]  # global, then local
        mv = matvec() if self.native_kernels and len(ids) <= MATVEC_MAX_TOKENS else None
        ctx = StepContext(spans, torch.cat([cache.slots(s.seq, s.start_pos, s.end) for s in spans]),
                          [cache.block_table(s.seq) for s in spans], cache.storage, self.native_kernels, mv)
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer["input_norm"], c.norm_epsilon)
            rope = (ropes[-1] if c.layer_window(index) is not None else ropes[0]) if c.layer_rotates(index) else None
            attn = self._attention(index, layer, h, rope, ctx)
            if c.inter_layernorms:  # Gemma: post_layernorm normalizes the attention output, two more the MLP's
                x = x + rms_norm(attn, layer["post_norm"], c.norm_epsilon)
                h = rms_norm(x, layer["pre_ff_norm"], c.norm_epsilon)
            else:
                x = x + attn
                h = rms_norm(x, layer["post_norm"], c.norm_epsilon)
            fc, gate = _linear(h, layer["fc_gate"], mv).chunk(2, dim=-1)
            mlp = _linear(self._act(fc) * gate, layer["proj"], mv)
            x = x + (rms_norm(mlp, layer["post_ff_norm"], c.norm_epsilon) if c.inter_layernorms else mlp)
        if not all_logits:
            x = x[torch.tensor([span.end - span.start_pos for span in spans]).cumsum(0) - 1]
        h = rms_norm(x, self.final_norm, c.norm_epsilon)  # one row per span, or per token
        logits = _linear(h, self.lm_head, matvec() if self.native_kernels and len(h) <= MATVEC_MAX_TOKENS else None)
        cap = c.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _positions(self, span: Span) -> torch.Tensor:
        """The RoPE positions of a span's tokens: (N,), or M-RoPE's (3, N) where the model has it."""
        if self.rope.mrope_section is None:
            return torch.arange(span.start_pos, span.end)
        return mrope_positions(span.start_pos, span.end, span.seq.media)


    def _fused_step(self, spans: list[Span], cache: PagedKVCache) -> torch.Tensor | None:
        """One token of each span's sequence through every layer in one native call (runtime/kernels/decode_step.c):
        their last hidden states (spans, hidden), or None where the cache's storage, the weights or the compiler do
        not allow it."""
        c, pools = self.config, cache.storage.static_pools()
        kernel = None if pools is None else decode_step(pools.k.dtype, c.head_size,
                                                        c.num_attention_heads // c.num_key_value_heads)
        if kernel is None or self._step_weights is None:
            return None
        positions = [span.start_pos + (mrope_offset(span.start_pos, span.seq.media)
                                       if self.rope.mrope_section is not None else 0) for span in spans]
        cos, sin = self.rope.rows(torch.tensor(positions))
        ids = torch.tensor([span.token_ids[0] for span in spans])
        return kernel(self._step_weights, self.embed(ids), c.norm_epsilon, cos, sin, pools,
                      [cache.block_table(span.seq) for span in spans],
                      [int(cache.slots(span.seq, span.start_pos, span.end)) for span in spans],
                      [span.end for span in spans])

    @functools.cached_property
    def _step_weights(self) -> StepWeights | None:
        """The layers as the fused decode step reads them; None where an op has no form it runs or the model is more
        than Llama plus q/k norms, partial rotary and another activation (the step knows no extra norms, scales,
        windows or layers without RoPE)."""
        c = self.config
        if (c.inter_layernorms or c.sliding_window is not None or c.embedding_multiplier != 1.0
                or self.query_scale != 1.0 or c.final_logit_softcapping is not None or c.nope_layers):
            return None
        layers = []
        for layer in self.layers:
            fc, gate = halves(layer["fc_gate"])
            ops = dict(qkv=kernel_linear(layer["qkv"], layer.get("qkv_bias")), dense=kernel_linear(layer["dense"]),
                       fc=kernel_linear(fc), gate=kernel_linear(gate), proj=kernel_linear(layer["proj"]))
            if any(op is None for op in ops.values()):
                return None
            norms = {k: layer[k].contiguous() for k in ("q_norm", "k_norm") if k in layer}
            layers.append(KernelLayer(layer["input_norm"].contiguous(), layer["post_norm"].contiguous(), **ops,
                                      **norms))
        return StepWeights(layers, c.hidden_act)

    def _attention(self, index: int, layer: dict, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                   ctx: StepContext) -> torch.Tensor:
        """One layer's attention of the step's tokens (q and k turned by ``rope``'s cos/sin rows unless None)."""
        c = self.config
        n, heads, kv_heads, d = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_size
        qkv = _linear(h, layer["qkv"], ctx.matvec, layer.get("qkv_bias"))
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k = q.reshape(n, heads, d), k.reshape(n, kv_heads, d)
        if c.qk_layernorm:
            q, k = rms_norm(q, layer["q_norm"], c.norm_epsilon), rms_norm(k, layer["k_norm"], c.norm_epsilon)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        ctx.storage.write(index, ctx.slots, k, v.reshape(n, kv_heads, d))
        q = q * self.query_scale if self.query_scale != 1.0 else q
        outs, first, window = [], 0, c.layer_window(index)
        for span, block_table in zip(ctx.spans, ctx.block_tables):
            count = len(span.token_ids)
            outs.append(self._span_attention(index, q[first:first + count], span, block_table, ctx, window))
            first += count
        return _linear(outs[0] if len(outs) == 1 else torch.cat(outs), layer["dense"], ctx.matvec)

    def _span_attention(self, index: int, q: torch.Tensor, span: Span, block_table: torch.Tensor,
                        ctx: StepContext, window: int | None) -> torch.Tensor:
        """One span's queries (n, heads, d) over its sequence's cached K/V (the last ``window`` positions of each
        query where the layer has one); returns (n, heads * d)."""
        heads, d = q.shape[1], q.shape[2]
        if window is not None and span.end > window:
            return self._window_attention(index, q, span, block_table, ctx, window)
        stored = ctx.storage.stored_kv(index, block_table, span.end) if ctx.native and q.shape[0] == 1 else None
        group = heads // self.config.num_key_value_heads
        kernel = None if stored is None else decode_attention(stored.k.dtype, d, group)
        if kernel is not None:
            return kernel(q[0], stored, span.end)
        keys, values, k_scale, v_scale = ctx.storage.read_unscaled(index, block_table, span.end)
        out = grouped_attention(q * k_scale if k_scale != 1.0 else q, keys, values, span.start_pos)
        return out * v_scale if v_scale != 1.0 else out

    def _window_attention(self, index: int, q: torch.Tensor, span: Span, block_table: torch.Tensor,
                          ctx: StepContext, window: int) -> torch.Tensor:
        """Attention of a local layer: each query at position p over positions (p - window, p], read from the
        blocks that hold the span's first query's window on (a decoded token's on the native kernel)."""
        tpb = ctx.storage.tokens_per_block
        first_block = max(0, span.start_pos - window + 1) // tpb
        table, held = block_table[first_block:], span.end - first_block * tpb
        if ctx.native and q.shape[0] == 1:
            stored = ctx.storage.stored_kv(index, table, held)
            kernel = decode_attention(stored.k.dtype, q.shape[2], self.config.num_attention_heads //
                                      self.config.num_key_value_heads)
            if kernel is not None:
                return kernel(q[0], stored, held, span.end - window - first_block * tpb)
        keys, values, k_scale, v_scale = ctx.storage.read_unscaled(index, table, held)
        out = grouped_attention(q * k_scale if k_scale != 1.0 else q, keys, values, span.start_pos,
                                key_start=first_block * tpb, window=window)
        return out * v_scale if v_scale != 1.0 else out


def begin_step(model: ModelRunner, spans: list[Span], cache: PagedKVCache, all_logits: bool,
               media: MediaTable | None) -> torch.Tensor | None:
    """What every runner's step does first: ConfigError for a span past the model's context; where a span is longer
    than the cache's storage takes in one step (a storage that holds only what the next positions read, e.g.
    sliding-window layers' pool), ``model.step``'s logits with each span run in pieces of at most that; else None,
    each span's storage prepared."""
    context = model.config.max_position_embeddings
    for span in spans:
        if span.end > context:
            raise ConfigError(f"position {span.end} exceeds the model's context of {context} tokens")
    limit = cache.storage.step_tokens
    if limit is None or all(len(span.token_ids) <= limit for span in spans):
        for span in spans:
            cache.storage.prepare(span.seq, span.start_pos, span.end)
        return None
    outs = []
    for span in spans:
        ids = span.token_ids
        logits = [model.step([Span(ids[i:i + limit], span.start_pos + i, span.seq)], cache, all_logits, media)
                  for i in range(0, len(ids), limit)]
        outs.append(torch.cat(logits) if all_logits else logits[-1])
    return torch.cat(outs)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int,
                      key_start: int = 0, window: int | None = None) -> torch.Tensor:
    """Causal attention of q (n, heads, d) at positions [start_pos, start_pos + n) over keys/values
    (context, kv_heads, d) of positions [key_start, key_start + context), each query over the last ``window``
    positions only when given; returns (n, heads * d).

    Decode (n == 1) folds each KV group's query heads into rows of one call, so K/V are never
    repeated; prefill repeats K/V per query head and uses the fused causal kernel.
    """
    n, heads, d = q.shape
    context, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    if window is not None:
        key_pos = torch.arange(key_start, key_start + context)[None, :]
        query_pos = torch.arange(start_pos, start_pos + n)[:, None]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask)
        return out[0].transpose(0, 1).reshape(n, heads * d)
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
    """One layer's norms and linear ops in the checkpoint's weight format (runtime.formats.weight_formats); fc and
    gate stacked in one op."""
    p, fmt = layer_prefix(layer), config.weight_format

    def op(name: str) -> Linear:
        return linear_op(fmt, {s: w.pop(f"{p}.{name}.{s}") for s in fmt.tensors}, config.quantization)

    norms = {"q_norm": "attention.q_layernorm", "k_norm": "attention.k_layernorm",
             "pre_ff_norm": "pre_feedforward_layernorm", "post_ff_norm": "post_feedforward_layernorm"}
    out = {key: w[f"{p}.{name}.weight"].float() for key, name in norms.items() if f"{p}.{name}.weight" in w}
    out |= {
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


def _head_tables(w: dict[str, torch.Tensor], config: ModelConfig,
                 native: bool) -> tuple[torch.Tensor | Int8G32Table, Linear]:
    """The embedding table and the output projection: an int8 head (quantization ``head``) as int8 tables, the
    two shared when the model ties them; else the embedding in fp32 and the lm_head as the decode kernels read it
    fastest: an fp16 one stays fp16 (half the bytes of the largest matrix of a small model; fp32 copy on the torch
    path only). An int8 head computes on int8 activations where the weight format does (int4-g32-a8)."""
    if head_format(config.quantization).name == "int8":
        int8_x = config.weight_format.int8_activations
        tables = [Int8G32Table(w.pop(f"{name}.weight").contiguous(), w.pop(f"{name}.{SCALE}").contiguous(), int8_x)
                  for name in HEAD_TENSORS]
        tied = all(torch.equal(a, b) for a, b in zip((tables[0].codes, tables[0].scale),
                                                    (tables[1].codes, tables[1].scale)))
        return tables[0], tables[0] if tied else tables[1]
    weight = w.pop("lm_head.weight")
    keep = native and weight.dtype == torch.float16
    return w["transformer.vocab_embedding.weight"].float(), weight.contiguous() if keep else weight.float().contiguous()


def _place_media(x: torch.Tensor, spans: list[Span], media: MediaTable) -> None:
    """Write the rows of each picture the spans' new tokens hold into the input rows ``x`` (tokens, hidden)."""
    first = 0
    for span in spans:
        for place in span.seq.media:
            lo, hi = max(place.start, span.start_pos), min(place.end, span.end)
            if lo >= hi:
                continue
            if place.digest not in media:
                raise ConfigError(f"the tokens at [{place.start}, {place.end}) are image {place.digest.hex()[:12]}'s, "
                                  "and no feature rows of it were given; encode the image first")
            image = media[place.digest]
            at = image.offsets + place.start
            held = (at >= lo) & (at < hi)
            x[first + at[held] - span.start_pos] = image.rows[held].to(x.dtype)
        first += len(span.token_ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x times ``weight`` (a family's offset is already in the weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
