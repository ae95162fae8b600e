"""What the NPU's graphs cost in accuracy: teacher-forced perplexity, KL and top-1 agreement on held-out
dialogues of the reference engine with fp32 KV (the base), the reference with INT8 KV (what INT8 KV alone costs),
the A16W8 graphs on ONNX Runtime's CPU provider (which computes what the QDQ graphs state), and the same graphs on
the QNN HTP backend (the emulator on x86_64: slow, so over the first ``--htp-tokens`` tokens only; every run is also
scored on those tokens), for each graph folder given (one per HTP architecture). With the float graphs of
the same export (``--float``: cabin-export --precision fp16 --kv-cache fp32), the relative error of each layer's
output (the residual stream after it) in the A16W8 graph names the layers that cost most. JSON and a table.

    python -m cabinllm.benchmarks.studies.npu_accuracy --engine ENGINE --graphs V68_GRAPHS V73_GRAPHS
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from cabinllm.benchmarks.studies import write_results
from cabinllm.builders.onnx_export import layer_output
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.cli.args import positive_int
from cabinllm.runtime.backends.onnxruntime import HostInputs, load_onnx_engine, session_options
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.onnx_folder import OnnxFolder
from cabinllm.runtime.model.run_tokens import run_tokens



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder the graphs were exported from")
    parser.add_argument("--graphs", required=True, type=Path, nargs="+",
                        help="A16W8 graph folders (cabin-export --htp-arch), each run on the CPU provider and the HTP")
    parser.add_argument("--float", type=Path, help="float graphs of the same window and chunk, fp32 KV, for the "
                                                   "per-layer errors of the first --graphs folder")
    parser.add_argument("--data", default="sharegpt", help="held-out dialogues: builtin, sharegpt or a file")
    parser.add_argument("--num-dialogues", type=positive_int, default=8, help="dialogues")
    parser.add_argument("--max-tokens", type=positive_int, default=512, help="tokens per dialogue at most")
    parser.add_argument("--htp-tokens", type=positive_int, default=1024,
                        help="tokens run on the HTP emulator: the first dialogues' up to this many")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/npu/npu_accuracy"),
                        help="writes OUTPUT.json and OUTPUT.md")
    return parser.parse_args(argv)


def label(folder: Path) -> str:
    """A run's name for a graph folder: its precision and the HTP it was compiled for."""
    manifest = OnnxFolder(folder).manifest()
    arch = manifest.get("qnn", {}).get("htp_arch")
    return f"{manifest['precision']}" + (f"_v{arch}" if arch else "")


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
        sessions[key] = ort.InferenceSession(model.SerializeToString(), session_options(None, key == "a16w8"),
                                             providers=["CPUExecutionProvider"])
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
    rows += ["", "HTP emulator time: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in
                                               result["htp_seconds"].items())]
    if "layer_errors" in result:
        errors = result["layer_errors"]
        added = [errors[0]] + [errors[i] - errors[i - 1] for i in range(1, len(errors))]
        rows += ["", "| layer (the 5 that add most) | relative error of its output (A16W8 vs float, CPU) | added by "
                 "the layer |", "|---|---|---|"]
        for i in sorted(sorted(range(len(errors)), key=lambda i: -added[i])[:5]):
            rows.append(f"| {i} | {errors[i]:.4f} | {added[i]:+.4f} |")
    return "\n".join(rows) + "\n"


def htp_heads(ids_list: list[list[int]], tokens: int) -> list[list[int]]:
    """The first dialogues' heads that hold ``tokens`` tokens in all (at least 2 per dialogue)."""
    heads = []
    for ids in ids_list:
        left = tokens - sum(map(len, heads))
        if left < 2:
            break
        heads.append(ids[:left])
    return heads


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    reference = Engine.load(args.engine)
    names = [label(folder) for folder in args.graphs]
    cpus = [load_onnx_engine(folder, "cpu", 1) for folder in args.graphs]
    context = min(cpu.config.max_position_embeddings for cpu in cpus)
    dialogues, _ = prepare_dialogues(args.data, "heldout", args.num_dialogues, 0, reference.tokenizer,
                                     min(args.max_tokens, context))
    ids_list = [d.token_ids for d in dialogues]
    heads = htp_heads(ids_list, args.htp_tokens)
    parts: dict[str, list[dict]] = defaultdict(list)
    htp_parts: dict[str, list[dict]] = defaultdict(list)
    for index, ids in enumerate(tqdm(ids_list, desc="dialogues (reference, CPU provider)", file=sys.stderr)):
        base = run_tokens(reference.model, ids, "fp32", all_logits=True).logits
        runs = {"reference_fp32_kv": base,
                "reference_int8_kv": run_tokens(reference.model, ids, "int8", reference.scales, all_logits=True).logits}
        runs.update({f"{name}_cpu": run_tokens(cpu.model, ids, "int8", cpu.scales, all_logits=True).logits
                     for name, cpu in zip(names, cpus)})
        for name, logits in runs.items():
            parts[name].append(scores(base, logits, ids))
            if index < len(heads):
                n = len(heads[index])
                htp_parts[name].append(scores(base[:n], logits[:n], heads[index]))
        if index < len(heads):
            htp_parts["base"].append({"logits": base[:len(heads[index])]})
    htp_seconds = {}
    for name, folder in zip(names, args.graphs):
        start = time.perf_counter()
        htp = load_onnx_engine(folder, "qnn", 1)
        for head, base in zip(heads, tqdm([p["logits"] for p in htp_parts["base"]], desc=f"{name} on the HTP",
                                          file=sys.stderr)):
            logits = run_tokens(htp.model, head, "int8", htp.scales, all_logits=True).logits
            htp_parts[f"{name}_htp"].append(scores(base, logits, head))
        htp_seconds[name] = round(time.perf_counter() - start, 1)
        del htp
    del htp_parts["base"]
    result = {"engine": str(args.engine), "graphs": [str(g) for g in args.graphs], "data": args.data,
              "dialogues": len(ids_list), "threads": 1, "load_average": os.getloadavg(), "htp_seconds": htp_seconds,
              "all": {name: summary(p) for name, p in parts.items()},
              "htp_tokens": {name: summary(p) for name, p in htp_parts.items()}}
    if args.float:
        result["layer_errors"] = layer_errors(OnnxFolder(args.graphs[0]), OnnxFolder(args.float), reference, ids_list)
    result["load_average_after"] = os.getloadavg()
    write_results(args.output, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
