"""Which weights of the A16W8 graphs cost most, and the cheapest set to store in 16 bits: each candidate (a layer's
attention linears, its MLP linears, its norms' scales; the LM head; the final norm) that the HTP architecture runs in
16 bits is stored so alone and scored against the reference engine with fp32 KV (teacher-forced perplexity, KL,
top-1) on the CPU provider, which computes what the QDQ graph states; candidates are ranked by KL removed per byte
added, and the shortest head of that ranking that meets the targets within the size budget is the plan (found by
doubling, then bisection). Dialogues come from the calibration split, not the held-out one the accuracy study scores.
Writes the plan (for cabin-export --precision-plan) and the ranking as JSON and a table.

    python -m cabinllm.benchmarks.studies.npu_sensitivity --graphs A16W8 --float FLOAT --htp-arch 73
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from cabinllm.benchmarks.studies import write_results
from cabinllm.benchmarks.studies.npu_accuracy import scores, summary
from cabinllm.builders.qnn_precision import W16_OPS, PrecisionPlan, apply_plan, weight_ops
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.cli.args import positive_int
from cabinllm.runtime.backends.onnxruntime import load_onnx_engine, session_options
from cabinllm.runtime.backends.qnn import HTP_PRECISIONS
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.formats.atomic import atomic_write_text
from cabinllm.runtime.model.run_tokens import run_tokens

# a candidate's name -> the float weights it holds, by the name's end (layers.L.<end>)
GROUPS = {"attention": ("qkv", "dense"), "mlp": ("fc_gate", "proj"), "norms": ("input_norm", "post_norm",
                                                                                "pre_ff_norm", "post_ff_norm")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine folder the graphs were exported from")
    parser.add_argument("--graphs", required=True, type=Path, help="A16W8 graph folder (cabin-export)")
    parser.add_argument("--float", required=True, type=Path,
                        help="float graphs of the same export (cabin-export --precision fp16 --kv-cache fp32): the "
                             "weights' float values")
    parser.add_argument("--htp-arch", type=int, required=True, choices=tuple(HTP_PRECISIONS),
                        help="the HTP the plan is for: which weights it runs in 16 bits")
    parser.add_argument("--data", default="sharegpt", help="dialogues (their calibration split)")
    parser.add_argument("--num-dialogues", type=positive_int, default=4, help="dialogues")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="tokens per dialogue at most")
    parser.add_argument("--max-ppl-increase", type=float, default=1.5,
                        help="target: perplexity over the fp32-KV reference's, percent")
    parser.add_argument("--min-top1", type=float, default=96.0, help="target: top-1 agreement, percent")
    parser.add_argument("--max-growth", type=float, default=0.3,
                        help="size budget: added bytes as a fraction of the A16W8 weights")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/npu/npu_sensitivity"),
                        help="writes OUTPUT.json, OUTPUT.md and the plan OUTPUT.plan.json")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class Candidate:
    """Weights stored in 16 bits together, and the bytes that adds."""

    name: str
    weights: tuple[str, ...]
    added_bytes: int


def candidates(model, floats: dict[str, np.ndarray], htp_arch: int) -> list[Candidate]:
    """Every group of the graph's quantized weights that the architecture runs in 16 bits."""
    ops = {name: op for name, op in weight_ops(model).items() if op in W16_OPS[htp_arch]}
    groups: dict[str, list[str]] = {}
    for name in ops:
        parts = name.split(".")
        if parts[0] == "layers":
            kind = next((k for k, ends in GROUPS.items() if parts[-1] in ends), parts[-1])
            groups.setdefault(f"layers.{parts[1]}.{kind}", []).append(name)
        else:
            groups.setdefault(name, []).append(name)
    return [Candidate(group, tuple(names), sum(floats[n].size for n in names)) for group, names in groups.items()]


class Scorer:
    """Teacher-forced scores of prompt graphs (ModelProtos) on the CPU provider over fixed dialogues."""

    def __init__(self, graphs: Path, engine: Engine, dialogues: list[list[int]]) -> None:
        self.engine, self.dialogues = load_onnx_engine(graphs, "cpu", 1), dialogues
        self.bases = [run_tokens(engine.model, ids, "fp32", all_logits=True).logits for ids in dialogues]

    def __call__(self, model) -> dict:
        """Perplexity, KL and top-1 of a prompt graph against the fp32-KV reference."""
        import onnxruntime as ort

        ort_model = self.engine.model
        ort_model.graphs[ort_model.chunk].session = ort.InferenceSession(
            model.SerializeToString(), session_options(1, quantized=True), providers=["CPUExecutionProvider"])
        ort_model.window_cache = None
        return summary([scores(base, run_tokens(ort_model, ids, "int8", self.engine.scales, all_logits=True).logits,
                               ids) for base, ids in zip(self.bases, self.dialogues)])


