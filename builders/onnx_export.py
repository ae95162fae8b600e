"""Export an engine to two static-shape ONNX graphs (prompt of ``chunk`` tokens, token of 1) over a fixed KV
window, for NPU toolchains and ONNX Runtime (the folder format is cabinllm.runtime.formats.onnx_folder's).

The graphs are written node by node with ``onnx.helper`` from the reference engine's weights (fp32), so every
shape is static and every op is a chosen standard one: RMSNorm as Pow/ReduceMean/Sqrt/Div (one
RMSNormalization in graphs to be quantized), RoPE as cos/sin rows (gathered by ``position_ids`` in the ort
profile, fed by the host in the npu one, which gathers nothing by an input) + rotate-half, grouped-query attention as 5-D MatMuls over the window and over the new
tokens apart (no K/V repeated, the window never copied), SiLU as
Sigmoid * x. The families beyond Llama take the same ops: q/k norms (Qwen3, Gemma 3) as RMSNorm of each head,
partial rotary (Phi-3) as RoPE of a Slice of each head, Gemma 3's tanh-GELU and logit softcap through Sigmoid
(0.5 * (1 + tanh(z)) = Sigmoid(2z)), layers without RoPE (SmolLM3's) as no rotation, and Gemma 3's local
layers' window as a mask (from ``position_ids`` in the ort
profile, a host input in the npu one) (LongRoPE needs nothing more: its cos/sin rows are per position). INT8 KV
is QDQ with the engine's calibrated static scale of each layer (one for K and V, as
TensorRT-LLM stores it): the past window comes in as codes and is dequantized; the new tokens' K/V are
clamped to +-127 steps, quantized (the graph's outputs) and dequantized again for their own attention, so
the graph sees exactly what the paged cache stores. Linear layers keep the engine's weight format where the
profile can carry it (cabinllm.builders.onnx_profiles: int8 as per-channel QDQ, int4-AWQ as MatMulNBits); the values are
the reference engine's, so the graphs compute what it computes. Both graphs read one ``weights.bin`` (external
data). A16W8 graphs are these float graphs quantized by cabinllm.builders.qnn_quantize; ``--htp-arch`` compiles
them into QNN context binaries (cabinllm.runtime.backends.qnn).
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from cabinllm.builders.onnx_profiles import (HEAD_FORMS, PRECISIONS, WEIGHT_FORMS, OnnxProfile, Precision,
                                             onnx_profile, precision)
from cabinllm.builders.progress import Steps
from cabinllm.builders.qnn_precision import PrecisionPlan
from cabinllm.builders.qnn_quantize import CalibrationData, quantize_graphs
from cabinllm.runtime.backends.qnn import check_htp_arch, compile_context_binaries, qnn_versions
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import CheckpointError, ConfigError
from cabinllm.runtime.formats.atomic import atomic_write_text, staging_folder
from cabinllm.runtime.formats.engine_folder import (CHECKPOINT_DIR, MANIFEST_FILE, SCALES_FILE, EngineFolder,
                                                    read_manifest)
from cabinllm.runtime.formats.onnx_folder import (HOST_DIR, INPUTS_EMBEDS, LOCAL_MASK, LOCAL_ROPE_INPUTS, MASKED,
                                                  ONNX_FORMAT, PREFIX_TABLES, PROMPT_GRAPH, QUANTIZED_MASKED, ROPE_INPUTS,
                                                  TOKEN_GRAPH, TOKENIZER_DIR, WEIGHTS_FILE, KvGraphType, OnnxFolder,
                                                  graph_metadata, new_key, new_value, past_key, past_value)
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.formats.weight_formats import GGUF_GROUP, head_format
from cabinllm.runtime.kv.modes import ONNX_KV_MODES, kv_mode
from cabinllm.runtime.kv.quant import INT8_MAX
from cabinllm.runtime.model.linear import (Int4AwqLinear, Int4G32Linear, Int8G32Table, Int8Linear, Linear, Stacked,
                                           unpack_g32, unpack_int4)
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.model.audio import AUDIO_FOLDER
from cabinllm.runtime.model.vision import VISION_FOLDER
from cabinllm.runtime.sources.tokenizer_export import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

Log = Callable[[str], None]
_EXTERNAL_MIN_BYTES = 1024  # tensors at least this large go to weights.bin; small constants stay in the graph
_ALIGN = 64
CONTRIB_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (MatMulNBits)
REDUCE_AXES_INPUT_OPSET = 18  # ReduceMean takes its axes as an input from here
INT4_ZERO_POINT = 8  # MatMulNBits' default zero point: the signed int4 code q travels as q + 8
INT8_ZERO_POINT = 128  # its 8-bit default: the int8 head's code q travels as q + 128


@dataclass(frozen=True)
class OnnxExportRequest:
    """What to export: the engine folder, the output folder, the fixed window and chunk, the KV mode, the profile,
    the precision (None: the profile's default), the HTP architecture to compile for (None: no context binaries),
    the calibration dialogues of a quantized precision and the weights it stores in 16 bits."""

    engine: Path
    output: Path
    context: int
    chunk: int
    kv_cache: str = "int8"
    profile: str = "npu"
    precision: str | None = None
    htp_arch: int | None = None
    calibration: CalibrationData = CalibrationData()
    precision_plan: PrecisionPlan = PrecisionPlan()


def check_request(request: OnnxExportRequest) -> tuple[OnnxProfile, Precision]:
    """ConfigError naming the flag when the request cannot be exported; the profile and precision otherwise."""
    profile = onnx_profile(request.profile)
    kv_mode(request.kv_cache)
    chosen = precision(request.precision or next((p for p in profile.precisions
                                                  if request.kv_cache in PRECISIONS[p].kv_caches), "fp16"))
    profile.check_precision(chosen.name)
    if request.kv_cache not in ONNX_KV_MODES:
        raise ConfigError(f"--kv-cache {request.kv_cache} has no ONNX graph form; choose one of "
                         f"{', '.join(ONNX_KV_MODES)}")
    if request.kv_cache not in chosen.kv_caches:
        raise ConfigError(f"--precision {chosen.name} graphs take --kv-cache {' or '.join(chosen.kv_caches)}, not "
                          f"{request.kv_cache}; change --kv-cache, or export --precision fp16")
    if request.htp_arch is not None:
        if not profile.host_inputs:
            raise ConfigError(f"--htp-arch compiles npu graphs for Qualcomm's HTP; the {profile.name} profile's are "
                              "not; export --profile npu or leave --htp-arch out")
        check_htp_arch(request.htp_arch, chosen.name)
    if request.precision_plan.w16 and not chosen.quantized:
        raise ConfigError(f"--precision-plan stores weights of quantized graphs in 16 bits; {chosen.name} graphs are "
                          "float: export --precision a16w8 or leave --precision-plan out")
    if request.chunk < 1 or request.context < 1:
        raise ConfigError(f"need --context and --chunk >= 1, got {request.context} and {request.chunk}")
    if request.context < request.chunk:
        raise ConfigError(f"--context {request.context} is smaller than --chunk {request.chunk}: a prompt chunk must "
                         "fit the KV window; raise --context or lower --chunk")
    existing = read_manifest(request.output)
    if request.output.exists() and (existing is None or existing.get("format") != ONNX_FORMAT):
        raise FileExistsError(f"{request.output} exists and is not an ONNX export; choose another --output")
    return profile, chosen


def kv_graph_type(mode: str, profile: OnnxProfile, scales: KVScales | None, source: Path) -> KvGraphType:
    """How the graphs of a KV mode pass K/V under a profile; CheckpointError when INT8 has no scales."""
    storage = kv_mode(mode)
    if not storage.static_scales:
        return KvGraphType(str(storage.element).removeprefix("torch."))  # fp32, fp16: the cache's element type
    if scales is None:
        raise CheckpointError(f"{source}: has no {SCALES_FILE}, and --kv-cache {mode} graphs quantize K/V with the "
                              f"engine's calibrated static scales; rebuild it with cabin-build --kv-cache int8 "
                              "(it calibrates), or export --kv-cache fp16")
    shared = torch.tensor(scales.shared(), dtype=torch.float32).tolist()  # the values the int8 cache uses
    return KvGraphType(profile.int8_dtype, profile.int8_zero_point, shared)


def export_onnx(request: OnnxExportRequest, log: Log = print) -> dict:
    """Write the graph folder (atomically: an interrupted export leaves no folder) and return its manifest."""
    import onnx

    profile, chosen = check_request(request)
    stored = EngineFolder(request.engine).config()
    profile.check_weights(stored.weight_format.name, head_format(stored.quantization).name)  # before the weights
    if chosen.quantized or request.htp_arch is not None:
        qnn_versions()  # onnxruntime-qnn installed, before the long work
    steps = Steps(4 + chosen.quantized + (request.htp_arch is not None), log)
    with steps.step(f"loading {request.engine}"):
        engine = Engine.load(request.engine)
    config = engine.config
    if request.context > config.max_position_embeddings:
        raise ConfigError(f"--context {request.context} exceeds the model's context of "
                         f"{config.max_position_embeddings} tokens; lower --context")
    kv = kv_graph_type(request.kv_cache, profile, engine.scales, request.engine)
    head = head_format(config.quantization).name
    manifest = {
        "format": ONNX_FORMAT,
        "model": {"fingerprint": engine.fingerprint, "architecture": config.architecture,
                  "config": config.to_dict()},
        "context": request.context, "chunk": request.chunk, "kv_cache": request.kv_cache,
        "kv_graph": kv.to_dict(), "profile": profile.name, "opset": profile.opset,
        "precision": chosen.name, "host_inputs": profile.host_inputs,
        "attention_mask_value": QUANTIZED_MASKED if chosen.quantized else MASKED,
        "weight_format": {"name": config.weight_format.name, "linear": WEIGHT_FORMS[config.weight_format.name]},
        "head": {"name": head, "form": HEAD_FORMS[head]},
        "graphs": {"prompt": PROMPT_GRAPH, "token": TOKEN_GRAPH}, "weights": WEIGHTS_FILE,
        "plan": {"tokens_per_block": engine.kv_cache_config().tokens_per_block},
        "system_prompt": engine.manifest.get("system_prompt"),  # the engine's default, which cabin-chat reads
    }
    with staging_folder(request.output) as tmp:
        (tmp / TOKENIZER_DIR).mkdir()
        for file in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            shutil.copyfile(engine.folder / CHECKPOINT_DIR / file, tmp / TOKENIZER_DIR / file)
        if profile.host_inputs:
            (tmp / HOST_DIR).mkdir()
            for name, table in host_tables(engine.model, request.context).items():
                np.save(tmp / HOST_DIR / f"{name}.npy", table)
            if engine.vision is not None and engine.vision.family.mrope:
                log("cabin-export: the graphs take text only: Qwen2-VL's M-RoPE positions are not in the host RoPE "
                    "tables; its pictures run on the reference engine")
            elif engine.vision is not None:  # the host encodes pictures and feeds their rows as inputs_embeds
                shutil.copytree(engine.folder / VISION_FOLDER, tmp / VISION_FOLDER)
                manifest["vision"] = engine.manifest["vision"]
            if engine.audio is not None:  # the host encodes clips and feeds their rows as inputs_embeds
                shutil.copytree(engine.folder / AUDIO_FOLDER, tmp / AUDIO_FOLDER)
                manifest["audio"] = engine.manifest["audio"]
        if chosen.quantized:  # the graphs never run the conversation's first token (StoredPrefix)
            manifest["prefix"] = write_prefix(tmp / HOST_DIR, engine, request.kv_cache,
                                              KVScales(kv.scales, kv.scales) if kv.scales else None)
        # a quantized precision starts from float graphs with float K/V, quantized with the engine's scales
        float_kv = KvGraphType("float32") if chosen.quantized else kv
        weights, models = WeightsFile(tmp / WEIGHTS_FILE), {}
        for name, tokens in ((PROMPT_GRAPH, request.chunk), (TOKEN_GRAPH, 1)):
            with steps.step(f"{name}: {tokens} token(s) over a window of {request.context}"):
                models[name] = build_graph(engine.model, tokens, request.context, float_kv, profile.opset, weights,
                                           profile.host_inputs, chosen.quantized)
                onnx.helper.set_model_props(models[name], graph_metadata(manifest))
                onnx.save_model(models[name], str(tmp / name))
        weights.close()
        if chosen.quantized:
            with steps.step(f"quantizing both graphs to {chosen.name} with ONNX Runtime's QNN tooling, calibrated on "
                            f"{request.calibration.describe()}"):
                float_manifest = {**manifest, "kv_graph": float_kv.to_dict(), "precision": "fp16"}  # what calibrates
                atomic_write_text(tmp / MANIFEST_FILE, json.dumps(float_manifest, indent=2) + "\n")
                models, manifest["quantization"] = quantize_graphs(OnnxFolder(tmp), kv, request.calibration,
                                                                   request.precision_plan, request.htp_arch)
                write_graphs(tmp, models)
        with steps.step("graphs checked, manifest.json"):
            for name in models:
                onnx.checker.check_model(str(tmp / name), full_check=True)
            manifest["ops"] = sorted({f"{n.domain}.{n.op_type}" if n.domain else n.op_type
                                      for model in models.values() for n in model.graph.node})
            manifest["opset"] = next(o.version for o in models[PROMPT_GRAPH].opset_import if o.domain in ("", "ai.onnx"))
            atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
        if request.htp_arch is not None:
            with steps.step(f"compiling both graphs for HTP v{request.htp_arch} (QNN context binaries)"):
                manifest["qnn"] = compile_context_binaries(OnnxFolder(tmp), manifest, request.htp_arch)
                atomic_write_text(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    log(f"cabin-export: wrote {request.output} ({profile.name} profile, {chosen.name}, opset {manifest['opset']}, "
        f"KV {request.kv_cache} as {kv.dtype}"
        + (f", compiled for HTP v{request.htp_arch}" if request.htp_arch is not None else "") + ")")
    return manifest


def write_graphs(folder: Path, models: dict) -> None:
    """Save loaded graphs over the folder's, their large tensors in a new ``weights.bin`` (a tensor both graphs
    hold, once)."""
    import onnx

    weights = WeightsFile(folder / WEIGHTS_FILE)
    for name, model in models.items():
        for index, tensor in enumerate(model.graph.initializer):
            if tensor.data_location != onnx.TensorProto.EXTERNAL and len(tensor.raw_data) >= _EXTERNAL_MIN_BYTES:
                model.graph.initializer[index].CopyFrom(weights.tensor(tensor.name, onnx.numpy_helper.to_array(tensor)))
        onnx.save_model(model, str(folder / name))
    weights.close()


def write_prefix(host: Path, engine: Engine, kv_cache: str, scales: KVScales | None) -> list[int]:
    """Run the token every conversation starts with (the chat template's first) through the reference engine in
    float32 over the graphs' KV mode and scales, and write its K/V and logits as the host's prefix tables; its token
    ids."""
    tokenizer = engine.tokenizer
    tokens = tokenizer.encode_prompt(tokenizer.render([{"role": "user", "content": "."}]))[:1]
    run = run_tokens(engine.model, tokens, kv_cache, scales, all_logits=True)
    kv = [run.cache.read(layer, run.seq) for layer in range(engine.config.num_hidden_layers)]
    keys, values = (torch.stack([pair[i] for pair in kv]) for i in (0, 1))
    for name, table in zip(PREFIX_TABLES, (keys, values, run.logits)):
        np.save(host / f"{name}.npy", table.float().numpy())
    return tokens


def layer_output(layer: int) -> str:
    """The name of a layer's output (the residual stream after it) in every graph."""
    return f"layers.{layer}.out"


def host_tables(model: Transformer, context: int) -> dict[str, np.ndarray]:
    """The tables the host looks rows up in (npu profile): the embedding, and the RoPE cos/sin rows of each
    position of the window (the local layers' own where they have them)."""
    tables = {"embedding": model.embedding.float().numpy()}
    ropes = [(ROPE_INPUTS, model.rope)] + ([(LOCAL_ROPE_INPUTS, model.local_rope)] if model.local_rope else [])
    for names, rope in ropes:
        for name, rows in zip(names, rope.rows(torch.arange(context))):
            tables[name] = rows.float().numpy()
    return tables


class WeightsFile:
    """``weights.bin``: tensors appended once, aligned, and referenced by every graph as ONNX external data."""

    def __init__(self, path: Path) -> None:
        self.path, self.handle, self.offset = path, path.open("wb"), 0
        self.tensors: dict[str, object] = {}
        self.digests: dict[str, tuple[int, int]] = {}  # each tensor's bytes: length and hash

    def tensor(self, name: str, array: np.ndarray):
        """A TensorProto of ``array`` stored in the file (written on first use of the name)."""
        import onnx

        data = np.ascontiguousarray(array).tobytes()
        if name in self.tensors and self.digests[name] != (len(data), hash(data)):
            raise ValueError(f"two graphs hold different tensors named {name}")
        if name not in self.tensors:
            pad = -self.offset % _ALIGN
            self.handle.write(b"\0" * pad)
            self.offset += pad
            proto = onnx.TensorProto(name=name, dims=list(array.shape),
                                     data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
                                     data_location=onnx.TensorProto.EXTERNAL)
            for key, value in (("location", self.path.name), ("offset", self.offset), ("length", len(data))):
                proto.external_data.add(key=key, value=str(value))
            self.handle.write(data)
            self.offset += len(data)
            self.tensors[name], self.digests[name] = proto, (len(data), hash(data))
        return self.tensors[name]

    def close(self) -> None:
        """Flush the file to disk."""
        self.handle.flush()
        self.handle.close()


class _Graph:
    """Nodes and initializers of one graph, with a helper per op."""

    def __init__(self, weights: WeightsFile, opset: int, fused_norm: bool) -> None:
        import onnx

        self.onnx, self.weights, self.opset, self.fused_norm = onnx, weights, opset, fused_norm
        self.nodes, self.initializers, self.names = [], {}, 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None, **attrs) -> str | list[str]:
        """Add a node; its output name(s)."""
        self.names += 1
        out = [name] if name else [f"{op_type.lower()}_{self.names}_{i}" for i in range(outputs)]
        self.nodes.append(self.onnx.helper.make_node(op_type, list(inputs), out, name=f"{op_type}_{self.names}",
                                                     **attrs))
        return out if outputs > 1 else out[0]

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer (large ones in weights.bin, shared by name across graphs)."""
        if name not in self.initializers:
            array = np.asarray(array)
            if array.nbytes >= _EXTERNAL_MIN_BYTES:
                self.initializers[name] = self.weights.tensor(name, array)
            else:
                self.initializers[name] = self.onnx.numpy_helper.from_array(array, name)
        return name

    def shape(self, name: str) -> list[int]:
        """The shape of a constant."""
        return list(self.initializers[name].dims)

    def ints(self, *values: int) -> str:
        """An int64 vector constant (shapes, axes, split sizes)."""
        return self.const("i64_" + "_".join(str(v).replace("-", "m") for v in values),
                          np.array(values, dtype=np.int64))

    def scalar(self, name: str, value: float, dtype=np.float32) -> str:
        """A scalar constant."""
        return self.const(name, np.array(value, dtype=dtype))


def _weight(t: torch.Tensor) -> np.ndarray:
    """A checkpoint (out, in) linear weight as the (in, out) right operand of MatMul."""
    return t.float().t().contiguous().numpy()


def _linear(g: _Graph, x: str, name: str, weight: Linear | Int8G32Table, out: str | None = None) -> str:
    """x @ W.T of one linear op, its weights in their stored form: float32 MatMul, int8 per-channel QDQ into
    MatMul, int4-AWQ MatMulNBits after the prequant Mul, int4-g32 MatMulNBits with a float zero point per block
    (w = (q - z) * d with z = -m / d), the int8 head 8-bit MatMulNBits; stacked parts concatenated."""
    if isinstance(weight, Stacked):
        return g.op("Concat", *(_linear(g, x, f"{name}.{i}", part) for i, part in enumerate(weight.parts)), axis=-1,
                    name=out)
    if isinstance(weight, Int8Linear):
        codes = g.const(f"{name}.int8", weight.weight.t().contiguous().numpy())  # (in, out)
        return g.op("MatMul", x, g.op("DequantizeLinear", codes, g.const(f"{name}.scale", weight.scale.numpy()),
                                      axis=1), name=out)
    if isinstance(weight, Int4AwqLinear):
        rows, cols = weight.scale.shape[0], weight.packed.shape[1]
        scaled = g.op("Mul", x, g.const(f"{name}.prequant", weight.prequant.float().numpy()))
        codes = (unpack_int4(weight.packed).to(torch.int16) + INT4_ZERO_POINT).to(torch.uint8)
        return g.op("MatMulNBits", scaled, g.const(f"{name}.uint4", _nbits_blocks(codes, weight.group_size)),
                    g.const(f"{name}.scales", weight.scale.float().reshape(-1).numpy()), domain=CONTRIB_DOMAIN,
                    K=cols, N=rows, bits=4, block_size=weight.group_size, name=out)
    if isinstance(weight, Int4G32Linear):
        codes, scale, zero = _g32_blocks(weight)
        return g.op("MatMulNBits", x, g.const(f"{name}.uint4", _nbits_blocks(codes, GGUF_GROUP)),
                    g.const(f"{name}.scales", scale), g.const(f"{name}.zero_points", zero), domain=CONTRIB_DOMAIN,
                    K=codes.shape[1], N=codes.shape[0], bits=4, block_size=GGUF_GROUP, name=out)
    if isinstance(weight, Int8G32Table):
        rows, cols = weight.codes.shape
        return g.op("MatMulNBits", x, g.const(f"{name}.uint8", _head_blocks(weight)),
                    g.const(f"{name}.scales", weight.scale.float().reshape(-1).numpy()), domain=CONTRIB_DOMAIN,
                    K=cols, N=rows, bits=8, block_size=GGUF_GROUP, name=out)
    return g.op("MatMul", x, g.const(name, _weight(weight)), name=out)


def _nbits_blocks(codes: torch.Tensor, group: int) -> np.ndarray:
    """MatMulNBits' 4-bit B: uint8 (out, in / group, group / 2), the unsigned codes (out, in) of each output row's
    input block, two per byte along the input, the first in the low nibble."""
    blocks = codes.reshape(codes.shape[0], -1, group)
    return (blocks[..., 0::2] | (blocks[..., 1::2] << 4)).numpy()


def _g32_blocks(weight: Int4G32Linear) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """int4-g32 as MatMulNBits takes it: codes (out, in), float32 scales d and zero points -m / d per block. A block
    of d = 0 (all its weights m) is written as codes 0, scale m, zero point -1."""
    codes, d, m = unpack_g32(weight.codes), weight.scale.float(), weight.minimum.float()
    flat = d == 0
    codes = codes.masked_fill(flat.repeat_interleave(GGUF_GROUP, dim=1), 0)
    zero = torch.where(flat, torch.tensor(-1.0), -m / torch.where(flat, torch.tensor(1.0), d))
    return codes, torch.where(flat, m, d).reshape(-1).numpy(), zero.reshape(-1).numpy()


def _head_blocks(table: Int8G32Table) -> np.ndarray:
    """The int8 head's codes as 8-bit MatMulNBits' B: uint8 (vocab, hidden / 32, 32), each code q + 128."""
    rows, cols = table.codes.shape
    return (table.codes.to(torch.int16) + INT8_ZERO_POINT).to(torch.uint8).reshape(rows, cols // GGUF_GROUP,
                                                                                   GGUF_GROUP).numpy()


def _embedding(g: _Graph, model: Transformer) -> str:
    """The rows of input_ids: a Gather from the float table, or from the int8 head's blocks (the lm_head's own
    when tied) dequantized: (B - 128) * scale of each block."""
    table = model.embedding
    if not isinstance(table, Int8G32Table):
        return g.op("Gather", g.const("embedding", table.numpy()), "input_ids", axis=0)
    name = "lm_head" if table is model.lm_head else "embedding"
    rows, cols = table.codes.shape
    blocks = g.op("Cast", g.op("Gather", g.const(f"{name}.uint8", _head_blocks(table)), "input_ids", axis=0), to=1)
    scales = g.op("Reshape", g.const(f"{name}.scales", table.scale.float().reshape(-1).numpy()),
                  g.ints(rows, cols // GGUF_GROUP, 1))
    rows_out = g.op("Mul", g.op("Sub", blocks, g.scalar("head_zero_point", INT8_ZERO_POINT)),
                    g.op("Gather", scales, "input_ids", axis=0))
    return g.op("Reshape", rows_out, g.ints(1, -1, cols))


def build_graph(model: Transformer, tokens: int, context: int, kv: KvGraphType, opset: int, weights: WeightsFile,
                host_inputs: bool = False, fused_norm: bool = False):
    """The ModelProto of ``tokens`` new tokens attending to a window of ``context`` past tokens; with
    ``host_inputs`` it takes the embeddings and RoPE rows (and a local layer's mask) the host looks up; with
    ``fused_norm`` (graphs to be quantized, opset 23) each RMSNorm is one RMSNormalization op."""
    import onnx

    c, eps = model.config, model.config.norm_epsilon
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_size
    group, keys = heads // kv_heads, context + tokens
    g = _Graph(weights, opset, fused_norm)
    kv_elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(kv.dtype))
    float_input = lambda name, *shape: onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, *shape])
    if host_inputs:
        rotary = c.rotated_channels
        inputs = [float_input(INPUTS_EMBEDS, tokens, c.hidden_size)]
        inputs += [float_input(name, tokens, 1, rotary) for name in ROPE_INPUTS]
        inputs += [float_input(name, tokens, 1, rotary) for name in LOCAL_ROPE_INPUTS] if model.local_rope else []
        x, rope = INPUTS_EMBEDS, ROPE_INPUTS
        local_rope = LOCAL_ROPE_INPUTS if model.local_rope is not None else rope
    else:
        inputs = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, [1, tokens])
                  for name in ("input_ids", "position_ids")]
        x = _embedding(g, model)
        if c.embedding_multiplier != 1.0:
            x = g.op("Mul", x, g.scalar("embedding_multiplier", c.embedding_multiplier))
        rope = _rope_rows(g, "rope", *model.rope.rows(torch.arange(context)))
        # Gemma 3's local layers: a table of their own base, unscaled
        local_rope = rope if model.local_rope is None else _rope_rows(g, "rope_local",
                                                                       *model.local_rope.rows(torch.arange(context)))
    inputs.append(float_input("attention_mask", 1, tokens, keys))
    if host_inputs and c.sliding_window is not None:
        inputs.append(float_input(LOCAL_MASK, 1, tokens, keys))
    outputs = [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, tokens, c.vocab_size])]
    mask = g.op("Unsqueeze", "attention_mask", g.ints(1))  # [1, 1, 1, T, keys]: every KV head, every group
    if c.sliding_window is None:
        local_mask = mask
    elif host_inputs:
        local_mask = g.op("Unsqueeze", LOCAL_MASK, g.ints(1))
    else:
        local_mask = _window_mask(g, mask, context, c.sliding_window)
    scalar = d if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar  # Gemma's, else the head size
    q_scale = g.scalar("attention_scale", 1.0 / math.sqrt(scalar))
    for index, layer in enumerate(model.layers):
        inputs.append(onnx.helper.make_tensor_value_info(past_key(index), kv_elem, [1, kv_heads, d, context]))
        inputs.append(onnx.helper.make_tensor_value_info(past_value(index), kv_elem, [1, kv_heads, context, d]))
        for name in (new_key(index), new_value(index)):
            outputs.append(onnx.helper.make_tensor_value_info(name, kv_elem, [1, tokens, kv_heads, d]))
        p = f"layers.{index}"
        local = c.layer_window(index) is not None
        cos, sin = local_rope if local else rope
        h = _layer_norm(g, x, layer, p, "input_norm", eps)
        qkv = _linear(g, h, f"{p}.qkv", layer["qkv"])
        if "qkv_bias" in layer:
            qkv = g.op("Add", qkv, g.const(f"{p}.qkv_bias", layer["qkv_bias"].numpy()))
        qk, v = g.op("Split", qkv, g.ints((heads + kv_heads) * d, kv_heads * d), axis=-1, outputs=2)
        qk = g.op("Reshape", qk, g.ints(1, tokens, heads + kv_heads, d))
        if c.qk_layernorm:  # each q head by q_norm, each k head by k_norm: one norm of (heads + kv_heads, d) rows
            rows = torch.cat([layer["q_norm"].expand(heads, d), layer["k_norm"].expand(kv_heads, d)])
            qk = _rms_norm(g, qk, g.const(f"{p}.qk_norm", rows.numpy()), eps)
        qk = _rope(g, qk, cos, sin, d, c.rotated_channels) if c.layer_rotates(index) else qk
        q, k = g.op("Split", qk, g.ints(heads, kv_heads), axis=2, outputs=2)
        v = g.op("Reshape", v, g.ints(1, tokens, kv_heads, d))
        new_k, past_k = _kv_io(g, k, past_key(index), new_key(index), kv, index)
        new_v, past_v = _kv_io(g, v, past_value(index), new_value(index), kv, index)
        q = g.op("Transpose", g.op("Reshape", g.op("Mul", q, q_scale), g.ints(1, tokens, kv_heads, group, d)),
                 perm=[0, 2, 3, 1, 4])  # [1, kv_heads, group, T, d]
        # scores over the window and over the new tokens, each against K as [1, kv_heads, 1, d, keys]
        scores = g.op("Concat", g.op("MatMul", q, g.op("Unsqueeze", past_k, g.ints(2))),
                      g.op("MatMul", q, g.op("Unsqueeze", g.op("Transpose", new_k, perm=[0, 2, 3, 1]), g.ints(2))),
                      axis=-1)
        probs = g.op("Softmax", g.op("Add", scores, local_mask if local else mask), axis=-1)
        p_past, p_new = g.op("Split", probs, g.ints(context, tokens), axis=-1, outputs=2)
        out = g.op("Add", g.op("MatMul", p_past, g.op("Unsqueeze", past_v, g.ints(2))),
                   g.op("MatMul", p_new, g.op("Unsqueeze", g.op("Transpose", new_v, perm=[0, 2, 1, 3]), g.ints(2))))
        attn = g.op("Reshape", g.op("Transpose", out, perm=[0, 3, 1, 2, 4]), g.ints(1, tokens, heads * d))
        attn = _linear(g, attn, f"{p}.dense", layer["dense"])
        if c.inter_layernorms:  # Gemma: post_norm normalizes the attention output, two more the MLP's
            x = g.op("Add", x, _layer_norm(g, attn, layer, p, "post_norm", eps))
            h = _layer_norm(g, x, layer, p, "pre_ff_norm", eps)
        else:
            x = g.op("Add", x, attn)
            h = _layer_norm(g, x, layer, p, "post_norm", eps)
        fc, gate = g.op("Split", _linear(g, h, f"{p}.fc_gate", layer["fc_gate"]),
                        g.ints(c.intermediate_size, c.intermediate_size), axis=-1, outputs=2)
        mlp = _linear(g, g.op("Mul", _activation(g, fc, c.hidden_act), gate), f"{p}.proj", layer["proj"])
        x = g.op("Add", x, _layer_norm(g, mlp, layer, p, "post_ff_norm", eps) if c.inter_layernorms else mlp,
                 name=layer_output(index))
    h = _rms_norm(g, x, g.const("final_norm", model.final_norm.numpy()), eps)
    cap = c.final_logit_softcapping
    logits = _linear(g, h, "lm_head", model.lm_head, out="logits" if cap is None else None)
    if cap is not None:
        _softcap(g, logits, cap, "logits")
    graph = onnx.helper.make_graph(g.nodes, f"cabin_{tokens}_over_{context}", inputs, outputs,
                                   list(g.initializers.values()))
    opsets = [onnx.helper.make_opsetid("", opset)]
    if any(node.domain == CONTRIB_DOMAIN for node in g.nodes):
        opsets.append(onnx.helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return onnx.helper.make_model(graph, opset_imports=opsets, producer_name="cabinllm")


def _rms_norm(g: _Graph, x: str, weight: str, eps: float) -> str:
    """x / sqrt(mean(x^2) + eps) * weight. In a graph to be quantized one RMSNormalization op, so no tensor holds
    mean(x^2), whose uint16 range one massive activation (the first token's) stretches until every other token's
    rounds to 0; else the op pattern ONNX Runtime fuses into one RMSNorm kernel (and the HTP finalizes in fp16)."""
    if g.fused_norm:
        d = g.shape(weight)[-1]
        return g.op("Mul", g.op("RMSNormalization", x, g.const(f"ones_{d}", np.ones(d, np.float32)), axis=-1,
                                epsilon=eps), weight)
    square = g.op("Pow", x, g.scalar("two", 2.0))
    mean = g.op("ReduceMean", square, g.ints(-1), keepdims=1) if g.opset >= REDUCE_AXES_INPUT_OPSET else \
        g.op("ReduceMean", square, axes=[-1], keepdims=1)
    root = g.op("Sqrt", g.op("Add", mean, g.scalar(f"eps_{eps:g}", eps)))
    return g.op("Mul", g.op("Div", x, root), weight)


def _layer_norm(g: _Graph, x: str, layer: dict, prefix: str, key: str, eps: float) -> str:
    """RMSNorm of x by the layer's norm weight ``key``, the constant ``{prefix}.{key}``."""
    return _rms_norm(g, x, g.const(f"{prefix}.{key}", layer[key].numpy()), eps)


def _rope_rows(g: _Graph, name: str, cos: torch.Tensor, sin: torch.Tensor) -> tuple[str, str]:
    """The cos/sin rows [1, T, 1, rotated channels] of ``position_ids`` from tables (positions, rotated channels)."""
    return tuple(g.op("Unsqueeze", g.op("Gather", g.const(f"{name}_{part}", table.numpy()), "position_ids", axis=0),
                      g.ints(2)) for part, table in (("cos", cos), ("sin", sin)))


def _rope(g: _Graph, x: str, cos: str, sin: str, d: int, rotary: int) -> str:
    """GPT-NeoX rotary embedding of the first ``rotary`` channels of x [1, T, heads, d] with cos/sin
    [1, T, 1, rotary]; the other channels pass."""
    if rotary < d:
        rotated = _rope(g, g.op("Slice", x, g.ints(0), g.ints(rotary), g.ints(3)), cos, sin, rotary, rotary)
        return g.op("Concat", rotated, g.op("Slice", x, g.ints(rotary), g.ints(d), g.ints(3)), axis=3)
    half = d // 2
    first = g.op("Slice", x, g.ints(0), g.ints(half), g.ints(3))
    second = g.op("Slice", x, g.ints(half), g.ints(d), g.ints(3))
    rotated = g.op("Concat", g.op("Neg", second), first, axis=3)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))


