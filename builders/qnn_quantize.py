"""A16W8 graphs for Qualcomm's HTP, quantized the way ONNX Runtime's QNN tooling does it
(``onnxruntime.quantization.execution_providers.qnn``): static QDQ calibrated on our dialogues, uint16
activations, int8 symmetric weights (per output channel for every MatMul), while the KV tensors keep the
engine's static INT8 scales so the NPU's cache means what our paged cache means.

The float graphs (float K/V in and out) run on ONNX Runtime's CPU provider over calibration dialogues: the host
loop of the ONNX backend feeds them (prompt graph for chunks, token graph for the last tokens of each dialogue),
and each call's inputs reach ONNX Runtime's MinMax calibrator as they are made, one at a time. (The tooling's
``qnn_preprocess_model`` fuses Erf sequences into Gelu and ReduceL2 ones into LpNormalization, which these
graphs do not have; in onnxruntime 1.32 it also fails on a model with metadata, so it is not called.) Every layer's
``past_key.L`` / ``past_value.L`` inputs and ``new_key.L`` / ``new_value.L`` outputs are forced to uint8 with
zero point 128 and the engine's scale of layer L (``TensorQuantOverrides``: scale and zero point given, not
calibrated); the quantizer then puts a QuantizeLinear after each such input and a DequantizeLinear before each
such output, which ``kv_io_as_codes`` removes, so the graphs take and give the 8-bit codes the cache stores
(code q as q + 128; the quantizer saturates at q = -128 where the cache clamps at -127).
"""
from __future__ import annotations

import logging
import queue
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cabinllm.builders.qnn_precision import PrecisionPlan, apply_plan, check_plan
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine
from cabinllm.runtime.formats.onnx_folder import (KvGraphType, OnnxFolder, StoredPrefix, new_key, new_value,
                                                  past_key, past_value)
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import PagedKVCache, sized_config
from cabinllm.runtime.model.tokenizer import ChatTokenizer

_QUANT_DIR = "quantizing"  # a subfolder of the staging folder, gone when the graphs are written
_MOVES = ("Unsqueeze", "Transpose", "Reshape")  # ops that only move a tensor's elements


@dataclass(frozen=True)
class CalibrationData:
    """The dialogues the activations are calibrated on: source, how many, their length, and how many of each
    one's last tokens go through the token graph (the rest through the prompt graph)."""

    data: str = "sharegpt"  # its calibration split; measured: 16 of its dialogues leave a third less KL to the
    num_dialogues: int = 16  # fp32 reference than the 4 builtin ones, whose ranges held-out text exceeds
    max_tokens: int = 512
    token_steps: int = 8
    seed: int = 0

    def describe(self) -> str:
        """One line for the progress log."""
        return (f"{self.num_dialogues} {self.data} dialogues of up to {self.max_tokens} tokens (the last "
                f"{self.token_steps} of each through the token graph)")


class _Feeds:
    """A CalibrationDataReader of ``total`` feeds that come from a walk run on another thread, handed over one at a
    time (the calibrator's strided form: it asks for them range by range and merges each range's min/max)."""

    def __init__(self, walk: Callable[[Callable[[dict], None]], None], total: int) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.count, self.total, self.end = 0, total, total
        self.thread = threading.Thread(target=self._produce, args=(walk,), daemon=True)
        self.thread.start()

    def _produce(self, walk) -> None:
        try:
            walk(lambda feeds: self.queue.put({name: np.array(value) for name, value in feeds.items()}))
        except BaseException as err:  # handed to the calibrator's thread
            self.error = err
        finally:
            self.queue.put(None)

    def __len__(self) -> int:
        return self.total

    def set_range(self, start_index: int, end_index: int) -> None:
        """The calibrator's next range of feeds (they come in order)."""
        self.end = end_index

    def get_next(self) -> dict | None:
        """The next feed, None after the last of the range."""
        if self.count >= self.end:
            return None
        feeds = self.queue.get()
        if feeds is None:
            self.thread.join()
            if self.error is not None:
                raise self.error
            return None
        self.count += 1
        return feeds


class Recording:
    """A session that shows each call's inputs to a callback before running them."""

    def __init__(self, session, callback: Callable[[dict], None]) -> None:
        self.session, self.callback = session, callback

    def run(self, outputs, feeds):
        """Show the feeds, then run them."""
        self.callback(feeds)
        return self.session.run(outputs, feeds)


def _split(ids: list[int], token_steps: int) -> tuple[list[int], list[int]]:
    """A dialogue's tokens through the prompt graph and those through the token graph."""
    cut = max(2, len(ids) - token_steps)  # at least 2: a single token goes through the token graph
    return ids[:cut], ids[cut:]


