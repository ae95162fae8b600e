"""The CUDA runner: the reference decoder's math on a GPU, torch ops for linears, norms and RoPE, the Triton kernels
(``cabinllm.runtime.kernels.triton``) for the KV write and attention over the paged cache, whose pools live on the
device (``PagedKVCache(device=...)``).

It is built from a loaded reference ``Transformer`` (``CudaRunner.of``), so every family the reference reads runs
here the same way (q/k norms, partial rotary and LongRoPE, Gemma 3's extra norms, scales and local layers' windows,
layers without RoPE, softcapped logits): weights go to the device in fp16 or bf16, int8 ones (W8A16) as their codes
and per-channel scales, 4-bit ones (int4-g32, W4A16-AWQ) as their packed codes, both multiplied by Triton kernels
that dequantize inside the product (a 3B model in 4 bits is what fits an 8 GB Orin). The residual stream and norms
compute in fp32, linears and attention's operands in the compute dtype. Pictures (a vision-language model's media)
run on the reference engine only.

Decode steps (one token per sequence) can run as CUDA graphs, one per batch size bucket (``cabinllm.runtime.model.
cuda_graphs``): on a GPU only, and with the step's inputs padded to the bucket. The same code runs on CPU tensors
with the kernels under Triton's interpreter, which is how it is tested without a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import ModuleType

import torch
import torch.nn.functional as F

from cabinllm.runtime.errors import ConfigError, Fix, Hint
from cabinllm.runtime.kernels import triton as triton_kernels
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.cuda_graphs import DecodeGraphs, StepInputs
from cabinllm.runtime.model.interface import MediaTable, Span
from cabinllm.runtime.model.linear import (Int4AwqLinear, Int4G32Linear, Int8G32Table, Int8Linear, Linear, Stacked,
                                          full_precision, int8_blocks)
from cabinllm.runtime.model.rope import apply_rope
from cabinllm.runtime.model.transformer import ACTIVATIONS, Transformer, begin_step, rms_norm

DEVICES = ("cpu", "cuda")  # where Engine.load runs a model: the reference engine, the CUDA runner
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
CUDA_KV_MODES = ("fp16", "int8", "int8-separate", "int8-dynamic", "fp8", "fp32")  # what the Triton kernels store


def quant_linear() -> ModuleType:
    """The Triton kernels of linears on quantized weights (``kernels/triton/quant_linear``)."""
    return triton_kernels.load(triton_kernels.LINEAR_MODULE)


def check_device(device: str) -> torch.device:
    """``device`` as torch's; ConfigError where it names CUDA and torch has none (a CPU build, no driver or GPU)."""
    where = torch.device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU or driver"
        raise ConfigError(f"device {device} needs a CUDA GPU, and this torch {torch.__version__} has {build}; "
                          "install torch with CUDA on a machine with an NVIDIA GPU", (Hint(Fix.DEVICE, "cpu"),))
    if where.type not in ("cuda", "cpu"):
        raise ConfigError(f"device {device} is not one the CUDA runner takes; choose cuda or cpu")
    return where


def check_kv_mode(mode_name: str, device: torch.device) -> None:
    """ConfigError unless the CUDA runner stores ``mode_name`` on ``device`` (fp8 refused below sm_89)."""
    if (mode_name == "fp8" and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < triton_kernels.FP8_CAPABILITY):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"fp8 KV needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); this one "
                          f"is {major}.{minor}, and int8 KV takes the same bytes", (Hint(Fix.KV_MODE, "int8"),))
    if mode_name not in CUDA_KV_MODES:
        raise ConfigError(f"KV mode {mode_name} runs on the reference engine only; the CUDA runner stores "
                          f"{', '.join(CUDA_KV_MODES)}", (Hint(Fix.KV_MODE, "int8"),))


@dataclass
class DeviceLinear:
    """A linear op on the device, as stored: a dense (out, in) weight in the compute dtype; W8A16's int8 codes with
    one fp32 scale per output channel, or 4-bit codes (int4-g32, W4A16-AWQ), both multiplied by the Triton kernels
    of ``kernels/triton/quant_linear``, which dequantize inside the product. A stacked op (``parts``) concatenates
    its parts' outputs."""

    weight: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    int4: Linear | None = None  # the reference's Int4G32Linear / Int4AwqLinear with its tensors on the device
    parts: tuple["DeviceLinear", ...] = ()

    @classmethod
    def of(cls, op: Linear, device: torch.device, dtype: torch.dtype,
           bias: torch.Tensor | None = None) -> "DeviceLinear":
        """The reference's op (``cabinllm.runtime.model.linear``) on ``device``."""
        bias = None if bias is None else bias.to(device, dtype)
        if isinstance(op, Int8Linear):
            return cls(op.weight.to(device), op.scale.to(device, torch.float32), bias)
        if isinstance(op, (Int4G32Linear, Int4AwqLinear)):
            moved = {f.name: getattr(op, f.name) for f in fields(op)}
            moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
            if isinstance(op, Int4AwqLinear):
                moved["prequant"] = moved["prequant"].to(dtype)
            return cls(bias=bias, int4=type(op)(**moved))
        if isinstance(op, Stacked):
            return cls(bias=bias, parts=tuple(cls.of(part, device, dtype) for part in op.parts))
        return cls(full_precision(op).to(device, dtype).contiguous(), None, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts:
            y = torch.cat([part(x) for part in self.parts], dim=-1)
        elif isinstance(self.int4, Int4G32Linear):
            q = self.int4
            y = quant_linear().int4_g32_linear(int8_blocks(x).to(x.dtype) if q.int8_x else x, q.codes, q.scale,
                                              q.minimum)
        elif isinstance(self.int4, Int4AwqLinear):
            q = self.int4
            y = quant_linear().int4_awq_linear(x * q.prequant, q.packed, q.scale, q.group_size)
        elif self.scale is None:
            return F.linear(x, self.weight, self.bias)
        else:
            y = quant_linear().int8_linear(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        """Bytes the op holds on the device."""
        held = [self.weight, self.scale, self.bias]
        if self.int4 is not None:
            held += [getattr(self.int4, f.name) for f in fields(self.int4)]
        own = sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))
        return own + sum(part.nbytes() for part in self.parts)


