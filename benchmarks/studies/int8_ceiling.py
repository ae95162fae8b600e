"""How close INT8 K/V can come to full precision when only K or only V is quantized.

Static per-channel scales (K per RoPE pair, from a calibration's channel clips)
are the best that equalization folded into the weights can reach with
TensorRT-LLM's one scale per layer; dynamic per-token scales are what a runtime
scale gives. Quantization is simulated on an fp32 cache whose writes are
rounded to INT8 and back, so one side (K or V) can stay exact. Teacher-forced on
held-out dialogues against the fp32 reference, like cabin-eval.

    python -m cabinllm.benchmarks.studies.int8_ceiling --scales kv_scales.json --num-dialogues 3
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from cabinllm.calibration.equalize import calibrated_ranges, rope_pair_max
from cabinllm.calibration.evaluate import Totals, accumulate
from cabinllm.calibration.selection import prepare_dialogues
from cabinllm.runtime.formats.scales_file import LayerRanges, load_scales_file
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.kv.cache import PagedKVCache, sized_config
from cabinllm.runtime.kv.quant import INT8_MAX, dequantize_per_token, quantize_per_token
from cabinllm.runtime.kv.storage import Fp32KV
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import load_model

Quantizer = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, x of (tokens, kv_heads, head_size)) -> x rounded


def channel_steps(ranges: list[LayerRanges]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """INT8 steps per layer, (kv_heads, head_size), for K (equal within a RoPE pair) and V."""
    k_steps, v_steps = [], []
    for layer in ranges:
        k, v = calibrated_ranges(layer)
        k_steps.append((rope_pair_max(k) / INT8_MAX).float())
        v_steps.append((v / INT8_MAX).float())
    return k_steps, v_steps


def static_per_channel(steps: list[torch.Tensor]) -> Quantizer:
    """Round to INT8 with a fixed step per channel."""
    return lambda layer, x: torch.clamp(torch.round(x / steps[layer]), -INT8_MAX, INT8_MAX) * steps[layer]


def dynamic_per_token(layer: int, x: torch.Tensor) -> torch.Tensor:
    """Round to INT8 with one step per token and KV head (the int8-dynamic cache mode)."""
    return dequantize_per_token(*quantize_per_token(x))


def exact(layer: int, x: torch.Tensor) -> torch.Tensor:
    """Leave x as it is."""
    return x


class RoundingKV(Fp32KV):
    """fp32 storage whose writes pass K and V through a quantizer first."""

    def __init__(self, *args, k_quantizer: Quantizer, v_quantizer: Quantizer) -> None:
        super().__init__(*args)
        self.k_quantizer, self.v_quantizer = k_quantizer, v_quantizer

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the rounded K/V."""
        super().write(layer, slots, self.k_quantizer(layer, k), self.v_quantizer(layer, v))


def variants(ranges: list[LayerRanges]) -> dict[str, tuple[Quantizer, Quantizer]]:
    """The K and V quantizers of each measured variant."""
    k_steps, v_steps = channel_steps(ranges)
    k_static, v_static = static_per_channel(k_steps), static_per_channel(v_steps)
    return {
        "K static per-channel, V exact": (k_static, exact),
        "K dynamic per-token, V exact": (dynamic_per_token, exact),
        "K exact, V static per-channel": (exact, v_static),
        "K and V static per-channel": (k_static, v_static),
    }


def measure(model: Transformer, token_lists: list[list[int]], ranges: list[LayerRanges]) -> dict[str, dict]:
    """Perplexity change, KL and top-1 agreement of each variant against the fp32 cache."""
    chosen = variants(ranges)
    reference, totals = Totals(), {name: Totals() for name in chosen}
    with tqdm(total=len(token_lists) * (len(chosen) + 1), desc="int8 ceiling", unit="run", file=sys.stderr) as bar:
        for ids in token_lists:
            targets = torch.tensor(ids[1:])
            ref_logp = run_tokens(model, ids, all_logits=True).logits[:-1].log_softmax(-1)
            accumulate(reference, ref_logp, ref_logp, targets)
            bar.update()
            for name, (k_quantizer, v_quantizer) in chosen.items():
                cache = PagedKVCache(model.kv_layout, sized_config(model.kv_layout, "fp32", len(ids)), None, RoundingKV,
                                     k_quantizer=k_quantizer, v_quantizer=v_quantizer)
                logits = run_tokens(model, ids, all_logits=True, cache=cache).logits
                accumulate(totals[name], ref_logp, logits[:-1], targets)
                bar.update()
    ref_nll = reference.nll / reference.nll_tokens
    return {name: {"ppl_delta_pct": 100 * (math.exp(t.nll / t.nll_tokens - ref_nll) - 1), "kl": t.kl / t.tokens,
                   "top1_agree": t.agree / t.tokens} for name, t in totals.items()}


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the table, and the JSON with --json."""
    parser = argparse.ArgumentParser(prog="python -m cabinllm.benchmarks.studies.int8_ceiling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' or an engine / checkpoint folder")
    parser.add_argument("--scales", type=Path, required=True, help="kv_scales.json of cabin-calibrate (version 2)")
    parser.add_argument("--data", default="sharegpt", help="'builtin', 'sharegpt' or a dialogue file")
    parser.add_argument("--num-dialogues", type=int, default=3, help="held-out dialogues (default 3)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per dialogue at most (default 2048)")
    parser.add_argument("--min-tokens", type=int, default=2048, help="tokens per dialogue at least (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="selects the dialogues (default 0)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    config = model.config
    scales = load_scales_file(args.scales, model.fingerprint, config.num_hidden_layers,
                              (config.num_key_value_heads, config.head_size))
    if scales.ranges is None or scales.equalized:
        print("int8_ceiling: error: needs per-channel ranges of the original model (kv_scales.json version 2 "
              "from cabin-calibrate, not an equalized engine's)", file=sys.stderr)
        return 2
    dialogues, data = prepare_dialogues(args.data, "heldout", args.num_dialogues, args.seed, model.tokenizer,
                                        args.max_tokens, args.min_tokens)
    results = measure(model.transformer(), [d.token_ids for d in dialogues], scales.ranges)
    print(f"{data['dialogues']} held-out dialogues of {args.data}, {data['tokens']} tokens")
    print(f"{'variant':<32}{'ppl vs fp32':>12}{'KL':>10}{'top-1 agree':>13}")
    for name, r in results.items():
        print(f"{name:<32}{r['ppl_delta_pct']:>+11.2f}%{r['kl']:>10.5f}{100 * r['top1_agree']:>12.2f}%")
    if args.json:
        args.json.write_text(json.dumps({"data": data, "variants": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
