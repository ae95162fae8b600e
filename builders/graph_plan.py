"""The cabin-export arguments for an ONNX target: the KV window (``--context``) and prompt-graph size (``--chunk``)
that fit its memory, and what they take.

For a window of ``context`` tokens and a prompt graph of ``chunk`` tokens the planner counts, in the KV dtype's
bytes per token (1 per element for int8, 2 for fp16): the two graphs' KV inputs (each its own window) and
outputs (the new rows), the runtime's host copy of the window, its paged cache holding the dialogue (the
window's tokens, in whole blocks), and the prompt and token graphs' activations. The chunk is the target's
``default_chunk`` (halved until something fits); the context is the largest multiple of the cache's block size,
up to the model's context, that fits the memory left after the weights, and, where the target bounds what the NPU
holds (``graph_memory_gib``), whose QNN context of both graphs stays under that bound: one copy of the weights for
both (cabin-export compiles them into one context, QNN storing the weights they share once; fp16 floats, W8A16
linear layers in int8 with their scales), both graphs' KV inputs and outputs and their activations.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from cabinllm.builders.memory_model import activation_bytes, kv_bytes_per_token, weights_bytes
from cabinllm.builders.targets import GIB, Backend, Target
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.kv.blocks import cdiv

ENGINE_PLACEHOLDER = "ENGINE_DIR"  # the engine folder cabin-build wrote, when the plan does not know it
GRAPHS_PLACEHOLDER = "GRAPHS_DIR"
_WINDOW_COPIES = 4  # each window token's K/V: in both graphs' inputs, the host window and the paged cache


@dataclass(frozen=True)
class GraphPlan:
    """cabin-export's graphs for one KV dtype on an ONNX target, and the memory they and the runtime take."""

    context: int  # --context: the KV window, the longest dialogue the graphs hold
    chunk: int  # --chunk: tokens of the prompt graph
    kv_cache: str  # --kv-cache
    profile: str  # --profile
    precision: str  # --precision
    htp_arch: int  # --htp-arch
    provider: str  # cabin-chat --ort-provider
    kv_io_bytes: int  # the two graphs' KV inputs (a window each) and outputs (the new rows)
    window_bytes: int  # the runtime's host copy of the window
    cache_bytes: int  # the runtime's paged cache holding the dialogue in host memory (cabin-chat --kv-budget-mb)
    activation_bytes: int  # the prompt and token graphs' activations
    npu_graph_bytes: int | None  # both graphs' one QNN context on an NPU that computes float graphs: one copy of
    # the weights, both graphs' KV inputs and outputs and activations (None: the NPU computes no float graphs)

    @property
    def total_bytes(self) -> int:
        """Everything the graphs and the runtime take beside the weights."""
        return self.kv_io_bytes + self.window_bytes + self.cache_bytes + self.activation_bytes

    def export_args(self, engine: str = ENGINE_PLACEHOLDER, output: str = GRAPHS_PLACEHOLDER) -> list[str]:
        """The cabin-export arguments of this plan."""
        return ["--engine", engine, "--format", "onnx", "--output", output, "--context", str(self.context),
                "--chunk", str(self.chunk), "--kv-cache", self.kv_cache, "--profile", self.profile,
                "--precision", self.precision, "--htp-arch", str(self.htp_arch)]

    def export_command(self, engine: str = ENGINE_PLACEHOLDER, output: str = GRAPHS_PLACEHOLDER) -> str:
        """The cabin-export command line."""
        return shlex.join(["cabin-export", *self.export_args(engine, output)])

    def chat_command(self, graphs: str = GRAPHS_PLACEHOLDER) -> str:
        """The cabin-chat command line that runs the graphs with this plan's cache budget."""
        budget_mib = cdiv(self.cache_bytes, 1 << 20)
        return shlex.join(["cabin-chat", "--engine", graphs, "--backend", "onnxruntime", "--ort-provider",
                           self.provider, "--kv-cache", self.kv_cache, "--kv-budget-mb", str(budget_mib)])

    def to_dict(self) -> dict:
        """JSON-ready form, with the command lines."""
        return {"context": self.context, "chunk": self.chunk, "kv_cache": self.kv_cache, "profile": self.profile,
                "precision": self.precision, "htp_arch": self.htp_arch,
                "ort_provider": self.provider, "kv_io_bytes": self.kv_io_bytes, "window_bytes": self.window_bytes,
                "host_cache_bytes": self.cache_bytes, "activation_bytes": self.activation_bytes,
                "npu_graph_bytes": self.npu_graph_bytes, "args": self.export_args(),
                "command": self.export_command(), "chat_command": self.chat_command()}