class CudaRunner:
    """A ``ModelRunner`` on a GPU (or, with the kernels interpreted, on CPU tensors)."""

    batched = True

    def __init__(self, reference: Transformer, device: torch.device | str = "cuda",
                 dtype: torch.dtype = torch.float16, graphs: bool = True, kernels: ModuleType | None = None) -> None:
        """The reference's weights moved to ``device`` in ``dtype``; ``graphs``: capture decode steps as CUDA graphs
        (only where ``device`` is a GPU)."""
        c = self.config = reference.config
        self.device, self.dtype = torch.device(device), dtype
        self.kernels = kernels or triton_kernels.load()
        embedding = reference.embedding
        table = embedding.dequantize() if isinstance(embedding, Int8G32Table) else embedding
        self.embedding = table.to(self.device, dtype)
        head = full_precision(reference.lm_head)
        self.lm_head = self.embedding if head.shape == table.shape and torch.equal(head, table.float()) else \
            head.to(self.device, dtype)
        self.final_norm = reference.final_norm.to(self.device, torch.float32)
        self.layers = [self._layer(layer) for layer in reference.layers]
        self.rope = reference.rope.to(self.device)
        self.local_rope = None if reference.local_rope is None else reference.local_rope.to(self.device)
        self.query_scale = reference.query_scale
        self.sm_scale = 1.0 / math.sqrt(c.head_size)
        self._act = ACTIVATIONS[c.hidden_act]
        self.graphs = DecodeGraphs(self) if graphs and self.device.type == "cuda" else None

    @classmethod
    def of(cls, reference: Transformer, device: str = "cuda", dtype: str = "float16",
           graphs: bool = True) -> "CudaRunner":
        """The runner of a loaded reference model, the device and dtype checked first."""
        return cls(reference, check_device(device), DTYPES[dtype], graphs)

    def _layer(self, layer: dict) -> dict:
        """One reference layer's ops and norms on the device."""
        out = {key: value.to(self.device, torch.float32) for key, value in layer.items()
               if key.endswith("norm")}
        out["qkv"] = DeviceLinear.of(layer["qkv"], self.device, self.dtype, layer.get("qkv_bias"))
        out |= {key: DeviceLinear.of(layer[key], self.device, self.dtype) for key in ("dense", "fc_gate", "proj")}
        return out

    def size_graphs(self, max_batch: int) -> None:
        """Capture decode steps of up to ``max_batch`` sequences (a server's sessions), where graphs are on."""
        if self.graphs is not None and self.graphs.sizes[-1] != max_batch:
            self.graphs = DecodeGraphs(self, max_batch)

    @property
    def kv_layout(self) -> KVLayout:
        """Shape of this model's KV cache."""
        return KVLayout.of(self.config)

    def weight_bytes(self) -> int:
        """Bytes of the weights on the device (a tied head counted once)."""
        tensors = [self.embedding, self.final_norm] + ([] if self.lm_head is self.embedding else [self.lm_head])
        total = sum(t.numel() * t.element_size() for t in tensors)
        for layer in self.layers:
            total += sum(op.nbytes() if isinstance(op, DeviceLinear) else op.numel() * op.element_size()
                         for op in layer.values())
        return total

    # -- the ModelRunner face --------------------------------------------------------------------------------------
    def forward(self, token_ids: list[int], start_pos: int, cache: PagedKVCache, seq: Sequence,
                all_logits: bool = False, media: MediaTable | None = None) -> torch.Tensor:
        """``step`` of one span: logits of its last token (vocab,) or of every token (N, vocab)."""
        logits = self.step([Span(token_ids, start_pos, seq)], cache, all_logits, media)
        return logits if all_logits else logits[0]

    @torch.inference_mode()
    def step(self, spans: list[Span], cache: PagedKVCache, all_logits: bool = False,
             media: MediaTable | None = None) -> torch.Tensor:
        """Run the spans' new tokens (slots allocated), writing their K/V into the cache on the device; fp32 logits
        of each span's last token (spans, vocab), or of every token (tokens, vocab), on the host (where the engine
        core samples)."""
        return self._step(spans, cache, all_logits, media).cpu()

    def _step(self, spans: list[Span], cache: PagedKVCache, all_logits: bool,
              media: MediaTable | None) -> torch.Tensor:
        if any(span.seq.media for span in spans):
            raise ConfigError("pictures run on the reference engine only; the CUDA runner reads text",
                              (Hint(Fix.DEVICE, "cpu"),))
        if cache.device.type != self.device.type:
            raise ConfigError(f"the KV cache lives on {cache.device} and the model on {self.device}; make the cache "
                              "with Engine.new_cache")
        pieces = begin_step(self, spans, cache, all_logits, media)
        if pieces is not None:
            return pieces
        if all(len(span.token_ids) == 1 for span in spans) and not all_logits:
            if self.graphs is not None:
                logits = self.graphs.run(spans, cache)
                if logits is not None:
                    return logits
            return self.decode(StepInputs.of(spans, cache, self.device))
        return self._prefill(spans, cache, all_logits)

    # -- the forward pass ---------------------------------------------------------------------------------------
    def decode(self, inputs: StepInputs) -> torch.Tensor:
        """Logits (rows, vocab) of one token per row of ``inputs`` (padded rows give finite logits nobody reads):
        the part of a decode step a CUDA graph captures, so it reads no host value."""
        hidden = self._layers(inputs.ids, inputs.positions, inputs, decode=True)
        return self._logits(hidden)

    def _prefill(self, spans: list[Span], cache: PagedKVCache, all_logits: bool) -> torch.Tensor:
        inputs = StepInputs.of(spans, cache, self.device)
        hidden = self._layers(inputs.ids, inputs.positions, inputs, decode=False)
        if not all_logits:
            hidden = hidden[torch.tensor([len(s.token_ids) for s in spans], device=self.device).cumsum(0) - 1]
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = rms_norm(hidden, self.final_norm, c.norm_epsilon).to(self.dtype)
        logits = F.linear(h, self.lm_head).float()
        cap = c.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, inputs: StepInputs, decode: bool) -> torch.Tensor:
        """The hidden states (tokens, hidden) in fp32 after every layer, K/V written on the way."""
        c = self.config
        x = self.embedding[ids].float()
        x = x * c.embedding_multiplier if c.embedding_multiplier != 1.0 else x
        ropes = [rope.rows(positions) for rope in (self.rope, self.local_rope) if rope]  # global, then local
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer["input_norm"], c.norm_epsilon)
            rope = (ropes[-1] if c.layer_window(index) is not None else ropes[0]) if c.layer_rotates(index) else None
            attn = self._attention(index, layer, h, rope, inputs, decode)
            if c.inter_layernorms:
                x = x + rms_norm(attn.float(), layer["post_norm"], c.norm_epsilon)
                h = rms_norm(x, layer["pre_ff_norm"], c.norm_epsilon)
            else:
                x = x + attn.float()
                h = rms_norm(x, layer["post_norm"], c.norm_epsilon)
            fc, gate = layer["fc_gate"](h.to(self.dtype)).chunk(2, dim=-1)
            mlp = layer["proj"](self._act(fc) * gate).float()
            x = x + (rms_norm(mlp, layer["post_ff_norm"], c.norm_epsilon) if c.inter_layernorms else mlp)
        return x

    def _attention(self, index: int, layer: dict, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                   inputs: StepInputs, decode: bool) -> torch.Tensor:
        c = self.config
        n, heads, kv_heads, d = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_size
        qkv = layer["qkv"](h.to(self.dtype))
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, k, v = q.reshape(n, heads, d), k.reshape(n, kv_heads, d), v.reshape(n, kv_heads, d)
        if c.qk_layernorm:
            q = rms_norm(q.float(), layer["q_norm"], c.norm_epsilon)
            k = rms_norm(k.float(), layer["k_norm"], c.norm_epsilon)
        if rope is not None:
            q, k = apply_rope(q.float(), *rope), apply_rope(k.float(), *rope)
        q = q * self.query_scale if self.query_scale != 1.0 else q
        q, k = q.to(self.dtype).contiguous(), k.to(self.dtype).contiguous()
        view = inputs.views[inputs.layer_view[index]]
        pools = inputs.pools[index]
        self.kernels.write_kv(k, v.contiguous(), view.slots, pools)
        window = c.layer_window(index) or 0
        if decode:
            out = self.kernels.decode_attention(q, pools, view.tables, view.lens, self.sm_scale, window,
                                                splits=inputs.splits)
        else:
            out = self.kernels.prefill_attention(q, pools, view.tables, inputs.q_lens, view.ctx_lens, self.sm_scale,
                                                 window)
        return layer["dense"](out.reshape(n, heads * d))