def _window_mask(g: _Graph, mask: str, context: int, window: int) -> str:
    """``mask`` [1, 1, 1, T, keys] of a local layer: MASKED added where a key lies ``window`` or more positions
    before its query (the window's slot j holds position j, the new tokens are at ``position_ids``)."""
    queries = g.op("Cast", "position_ids", to=g.onnx.TensorProto.FLOAT)  # [1, T]
    keys = g.op("Concat", g.const("window_positions", np.arange(context, dtype=np.float32)[None]), queries, axis=-1)
    behind = g.op("Add", g.op("Unsqueeze", queries, g.ints(2)), g.op("Neg", g.op("Unsqueeze", keys, g.ints(1))))
    # query - key - (window - 1), clipped to [0, 1]: 1 outside the window, 0 inside (integers, so exactly)
    outside = g.op("Clip", g.op("Add", behind, g.scalar(f"window_{window}", 1.0 - window)), g.scalar("zero", 0.0),
                   g.scalar("one", 1.0))
    return g.op("Add", mask, g.op("Mul", outside, g.scalar("masked", MASKED)))


def _activation(g: _Graph, x: str, act: str) -> str:
    """The MLP's activation of its fc branch: SiLU as x * Sigmoid(x); tanh-approximate GELU as
    x * Sigmoid(2 * sqrt(2 / pi) * (x + 0.044715 * x^3)), which is 0.5 * x * (1 + tanh(...))."""
    if act == "silu":
        return g.op("Mul", x, g.op("Sigmoid", x))
    cube = g.op("Mul", x, g.op("Mul", x, x))
    inner = g.op("Add", x, g.op("Mul", cube, g.scalar("gelu_cube", 0.044715)))
    return g.op("Mul", x, g.op("Sigmoid", g.op("Mul", inner, g.scalar("gelu_scale", 2.0 * math.sqrt(2.0 / math.pi)))))


