"""Where Qualcomm's HTP departs from ONNX Runtime's QDQ arithmetic, op by op: the A16W8 prompt graph is cut at every
quantized activation, so each node group (DequantizeLinear -> op -> QuantizeLinear) reads the codes the CPU provider
computed for its inputs and writes its own codes as a graph output. On the HTP emulator every op then runs on the
CPU provider's inputs, and the difference of its output codes is what that op alone departs by. The uncut graph,
every activation exposed, shows how the departures add up through the layers. One held-out chunk with a filled
window (the second prompt-graph call of a dialogue). JSON and a table.

    python -m cabinllm.benchmarks.studies.htp_departure --graphs A16W8_GRAPHS --htp-arch 68
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from cabinllm.benchmarks.studies import write_results
from cabinllm.builders.onnx_export import layer_output
from cabinllm.builders.qnn_quantize import Recording
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine, session_options
from cabinllm.runtime.backends.qnn import HTP_PRECISIONS, htp_session
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.model.tokenizer import ChatTokenizer

CUT = "cut."
# the ops that compute (the rest of the graph moves data: Reshape, Transpose, Split, Concat, Slice, Unsqueeze, Identity)
COMPUTE = {"MatMul", "Mul", "Add", "Neg", "Softmax", "Sigmoid", "RMSNormalization"}  # prefix of the graph input that feeds a cut activation's DequantizeLinear nodes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--graphs", required=True, type=Path, help="A16W8 graph folder (cabin-export, npu profile)")
    parser.add_argument("--htp-arch", type=int, default=68, choices=tuple(HTP_PRECISIONS), help="HTP architecture")
    parser.add_argument("--data", default="sharegpt", help="held-out dialogues: builtin, sharegpt or a file")
    parser.add_argument("--dialogue", type=int, default=0, help="which held-out dialogue (its second chunk runs)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/npu/htp_departure"),
                        help="writes OUTPUT.json and OUTPUT.md")
    return parser.parse_args(argv)


def chunk_feeds(folder: Path, dialogue: list[int]) -> dict[str, np.ndarray]:
    """The prompt graph's inputs for a dialogue's second chunk, its first in the window, as the ONNX backend makes
    them."""
    engine = load_onnx_engine(folder, "cpu", 1)
    model = engine.model
    graph, calls = model.graphs[model.chunk], []
    graph.session = Recording(graph.session, lambda feeds: calls.append({k: np.array(v) for k, v in feeds.items()}))
    ids = dialogue[:2 * model.chunk]
    if len(ids) <= model.chunk:
        raise SystemExit(f"the dialogue has {len(ids)} tokens; choose one longer than a chunk ({model.chunk})")
    run_tokens(model, ids, "int8", engine.scales)
    return calls[1]


def activations(model, moved: bool = False) -> list:
    """The QuantizeLinear nodes of the activations that ops compute (``moved``: and of data they move), not of weights
    or graph inputs."""
    outside = {t.name for t in model.graph.initializer} | {v.name for v in model.graph.input}
    computed = {out for node in model.graph.node if node.op_type in COMPUTE for out in node.output}
    return [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in outside
            and (moved or n.input[0] in computed)]


def labels(model, layers: int) -> dict[str, tuple[int, str]]:
    """Each activation's codes (a QuantizeLinear output) -> (layer, what computed it): the op type, MatMuls split into
    those by a weight and those of two activations."""
    initializers = {t.name for t in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    weight_codes = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"
                    and n.input[0] in initializers}
    ends = {layer_output(i): i for i in range(layers)}
    result, layer = {}, 0
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in initializers:
            continue
        source = producer.get(node.input[0])
        if source is None:
            what = "graph input " + node.input[0]
        elif source.op_type == "MatMul":
            what = "MatMul by weights" if source.input[1] in weight_codes else "MatMul of activations"
        else:
            what = source.op_type
        result[node.output[0]] = (layer, what)
        if node.input[0] in ends:
            layer = ends[node.input[0]] + 1
    return result


def exposed(model, cut: bool, moved: bool = False):
    """A copy of the graph with the codes of the activations ops compute (``moved``: and of the data they move) as
    outputs; ``cut``: the DequantizeLinear nodes before each op that computes read a graph input of their own (data
    movement, lossless, is left without consumers)."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    outputs = {o.name for o in copy.graph.output}
    copy.graph.output.extend([onnx.ValueInfoProto(name=n.output[0]) for n in activations(copy, moved)
                              if n.output[0] not in outputs])
    if cut:  # not the K/V codes moved into attention (uint8): equal on both sides, and the HTP misreads a uint8 graph
        # input that a DequantizeLinear hands straight to a MatMul
        constants = {t.name: t for t in copy.graph.initializer}
        wanted = {n.output[0] for n in activations(copy, moved=True)
                  if constants[n.input[2]].data_type != onnx.TensorProto.UINT8}
        computing = {name for node in copy.graph.node if node.op_type in COMPUTE for name in node.input}
        for node in copy.graph.node:
            if node.op_type == "DequantizeLinear" and node.input[0] in wanted and node.output[0] in computing:
                node.input[0] = CUT + node.input[0]
    return copy


