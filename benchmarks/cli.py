"""``cabin-bench``: ours beside the tools a user would pick instead, on one machine, model and prompts, in one run."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from cabinllm.benchmarks.accuracy import load_eval
from cabinllm.benchmarks.bench import PEER_FAMILIES, make_peers, run_bench
from cabinllm.benchmarks.machine import oversubscribed
from cabinllm.benchmarks.plots import write_figures
from cabinllm.benchmarks.results_page import render_markdown
from cabinllm.benchmarks.settings import BenchSettings, quick_settings
from cabinllm.cli.args import add_device_flag, cli_message, entry_point
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import CabinError, ConfigError
from cabinllm.runtime.formats.atomic import atomic_write_text

RESULTS_MD = "RESULTS.md"
RESULTS_JSON = "cabin_bench.json"
FIGURES_DIR = "figures"
DEFAULTS = BenchSettings()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-bench."""
    parser = argparse.ArgumentParser(prog="cabin-bench", description="KV memory, prefill and decode speed, multi-turn "
                                     "TTFT and accuracy of our KV cache modes beside transformers and llama.cpp, "
                                     "on one machine, model and prompt set, in one run.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--engine", type=Path, help="engine folder written by cabin-build")
    source.add_argument("--render", type=Path, help="write RESULTS.md and the figures again from the results JSON "
                                                    "of an earlier run, measuring nothing")
    parser.add_argument("--weights-engines", type=Path, nargs="+", default=[],
                        help="engine folders of the same model with other weights (cabin-build --weights int8 or "
                             "int4-awq): each adds our runners on its weights (default: none)")
    parser.add_argument("--onnx", type=Path, help="graphs cabin-export wrote from the engine: adds our ONNX Runtime "
                                                  "backend (contexts up to the graphs' window; default: none)")
    parser.add_argument("--genai", type=Path, help="onnxruntime-genai's model folder of the same model (its model "
                                                   "builder's output): adds it as a peer (default: none)")
    parser.add_argument("--json", type=Path, help="also write the results JSON here")
    parser.add_argument("--quick", action="store_true", help="two repeats instead of 3, 32 decode tokens per run "
                                                            "instead of 128, one pass of the dialogue instead of 2")
    parser.add_argument("--eval-json", type=Path, help="eval.json of cabin-eval for the accuracy columns")
    parser.add_argument("--out", type=Path, default=Path("benchmarks"),
                        help=f"folder for {RESULTS_MD}, {RESULTS_JSON} and {FIGURES_DIR}/ (default benchmarks)")
    parser.add_argument("--threads", type=int, help="threads for torch and llama.cpp alike (default: torch's, "
                                                    f"now {torch.get_num_threads()})")
    parser.add_argument("--peers", default=",".join(PEER_FAMILIES),
                        help=f"comma-separated peer families, or 'none' (default {','.join(PEER_FAMILIES)})")
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths of the speed test (default: "
                        f"{' '.join(map(str, DEFAULTS.contexts))})")
    parser.add_argument("--repeats", type=int, help=f"repeats of the speed test (default {DEFAULTS.repeats}, "
                        "2 with --quick)")
    parser.add_argument("--decode-steps", type=int, help="greedy decode tokens per run (default "
                        f"{DEFAULTS.decode_steps}, 32 with --quick)")
    parser.add_argument("--turns", type=int, help="dialogue turns, 0 for no multi-turn test "
                        f"(default {DEFAULTS.turns})")
    parser.add_argument("--modes", nargs="+", help=f"our KV modes to measure (default: {' '.join(DEFAULTS.modes)})")
    add_device_flag(parser)
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The quick or full settings with the options given on the command line applied."""
    settings = quick_settings() if args.quick else BenchSettings()
    for name in ("contexts", "repeats", "decode_steps", "turns", "modes"):
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
            settings.overrides.append(name)
    if min(settings.contexts) < 1 or settings.repeats < 1 or settings.decode_steps < 2 or settings.turns < 0:
        raise ConfigError("need contexts >= 1, --repeats >= 1, --decode-steps >= 2 and --turns >= 0")
    return settings


def notes(results: dict) -> list[str]:
    """What a reader must know to read the numbers right."""
    s = results["settings"]
    flush = "include" if s["decode_steps"] >= 128 else "do NOT include"
    out = [
        "llama.cpp runs the GGUF's weights as stored (default model: Q4_1 layers, Q8_0 embeddings, 97 MB); "
        "transformers runs them dequantized to fp32 (over 540 MB), about 6x the bytes read per decoded token; ours "
        "runs the weights each row's Systems entry names (an fp32 engine: the same fp32 tensors; int4-g32 with the "
        "int8 head: the GGUF's own Q4_1 and Q8_0 blocks, llama.cpp's bytes), so a speed ratio compares weights "
        "as well as KV caches. The KV sizes (f16, q8_0) compare KV alone.",
        "Ours stores K/V in the mode named and computes in fp32. A decode step runs on our native C kernels where "
        "a compiler was found (see Machine): a matrix-vector product per linear layer over the engine's weights "
        "(quantized ones converted in registers), and attention that reads fp16/int8 elements in their blocks (int4: dequantized natively first). Prefill "
        "runs torch (MKL) like transformers. transformers' QuantizedCache dequantizes the whole cache every step "
        "and keeps up to 128 new tokens in fp32, "
        f"re-quantizing everything when they flush; runs of {s['decode_steps']} decode tokens {flush} a flush.",
        "Longest context: how many tokens of KV the budget holds (the model's own limit, where lower, in "
        "parenthesis). It counts KV storage only, not weights, activations or the per-layer fp32 copy of the K/V "
        "read that transformers and our prefill (and int4 decode) make.",
        "transformers' times include generate()'s per-call set-up (logits processors, cache creation): what a user "
        "of generate() gets. Its TTFT per turn is generate() on the whole history with max_new_tokens=1.",
        "Decode tok/s, every system alike: the tokens after the first over the time from the first token to the last "
        "(prefill and the first sampling excluded). "
        + ("Every runner had one untimed warm-up run (the shortest context) before the timed repeats."
           if results.get("speed", {}).get("warm_up_runs") else "This run had no warm-up runs."),
        f"Threads: torch.set_num_threads({results['machine']['torch_threads']}) and llama.cpp n_threads equal; on a "
        "machine shared with other jobs, more threads than idle cores make every runner stall on its busy-waiting "
        "workers, so use --threads to match the idle cores.",
    ]
    if results.get("weight_engines"):
        out.append("cabin MODE + W8A16 / + W4A16_AWQ: the same model with weights quantized by ModelOpt "
                   f"(engines {', '.join(results['weight_engines'])}), decode on the quantized-weight kernels; "
                   "llama.cpp runs the GGUF's own quantized weights, so these rows compare weight formats too.")
    if results.get("onnx_graphs"):
        out.append(f"cabin onnxruntime: our runtime (paged cache, reuse, budget) running the graphs in "
                   f"{results['onnx_graphs']} on ONNX Runtime; the graphs attend over their whole fixed window "
                   "whatever the context, and a context beyond the window fails.")
    crowded = oversubscribed(results["machine"])
    if crowded:
        out.insert(0, f"WARNING: {crowded}.")
    if results.get("accuracy"):
        src = results["accuracy"]["source"]
        out.append(f"Accuracy columns: cabin-eval file {src.get('file')} (model {src.get('model', '?')}, scales "
                   f"{src.get('scales', '?')}); shown where cabin-eval has the mode (transformers' default cache is "
                   "fp32 KV, cabin-eval's reference). The quantized peers have no cabin-eval mode.")
    else:
        out.append("No --eval-json given: no accuracy columns.")
    return out


def write_outputs(results: dict, out: Path, json_path: Path | None) -> Path:
    """RESULTS.md, the JSON and the figures under out (and the JSON at json_path too); returns RESULTS.md."""
    out.mkdir(parents=True, exist_ok=True)
    figures = write_figures(results, out / FIGURES_DIR)
    text = json.dumps(results, indent=2)
    atomic_write_text(out / RESULTS_JSON, text)
    if json_path:
        atomic_write_text(json_path, text)
    md = out / RESULTS_MD
    atomic_write_text(md, render_markdown(results, {t: str(p.relative_to(out)) for t, p in figures.items()}))
    return md


def render(path: Path, out: Path) -> int:
    """RESULTS.md and figures from the JSON of an earlier run (its command and numbers unchanged)."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
        results["notes"] = notes(results)
        md = write_outputs(results, out, None)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"cabin-bench: error: {path}: not a cabin-bench results JSON ({err!r})", file=sys.stderr)
        return 2
    print(f"rewrote {md} and {out / FIGURES_DIR}/ from {path}", file=sys.stderr)
    return 0