def _softcap(g: _Graph, x: str, cap: float, name: str) -> str:
    """cap * tanh(x / cap) as the output ``name``, in the form 2 * cap * Sigmoid(2 * x / cap) - cap."""
    squashed = g.op("Sigmoid", g.op("Mul", x, g.scalar("softcap_in", 2.0 / cap)))
    return g.op("Add", g.op("Mul", squashed, g.scalar("softcap_out", 2.0 * cap)), g.scalar("softcap_shift", -cap),
                name=name)


def _kv_io(g: _Graph, new: str, past: str, out: str, kv: KvGraphType, layer: int) -> tuple[str, str]:
    """Emit the new tokens' K (or V) as the graph output ``out`` in the KV form; return them and the past window
    as fp32, each element as the cache stores it (the window is never copied into a longer tensor)."""
    if kv.scales is not None:
        scale = g.scalar(f"kv_scale.{layer}", kv.scales[layer])
        zero = g.scalar(f"kv_zero_point_{kv.dtype}", kv.zero_point, np.dtype(kv.dtype))
        limit = INT8_MAX * kv.scales[layer]  # the clamp of cabinllm.runtime.kv.quant.quantize_static, before rounding
        clipped = g.op("Clip", new, g.scalar(f"kv_min.{layer}", -limit), g.scalar(f"kv_max.{layer}", limit))
        g.op("QuantizeLinear", clipped, scale, zero, name=out)
        return g.op("DequantizeLinear", out, scale, zero), g.op("DequantizeLinear", past, scale, zero)
    if kv.dtype == "float16":
        g.op("Cast", new, name=out, to=g.onnx.TensorProto.FLOAT16)
        return g.op("Cast", out, to=g.onnx.TensorProto.FLOAT), g.op("Cast", past, to=g.onnx.TensorProto.FLOAT)
    return g.op("Identity", new, name=out), past