def with_plan(model, floats: dict[str, np.ndarray], weights: list[str]):
    """A copy of a graph with these weights in 16 bits."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    apply_plan(copy, floats, PrecisionPlan(tuple(weights)))
    return copy


def meets(result: dict, base: float, args: argparse.Namespace) -> bool:
    """Whether a result meets the targets."""
    return 100 * (result["perplexity"] / base - 1) <= args.max_ppl_increase and 100 * result["top1"] >= args.min_top1


def choose(ranked: list[dict], evaluate, fits) -> tuple[int, dict[int, dict]]:
    """The fewest of the ranked candidates whose union meets the targets (doubling, then bisection), or all that fit
    the budget; the evaluations made, by count."""
    tried: dict[int, dict] = {}
    most = max([k for k in range(len(ranked) + 1) if fits(k)])
    k = 1
    while k < most and not (tried.setdefault(k, evaluate(k)))["meets"]:
        k *= 2
    k = min(k, most)
    if k not in tried:
        tried[k] = evaluate(k)
    if not tried[k]["meets"]:
        return k, tried
    low = max([j for j in tried if j < k and not tried[j]["meets"]], default=0)
    while k - low > 1:
        middle = (low + k) // 2
        tried[middle] = evaluate(middle)
        low, k = (low, middle) if tried[middle]["meets"] else (middle, k)
    return k, tried


def table(result: dict) -> str:
    """Markdown tables of the result."""
    rows = [f"HTP v{result['htp_arch']}; {result['tokens']:,} tokens of {result['data']} (calibration split), CPU "
            "provider; base: the reference engine with fp32 KV", "",
            "| graphs | weights in 16 bits | added MB | perplexity | vs base | KL | top-1 |", "|---|---|---|---|---|---|---|"]
    base = result["base_perplexity"]
    for label, entry in [("A16W8", result["a16w8"])] + [(f"+ the first {k}", v) for k, v in
                                                          sorted(result["tried"].items(), key=lambda kv: int(kv[0]))]:
        s = entry["scores"]
        rows.append(f"| {label} | {entry.get('count', 0)} | {entry.get('added_bytes', 0) / 1e6:.1f} | "
                    f"{s['perplexity']:.4f} | {100 * (s['perplexity'] / base - 1):+.2f}% | {s['kl']:.4f} | "
                    f"{100 * s['top1']:.2f}% |")
    rows += ["", f"Plan: {len(result['plan']['w16'])} weight tensors in 16 bits ({result['chosen']} candidates), "
             f"+{result['plan_added_bytes'] / 1e6:.1f} MB ({100 * result['plan_added_bytes'] / result['weight_bytes']:.1f}% "
             f"of the A16W8 weights); meets the targets: {result['meets']}", "",
             "| rank | candidate | KL removed alone | added MB | KL removed per MB |", "|---|---|---|---|---|"]
    for i, c in enumerate(result["ranking"][:15], 1):
        rows.append(f"| {i} | {c['name']} | {c['gain']:.5f} | {c['added_bytes'] / 1e6:.3f} | "
                    f"{c['gain'] / max(c['added_bytes'], 1) * 1e6:.5f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    import onnx
    from onnx import numpy_helper

    args = parse_args(argv)
    torch.set_num_threads(1)
    reference = Engine.load(args.engine)
    manifest = json.loads((args.graphs / "manifest.json").read_text())
    model = onnx.load(str(args.graphs / manifest["graphs"]["prompt"]))
    floats = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(args.float / "prompt.onnx")).graph.initializer}
    dialogues, _ = prepare_dialogues(args.data, "train", args.num_dialogues, 1, reference.tokenizer, args.max_tokens)
    ids_list = [d.token_ids for d in dialogues]
    score = Scorer(args.graphs, reference, ids_list)
    base = summary([scores(b, b, ids) for b, ids in zip(score.bases, ids_list)])["perplexity"]
    plain = score(model)
    weight_bytes = (args.graphs / manifest["weights"]).stat().st_size
    ranking = []
    for c in tqdm(candidates(model, floats, args.htp_arch), desc="candidates alone", file=sys.stderr):
        alone = score(with_plan(model, floats, list(c.weights)))
        ranking.append({"name": c.name, "weights": list(c.weights), "added_bytes": c.added_bytes,
                        "gain": plain["kl"] - alone["kl"], "scores": alone})
    ranking.sort(key=lambda c: -c["gain"] / max(c["added_bytes"], 1))
    ranking = [c for c in ranking if c["gain"] > 0]
    added = np.cumsum([0] + [c["added_bytes"] for c in ranking])

    def evaluate(k: int) -> dict:
        result = score(with_plan(model, floats, [w for c in ranking[:k] for w in c["weights"]]))
        return {"count": k, "added_bytes": int(added[k]), "scores": result, "meets": meets(result, base, args)}

    chosen, tried = choose(ranking, evaluate, lambda k: added[k] <= args.max_growth * weight_bytes)
    plan = PrecisionPlan(tuple(w for c in ranking[:chosen] for w in c["weights"]),
                         f"npu_sensitivity --htp-arch {args.htp_arch} --max-ppl-increase {args.max_ppl_increase} "
                         f"--min-top1 {args.min_top1} --max-growth {args.max_growth} on {args.graphs.name}")
    result = {"graphs": str(args.graphs), "htp_arch": args.htp_arch, "data": args.data,
              "tokens": sum(len(ids) - 1 for ids in ids_list), "base_perplexity": base, "load_average": os.getloadavg(),
              "a16w8": {"scores": plain}, "weight_bytes": weight_bytes, "ranking": ranking,
              "tried": {str(k): v for k, v in tried.items()}, "chosen": chosen, "plan": plan.to_dict(),
              "plan_added_bytes": int(added[chosen]), "meets": tried[chosen]["meets"]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.output.with_suffix(".plan.json"), json.dumps(plan.to_dict(), indent=1) + "\n")
    write_results(args.output, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