def same_model(engine: Engine, other: Engine) -> Engine:
    """other, checked to hold the engine's model (its layers and vocabulary) in another weight format."""
    shape = ("num_hidden_layers", "hidden_size", "num_key_value_heads", "vocab_size")
    if [getattr(other.config, k) for k in shape] != [getattr(engine.config, k) for k in shape]:
        raise ConfigError(f"--weights-engines {other.folder} holds another model than --engine {engine.folder}; "
                         "build it from the same --model")
    return other


@entry_point("cabin-bench")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    if args.render:
        return render(args.render, args.out)
    families = [] if args.peers == "none" else [f.strip() for f in args.peers.split(",") if f.strip()]
    try:
        unknown = [f for f in families if f not in PEER_FAMILIES]
        if unknown:
            raise ConfigError(f"unknown --peers {unknown}; choose from {', '.join(PEER_FAMILIES)} or none")
        settings = settings_from(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        evaluation = load_eval(args.eval_json) if args.eval_json else None
        engine = Engine.load(args.engine, args.device)
        weight_engines = [same_model(engine, Engine.load(folder, args.device)) for folder in args.weights_engines]
        peers = make_peers(engine, families, torch.get_num_threads(), args.genai)
        results = run_bench(engine, settings, peers, evaluation, weight_engines, args.onnx)
    except CabinError as err:
        print(f"cabin-bench: error: {cli_message(err)}", file=sys.stderr)
        return 2
    results["command"] = shlex.join(["cabin-bench", *(sys.argv[1:] if argv is None else argv)])
    results["notes"] = notes(results)
    md = write_outputs(results, args.out, args.json)
    print(md.read_text(encoding="utf-8"))
    print(f"results in {md}, {args.out / RESULTS_JSON} and {args.out / FIGURES_DIR}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
