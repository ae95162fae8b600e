"""What the NPU's graphs cost in accuracy: teacher-forced perplexity, KL and top-1 agreement on held-out
dialogues of the reference engine with fp32 KV (the base), the reference with INT8 KV (what INT8 KV alone costs),
the A16W8 graphs on ONNX Runtime's CPU provider, and the same graphs on the QNN HTP backend (the emulator on
x86_64: slow, so over the first tokens only; every run is also scored on those tokens). With the float graphs of
the same export (``--float``: cabin-export --precision fp16 --kv-cache fp32), the relative error of each layer's
output (the residual stream after it) in the A16W8 graph names the layers that cost most. JSON and a table.

    python -m cabinllm.benchmarks.studies.npu_accuracy --engine ENGINE --graphs A16W8_GRAPHS [--float FLOAT_GRAPHS]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from cabinllm.builders.onnx_export import layer_output
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.cli.args import positive_int
from cabinllm.runtime.backends.onnxruntime import HostInputs, load_onnx_engine
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.atomic import atomic_write_text
from cabinllm.runtime.formats.onnx_folder import OnnxFolder
from cabinllm.runtime.model.run_tokens import run_tokens

RUNS = ("reference_int8_kv", "a16w8_cpu", "a16w8_htp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder the graphs were exported from")
    parser.add_argument("--graphs", required=True, type=Path, help="A16W8 graph folder (cabin-export --htp-arch)")
    parser.add_argument("--float", type=Path, help="float graphs of the same window and chunk, fp32 KV, for the "
                                                   "per-layer errors")
    parser.add_argument("--data", default="sharegpt", help="held-out dialogues: builtin, sharegpt or a file")
    parser.add_argument("--num-dialogues", type=positive_int, default=8, help="dialogues")
    parser.add_argument("--max-tokens", type=positive_int, default=512, help="tokens per dialogue at most")
    parser.add_argument("--htp-tokens", type=positive_int, default=128,
                        help="tokens of the first dialogue run on the HTP emulator")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/npu_accuracy"),
                        help="writes OUTPUT.json and OUTPUT.md")
    return parser.parse_args(argv)


def scores(base: torch.Tensor, logits: torch.Tensor, ids: list[int]) -> dict:
    """Summed NLL of the next tokens, summed KL(base || run) and top-1 agreements with the base, and the count."""
    targets = torch.tensor(ids[1:])
    logp, base_logp = logits[:-1].float().log_softmax(-1), base[:-1].float().log_softmax(-1)
    return {"nll": -float(logp.gather(1, targets[:, None]).sum()),
            "kl": float((base_logp.exp() * (base_logp - logp)).sum()),
            "top1": int((logp.argmax(-1) == base_logp.argmax(-1)).sum()), "n": len(ids) - 1}


def summary(parts: list[dict]) -> dict:
    """Perplexity, mean KL and top-1 agreement of summed scores."""
    n = sum(p["n"] for p in parts)
    return {"perplexity": math.exp(sum(p["nll"] for p in parts) / n), "kl": sum(p["kl"] for p in parts) / n,
            "top1": sum(p["top1"] for p in parts) / n, "tokens": n}


def layer_errors(quantized: OnnxFolder, floats: OnnxFolder, engine: Engine, dialogues: list[list[int]]) -> list[float]:
    """Relative error (Frobenius) of each layer's output in the A16W8 prompt graph against the float one, over the
    first chunk of each dialogue, both on the CPU provider."""
    import onnx
    import onnxruntime as ort

    manifest = quantized.manifest()
    layers, chunk, context = engine.config.num_hidden_layers, int(manifest["chunk"]), int(manifest["context"])
    names = [layer_output(i) for i in range(layers)]
    sessions = {}
    for key, folder in (("a16w8", quantized), ("float", floats)):  # loaded whole: no file beside the user's
        model = onnx.load(str(folder.path / manifest["graphs"]["prompt"]))
        model.graph.output.extend([onnx.ValueInfoProto(name=name) for name in names])
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        sessions[key] = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    host = HostInputs(quantized, engine.config)
    squared = np.zeros((2, layers))
    for ids in dialogues:
        piece = ids[:chunk]
        padded, positions = np.zeros((1, chunk), np.int64), np.arange(chunk, dtype=np.int64)[None]
        padded[0, :len(piece)] = piece
        mask = np.full((1, 1, chunk, context + chunk), float(manifest["attention_mask_value"]), np.float32)
        mask[0, 0, :, context:] = np.triu(mask[0, 0, :, context:], k=1)  # causal over the new tokens
        feeds = {**host.feeds(padded, positions, mask, context, float(manifest["attention_mask_value"])),
                 "attention_mask": mask}
        outputs = {}
        for key, session in sessions.items():
            fed = dict(feeds)
            for value in session.get_inputs():
                if value.name.startswith("past_"):  # an empty window: codes of 0 (uint8 128) or float 0
                    dtype = np.uint8 if value.type == "tensor(uint8)" else np.float32
                    fed[value.name] = np.full(value.shape, 128 if dtype is np.uint8 else 0, dtype)
            outputs[key] = session.run(names, fed)
        for layer in range(layers):
            ours, theirs = outputs["a16w8"][layer][0, :len(piece)], outputs["float"][layer][0, :len(piece)]
            squared[:, layer] += (float(((ours - theirs) ** 2).sum()), float((theirs ** 2).sum()))
    return (np.sqrt(squared[0] / squared[1])).tolist()


def table(result: dict) -> str:
    """Markdown tables of the result."""
    rows = ["| run | tokens | perplexity | vs base | KL | top-1 |", "|---|---|---|---|---|---|"]
    for scope in ("all", "htp_tokens"):
        base = result[scope]["reference_fp32_kv"]["perplexity"]
        for name, s in result[scope].items():
            rows.append(f"| {name}{' (HTP tokens)' if scope == 'htp_tokens' else ''} | {s['tokens']:,} | "
                        f"{s['perplexity']:.4f} | {100 * (s['perplexity'] / base - 1):+.2f}% | {s['kl']:.4f} | "
                        f"{100 * s['top1']:.2f}% |")
    if "layer_errors" in result:
        errors = result["layer_errors"]
        added = [errors[0]] + [errors[i] - errors[i - 1] for i in range(1, len(errors))]
        rows += ["", "| layer (the 5 that add most) | relative error of its output (A16W8 vs float, CPU) | added by "
                 "the layer |", "|---|---|---|"]
        for i in sorted(sorted(range(len(errors)), key=lambda i: -added[i])[:5]):
            rows.append(f"| {i} | {errors[i]:.4f} | {added[i]:+.4f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    reference = Engine.load(args.engine)
    cpu, htp = load_onnx_engine(args.graphs, "cpu", 1), load_onnx_engine(args.graphs, "qnn", 1)
    context = cpu.config.max_position_embeddings
    dialogues, _ = prepare_dialogues(args.data, "heldout", args.num_dialogues, 0, reference.tokenizer,
                                     min(args.max_tokens, context))
    ids_list = [d.token_ids for d in dialogues]
    parts: dict[str, list[dict]] = {name: [] for name in ("reference_fp32_kv", *RUNS)}
    htp_parts: dict[str, dict] = {}
    for index, ids in enumerate(tqdm(ids_list, desc="dialogues", file=sys.stderr)):
        base = run_tokens(reference.model, ids, "fp32", all_logits=True).logits
        runs = {"reference_fp32_kv": base,
                "reference_int8_kv": run_tokens(reference.model, ids, "int8", reference.scales, all_logits=True).logits,
                "a16w8_cpu": run_tokens(cpu.model, ids, "int8", cpu.scales, all_logits=True).logits}
        for name, logits in runs.items():
            parts[name].append(scores(base, logits, ids))
        if index == 0:
            head = ids[:args.htp_tokens]
            runs["a16w8_htp"] = run_tokens(htp.model, head, "int8", htp.scales, all_logits=True).logits
            htp_parts = {name: summary([scores(base[:len(head)], logits[:len(head)], head)])
                         for name, logits in runs.items()}
    result = {"engine": str(args.engine), "graphs": str(args.graphs), "data": args.data, "dialogues": len(ids_list),
              "threads": 1, "load_average": os.getloadavg(),
              "all": {name: summary(p) for name, p in parts.items() if p}, "htp_tokens": htp_parts}
    if args.float:
        result["layer_errors"] = layer_errors(OnnxFolder(args.graphs), OnnxFolder(args.float), reference, ids_list)
    result["load_average_after"] = os.getloadavg()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.output.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    atomic_write_text(args.output.with_suffix(".md"), table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