def _calls(dialogues: list[list[int]], token_steps: int, chunk: int, tokens: int, prefix: StoredPrefix | None) -> int:
    """How many calls of the graph of ``tokens`` tokens a walk makes (the stored prefix runs in none)."""
    heads = [_split(ids, token_steps)[0] for ids in dialogues]
    run = [len(head) - (prefix.covers(head, 0) if prefix else 0) for head in heads]  # what the graphs run of each
    if tokens == 1:
        return sum(len(_split(ids, token_steps)[1]) for ids in dialogues) + run.count(1)
    return sum(-(-n // chunk) for n in run if n > 1)


def _walk(folder: OnnxFolder, dialogues: list[list[int]], token_steps: int, tokens: int):
    """A walk over the dialogues through the float graphs that shows the calls of the graph of ``tokens`` tokens."""
    def walk(show: Callable[[dict], None]) -> None:
        model = load_onnx_engine(folder.path, "cpu").model
        model.graphs[tokens].session = Recording(model.graphs[tokens].session, show)
        layout = model.kv_layout
        for ids in dialogues:
            cache, seq = PagedKVCache(layout, sized_config(layout, "fp32", len(ids))), Sequence()
            head, _ = _split(ids, token_steps)
            cache.allocate(seq, head)
            model.forward(head, 0, cache, seq)
            for position in range(len(head), len(ids)):
                cache.append(seq, [ids[position]])
                model.forward([ids[position]], position, cache, seq)
    return walk


@contextmanager
def _quiet_root_logger():
    """The root logger at ERROR for the block."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def kv_overrides(kv: KvGraphType, layers: int) -> dict[str, list[dict]]:
    """TensorQuantOverrides that give every layer's K/V inputs and outputs the engine's scale, uint8, zero point
    128."""
    from onnxruntime.quantization import QuantType

    overrides = {}
    for layer in range(layers):
        forced = [{"quant_type": QuantType.QUInt8, "scale": np.array(kv.scales[layer], dtype=np.float32),
                   "zero_point": np.array(kv.zero_point, dtype=np.uint8)}]
        for name in (past_key(layer), past_value(layer), new_key(layer), new_value(layer)):
            overrides[name] = forced
    return overrides


def matmul_weight_overrides(model) -> dict[str, list[dict]]:
    """int8 symmetric per output channel (axis 1 of a MatMul's (in, out) weight) for every MatMul weight."""
    from onnxruntime.quantization import QuantType

    initializers = {tensor.name for tensor in model.graph.initializer}
    return {node.input[1]: [{"quant_type": QuantType.QInt8, "symmetric": True, "axis": 1}]
            for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in initializers}


def kv_io_as_codes(model, layers: int) -> None:
    """Make the quantized graph take and give the K/V codes: the QuantizeLinear after each ``past_*`` input and the
    DequantizeLinear before each ``new_*`` output go, the I/O become uint8 (the graph's own dequantized copy of
    the new K/V stays for its attention)."""
    import onnx

    names = {f(layer) for layer in range(layers) for f in (past_key, past_value, new_key, new_value)}
    nodes = list(model.graph.node)
    for value in model.graph.input:
        if value.name in names:
            quantize = next(n for n in nodes if n.op_type == "QuantizeLinear" and n.input[0] == value.name)
            codes = quantize.output[0]
            model.graph.node.remove(quantize)
            for node in model.graph.node:
                node.input[:] = [value.name if name == codes else name for name in node.input]
            value.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    for value in model.graph.output:
        if value.name in names:
            dequantize = next(n for n in nodes if n.op_type == "DequantizeLinear" and n.output[0] == value.name)
            codes, floats = dequantize.input[0], value.name + "_dequantized"
            for node in model.graph.node:
                node.input[:] = [floats if name == value.name else (value.name if name == codes else name)
                                 for name in node.input]
                node.output[:] = [value.name if name == codes else name for name in node.output]
            dequantize.output[0] = floats
            value.type.tensor_type.elem_type = onnx.TensorProto.UINT8


def attention_reads_codes(model, kv: KvGraphType, layers: int) -> None:
    """Let attention read the cache's 8-bit codes: each tensor the graph moves a layer's K/V into on their way to the
    attention MatMuls (Unsqueeze, Transpose, Reshape, and the tooling's conversions between them) takes the K/V's own
    uint8 scale and zero point instead of a uint16 range of its own, so nothing requantizes the codes and each
    attention MatMul multiplies uint16 activations by uint8 ones; and the tooling's 8-bit conversion of the new K/V
    before their output rounds straight to the cache's codes, not to a calibrated 8-bit range first. (The HTP
    computes a MatMul of two uint16 activations 0.4% off its exact result, one of uint16 by uint8 codes 0.06%:
    measured on the emulator. The tooling cannot be told so by TensorQuantOverrides: it then makes the whole MatMul
    8-bit.)"""
    from onnx import numpy_helper

    tensors = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    producers = {out: node for node in model.graph.node for out in node.output}
    requantized = set()

    def force(quantize, params: tuple[np.ndarray, np.ndarray]) -> None:
        for name, value in zip(quantize.input[1:3], params):
            tensors[name].CopyFrom(numpy_helper.from_array(value, name))
        requantized.add(quantize.output[0])

    for layer in range(layers):
        forced = (np.array(kv.scales[layer], np.float32), np.array(kv.zero_point, np.uint8))
        for name in (new_key(layer), new_value(layer)):  # the tooling's 8-bit conversion before the new K/V output
            source = producers[producers[name].input[0]]  # the output's QuantizeLinear <- its Identity
            quantize = producers.get(producers[source.input[0]].input[0])  # <- DequantizeLinear <- QuantizeLinear
            if quantize is not None and quantize.op_type == "QuantizeLinear":
                force(quantize, forced)  # one rounding, to the cache's codes, instead of two
        codes = {past_key(layer), past_value(layer), new_key(layer), new_value(layer)}
        moved = [n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in codes]
        while moved:
            for node in readers.get(moved.pop(), []):
                if node.op_type in _MOVES:
                    moved.append(node.output[0])
                elif node.op_type == "QuantizeLinear":
                    force(node, forced)
                    moved += [n.output[0] for n in readers.get(node.output[0], []) if n.op_type == "DequantizeLinear"]
    kept = [v for v in model.graph.value_info if v.name not in requantized]  # their element type is uint8 now
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def quantize_graphs(folder: OnnxFolder, kv: KvGraphType, calibration: CalibrationData, plan: PrecisionPlan,
                    htp_arch: int | None) -> tuple[dict, dict]:
    """Quantize the float graphs of a (staging) folder to A16W8 with its KV in ``kv``'s codes and the plan's weights
    in 16 bits (checked against the HTP architecture); the loaded graphs (their tensors in memory) and what the
    manifest records of the quantization."""
    import onnx
    import onnxruntime
    from onnx import numpy_helper
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    manifest = folder.manifest()
    layers, chunk = folder.config(manifest).num_hidden_layers, int(manifest["chunk"])
    tokenized, _ = prepare_dialogues(calibration.data, "train", calibration.num_dialogues, calibration.seed,
                                     ChatTokenizer(folder.tokenizer), calibration.max_tokens)
    dialogues = [d.token_ids[:int(manifest["context"])] for d in tokenized if len(d.token_ids) >= 2]
    work = folder.path / _QUANT_DIR
    work.mkdir()
    models, calls = {}, {}
    for key, tokens in (("prompt", chunk), ("token", 1)):
        name = manifest["graphs"][key]
        source, out = folder.path / name, work / name
        graph = onnx.load(str(source), load_external_data=False)
        overrides = {**matmul_weight_overrides(graph), **kv_overrides(kv, layers)}
        feeds = _Feeds(_walk(folder, dialogues, calibration.token_steps, tokens),
                       _calls(dialogues, calibration.token_steps, chunk, tokens, folder.prefix(manifest)))
        # stride 1: each call's min/max merged as it comes, one call's tensors held at a time
        config = get_qnn_qdq_config(str(source), feeds, activation_type=QuantType.QUInt16,
                                    weight_type=QuantType.QInt8, init_overrides=overrides, stride=1)
        # data-movement ops (the Unsqueeze of each past K/V) are quantized even where their input is a float graph input
        config.extra_options["ForceQuantizeNoInputCheck"] = True
        with _quiet_root_logger():  # the quantizer warns through the root logger about steps we take on purpose
            quantize(str(source), str(out), config)
        calls[key] = feeds.count
        models[name] = onnx.load(str(out))
        kv_io_as_codes(models[name], layers)
        attention_reads_codes(models[name], kv, layers)
        check_plan(plan, models[name], htp_arch)
        apply_plan(models[name], {t.name: numpy_helper.to_array(t, str(folder.path)) for t in graph.graph.initializer
                                  if t.name in plan.w16}, plan)
    shutil.rmtree(work)
    record = {"tool": f"onnxruntime {onnxruntime.__version__} quantization, execution_providers.qnn "
                      "(get_qnn_qdq_config, quantize)",
              "activations": "uint16, asymmetric, MinMax over the calibration calls",
              "weights": "int8 symmetric: per output channel for MatMul, per tensor elsewhere",
              "weights_16_bit": plan.to_dict(),
              "kv": "uint8 with zero point 128 and the engine's scale of each layer, forced (TensorQuantOverrides)",
              "calibration": {"data": calibration.data, "dialogues": len(dialogues),
                              "tokens": sum(len(d) for d in dialogues),
                              "calls": calls}}
    return models, record