def graph_plan(config: ModelConfig, target: Target, kv_dtype: str, context: int, chunk: int,
               weights: str = "fp16") -> GraphPlan:
    """What graphs of this window and chunk, over ``weights`` (a weight format), take on the target."""
    tpb = target.tokens_per_block
    # the graphs pass K/V in the cache's element type, every layer's over the whole window
    per_token = kv_bytes_per_token(config, kv_dtype, tpb, windowed=False)
    kv_io = ((_WINDOW_COPIES - 2) * context + chunk + 1) * per_token
    activations = activation_bytes(config, chunk, context, 1, Backend.ONNX) + activation_bytes(config, 1, context, 1,
                                                                                                Backend.ONNX)
    return GraphPlan(
        context=context, chunk=chunk, kv_cache=kv_dtype, profile=target.npu.onnx_profile,
        precision=target.npu.precision_for(kv_dtype), htp_arch=target.npu.htp_arch, provider=target.npu.ort_provider,
        kv_io_bytes=kv_io, window_bytes=context * per_token, cache_bytes=cdiv(context, tpb) * tpb * per_token,
        activation_bytes=activations,
        npu_graph_bytes=npu_weight_bytes(config, weights) + kv_io + activations if target.npu.float16 else None)


def tokens_held(plan: GraphPlan, budget: int, per_token: int) -> int:
    """Window tokens ``budget`` bytes could hold at the plan's chunk and activations (each kept in every copy)."""
    return max(budget - plan.activation_bytes - (plan.chunk + 1) * per_token, 0) // (_WINDOW_COPIES * per_token)


def graph_limit(target: Target) -> int | None:
    """The bytes the graphs' QNN context may hold on the target's NPU, where it computes float graphs and the profile
    bounds them."""
    npu = target.npu
    return int(npu.graph_memory_gib * GIB) if npu.float16 and npu.graph_memory_gib else None


def npu_weight_bytes(config: ModelConfig, weights: str = "fp16") -> int:
    """The weights as an NPU that computes float graphs holds them, one copy for both graphs (their one QNN context
    stores the weights they share once): float tensors in fp16, W8A16 linear layers as their int8 tensors and
    scales."""
    return weights_bytes(config, weights)


def size_graphs(config: ModelConfig, target: Target, kv_dtype: str, budget: int,
                weights: str = "fp16") -> GraphPlan | None:
    """The largest window with the largest chunk (the target's default, halved as needed) that fits ``budget``
    bytes and the target's bound on one graph over ``weights``; None when not even a window of one chunk fits."""
    tpb, model_context, limit = target.tokens_per_block, config.max_position_embeddings, graph_limit(target)

    def fits(plan: GraphPlan) -> bool:
        return plan.total_bytes <= budget and (limit is None or plan.npu_graph_bytes <= limit)

    chunk = min(target.npu.default_chunk, model_context)
    while chunk >= 1:
        low, high = cdiv(chunk, tpb), model_context // tpb  # windows in whole blocks, at least one chunk
        if low <= high and fits(graph_plan(config, target, kv_dtype, low * tpb, chunk, weights)):
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if fits(graph_plan(config, target, kv_dtype, middle * tpb, chunk, weights)) \
                    else (low, middle - 1)
            return graph_plan(config, target, kv_dtype, low * tpb, chunk, weights)
        chunk //= 2
    return None