def run_cpu(model, feeds: dict) -> dict[str, np.ndarray]:
    """Every output of a graph on the CPU provider, computing what the QDQ graph states (basic optimizations: the
    extended ones fuse each int8 weight's DequantizeLinear and MatMul into MatMulNBits, which rounds activations)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), session_options(1, quantized=True),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def run_htp(model, feeds: dict, arch: int, codes: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every output of a graph on the HTP (compiled now), with typed graph inputs for the cut activations' codes."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        if codes:
            fed = {name for node in model.graph.node for name in node.input if name.startswith(CUT)}
            codes = {name: array for name, array in codes.items() if CUT + name in fed}
            for name, array in codes.items():
                elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
                model.graph.input.append(onnx.helper.make_tensor_value_info(CUT + name, elem, array.shape))
            feeds = {**feeds, **{CUT + name: array for name, array in codes.items()}}
        path = Path(tmp) / "graph.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, location="graph.bin")
        session = htp_session(path, arch)
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds)))


def departure(ours: np.ndarray, theirs: np.ndarray, scale: float, zero: int) -> dict:
    """How far codes depart from reference codes: in steps (mean, max) and relative to the reference's values."""
    steps = np.abs(ours.astype(np.int64) - theirs.astype(np.int64))
    values = (theirs.astype(np.float64) - zero) * scale
    rms = float(np.sqrt((values ** 2).mean())) or 1.0
    return {"mean_steps": float(steps.mean()), "max_steps": int(steps.max()),
            "share_changed": float((steps > 0).mean()), "relative_rms": float(np.sqrt(((steps * scale) ** 2).mean()) / rms)}


def compare(model, layers: int, ours: dict, theirs: dict) -> list[dict]:
    """The departure of each activation's codes, with its layer (of ``layers``) and op."""
    from onnx import numpy_helper

    constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    names = labels(model, layers)
    rows = []
    for node in activations(model):
        name = node.output[0]
        scale, zero = float(constants[node.input[1]]), int(constants[node.input[2]])
        layer, what = names[name]
        rows.append({"tensor": node.input[0], "layer": layer, "op": what, "dtype": str(theirs[name].dtype), "scale": scale,
                     **departure(ours[name], theirs[name], scale, zero)})
    return rows


def by_op(rows: list[dict]) -> dict[str, dict]:
    """Per op: how many groups, the mean and worst relative departure, the mean and worst steps."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["op"]].append(row)
    return {op: {"groups": len(g), "relative_mean": float(np.mean([r["relative_rms"] for r in g])),
                 "relative_max": max(r["relative_rms"] for r in g),
                 "mean_steps": float(np.mean([r["mean_steps"] for r in g])), "max_steps": max(r["max_steps"] for r in g),
                 "worst_layer": max(g, key=lambda r: r["relative_rms"])["layer"]}
            for op, g in sorted(groups.items(), key=lambda item: -np.mean([r["relative_rms"] for r in item[1]]))}


def table(result: dict) -> str:
    """Markdown tables of the result."""
    rows = [f"HTP v{result['htp_arch']} against ONNX Runtime's CPU provider, one {result['chunk']}-token chunk over "
            f"{result['window_tokens']} window tokens; each op on the CPU provider's input codes (cut graph):", "",
            "| op | groups | relative departure, mean | worst (layer) | mean steps | max steps |",
            "|---|---|---|---|---|---|"]
    for op, s in result["by_op"].items():
        rows.append(f"| {op} | {s['groups']} | {s['relative_mean']:.2e} | {s['relative_max']:.2e} "
                    f"({s['worst_layer']}) | {s['mean_steps']:.3f} | {s['max_steps']} |")
    rows += ["", "Through the layers (uncut graph), each layer's output:", "",
             "| layer | relative departure | mean steps |", "|---|---|---|"]
    for layer, s in enumerate(result["layers"]):
        rows.append(f"| {layer} | {s['relative_rms']:.2e} | {s['mean_steps']:.3f} |")
    rows.append(f"| logits | {result['logits_relative']:.2e} | |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    import onnx

    args = parse_args(argv)
    manifest = json.loads((args.graphs / "manifest.json").read_text())
    model = onnx.load(str(args.graphs / manifest["graphs"]["prompt"]))
    tokenizer = ChatTokenizer(args.graphs / "tokenizer")
    dialogues, _ = prepare_dialogues(args.data, "heldout", args.dialogue + 1, 0, tokenizer, 2 * int(manifest["chunk"]))
    feeds = chunk_feeds(args.graphs, dialogues[args.dialogue].token_ids)
    print("CPU provider: the graph with every activation exposed", file=sys.stderr)
    cpu = run_cpu(exposed(model, cut=False, moved=True), feeds)
    codes = {n.output[0]: cpu[n.output[0]] for n in activations(model, moved=True)}
    print(f"HTP v{args.htp_arch}: the cut graph ({len(codes)} activations), compile and run", file=sys.stderr)
    cut = run_htp(exposed(model, cut=True), feeds, args.htp_arch, codes)
    print(f"HTP v{args.htp_arch}: the uncut graph, compile and run", file=sys.stderr)
    whole = run_htp(exposed(model, cut=False), feeds, args.htp_arch)
    layers = int(manifest["model"]["config"]["num_hidden_layers"])
    local, through = compare(model, layers, cut, cpu), compare(model, layers, whole, cpu)
    ends = {layer_output(i) for i in range(layers)}
    layer_rows = [r for r in through if r["tensor"] in ends]
    logits_rel = float(np.linalg.norm(whole["logits"] - cpu["logits"]) / np.linalg.norm(cpu["logits"]))
    result = {"graphs": str(args.graphs), "htp_arch": args.htp_arch, "chunk": int(manifest["chunk"]),
              "window_tokens": int(manifest["chunk"]), "load_average": os.getloadavg(),
              "by_op": by_op(local), "local": local, "layers": layer_rows, "through": through,
              "logits_relative": logits_rel}
    write_results(args.output, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
