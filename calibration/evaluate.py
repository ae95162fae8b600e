"""Accuracy of KV cache modes against full precision, teacher-forced on held-out dialogues.

For every dialogue the model runs once with an fp32 cache (the reference) and
once per mode with a fresh cache of that mode; each run is one prefill of the
whole dialogue, so every position attends to K/V as the mode stores them.
``int4`` keeps the newest tokens in fp16, so its dialogue is prefilled in
chunks of one block: every position then sees 96 to 127 earlier tokens at full
precision (with the default 128-token window), as in decode, where it sees 127
or more.
Per mode: perplexity of the dialogue's next tokens, mean KL(reference || mode)
of the next-token distributions, and how often the top-1 token agrees.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from calibration.equalize import equalize
from calibration.model_source import LoadedModel
from calibration.selection import TokenizedDialogue
from runtime.kv_cache import KVLayout, KVScales, PagedKVCache
from runtime.kv_scales import ScalesFile
from runtime.model import Transformer

EVAL_MODES = ("fp16", "int8-shared", "int8-separate", "int8-dynamic", "int8-shared-eq", "int4")
CACHE_MODE = {"fp16": "fp16", "int8-shared": "int8", "int8-separate": "int8-separate",
              "int8-dynamic": "int8-dynamic", "int8-shared-eq": "int8", "int4": "int4"}
STATIC_MODES = ("int8-shared", "int8-separate", "int8-shared-eq")
TOKENS_PER_BLOCK = 32
_CHUNK = 256  # rows of logits compared at a time, to bound memory


@dataclass
class ModeResult:
    """Accuracy of one KV mode."""

    ppl: float
    ppl_delta_pct: float
    kl: float
    top1_agree: float
    kv_bytes_per_token: int  # at the mean dialogue length; int4 includes its fp16 window


@dataclass
class ModeRunner:
    """The weights and cache settings one mode runs with."""

    model: Transformer
    cache_mode: str
    scales: KVScales | None


def build_runners(model: LoadedModel, modes: list[str], scales_file: ScalesFile | None) -> dict[str, ModeRunner]:
    """A runner per mode; int8-shared-eq runs on weights equalized from the scales' channel ranges."""
    unknown = [m for m in modes if m not in EVAL_MODES]
    if unknown:
        raise ValueError(f"unknown KV mode(s) {unknown}; choose from {', '.join(EVAL_MODES)}")
    if scales_file is None and any(m in STATIC_MODES for m in modes):
        raise ValueError(f"modes {', '.join(STATIC_MODES)} need calibrated scales; pass --scales or calibrate first")
    if "int8-shared-eq" in modes and scales_file.ranges is None:
        raise ValueError("int8-shared-eq needs per-channel ranges in the scales file (schema version 2); "
                         "re-run cabin-calibrate")
    if scales_file is not None and scales_file.equalized:
        raise ValueError("the scales file belongs to equalized weights; pass the scales of the original model")
    base = model.transformer()
    runners = {}
    for mode in modes:
        if mode == "int8-shared-eq":
            weights, scales = equalize(model.config, model.weights, scales_file.ranges)
            runners[mode] = ModeRunner(Transformer(model.config, weights), "int8", scales)
        else:
            scales = scales_file.scales if mode in STATIC_MODES else None
            runners[mode] = ModeRunner(base, CACHE_MODE[mode], scales)
    return runners


def run_logits(model: Transformer, token_ids: list[int], cache_mode: str, scales: KVScales | None) -> torch.Tensor:
    """Logits (tokens, vocab) of token_ids prefilled over a fresh cache of the given mode (int4: block by block)."""
    layout = model.kv_layout
    blocks = -(-len(token_ids) // TOKENS_PER_BLOCK)
    budget = layout.bytes_per_token(cache_mode, TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK * blocks
    if cache_mode == "int4":
        budget += layout.int4_window_bytes(TOKENS_PER_BLOCK)
    cache = PagedKVCache(layout, cache_mode, budget, TOKENS_PER_BLOCK, scales)
    chunk = TOKENS_PER_BLOCK if cache_mode == "int4" else len(token_ids)
    logits = []
    for start in range(0, len(token_ids), chunk):
        piece = token_ids[start:start + chunk]
        if start == 0:
            cache.allocate(0, piece)
        else:
            cache.append(0, piece)
        logits.append(model.forward(piece, start, cache, 0, all_logits=True))
    return torch.cat(logits)


def stored_bytes_per_token(layout: KVLayout, cache_mode: str, tokens: int) -> int:
    """Bytes per token of a sequence of ``tokens`` tokens, scales and (int4) the fp16 window included."""
    per_token = layout.bytes_per_token(cache_mode, TOKENS_PER_BLOCK)
    if cache_mode != "int4":
        return per_token
    return -(-(per_token * tokens + layout.int4_window_bytes(TOKENS_PER_BLOCK)) // tokens)


@dataclass
class Totals:
    """Sums over the positions of the dialogues seen so far."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0


def accumulate(totals: Totals, ref_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Add one dialogue's NLL, KL and top-1 agreement over its positions that have a next token."""
    for start in range(0, len(targets), _CHUNK):
        rows = slice(start, start + _CHUNK)
        ref, logp = ref_logp[rows], logits[rows].log_softmax(-1)
        totals.nll -= float(logp.gather(1, targets[rows, None]).sum())
        totals.kl += float((ref.exp() * (ref - logp)).sum())
        totals.agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
    totals.tokens += len(targets)


def evaluate(model: LoadedModel, dialogues: list[TokenizedDialogue], modes: list[str],
             scales_file: ScalesFile | None, progress: bool = True) -> dict[str, ModeResult]:
    """Accuracy of each mode over the dialogues, after the ``fp32`` reference itself."""
    runners = build_runners(model, modes, scales_file)
    reference = model.transformer()
    ref_totals, totals = Totals(), {mode: Totals() for mode in modes}
    steps = len(dialogues) * (len(modes) + 1)
    with tqdm(total=steps, desc="evaluating KV modes", unit="run", file=sys.stderr, disable=not progress) as bar:
        for dialogue in dialogues:
            ids = dialogue.token_ids
            targets = torch.tensor(ids[1:])
            ref_logp = run_logits(reference, ids, "fp32", None)[:-1].log_softmax(-1)
            accumulate(ref_totals, ref_logp, ref_logp, targets)
            bar.update()
            for mode, runner in runners.items():
                bar.set_postfix_str(mode)
                logits = run_logits(runner.model, ids, runner.cache_mode, runner.scales)[:-1]
                accumulate(totals[mode], ref_logp, logits, targets)
                bar.update()
    ref_ppl = math.exp(ref_totals.nll / ref_totals.tokens)
    results = {"fp32": ModeResult(ref_ppl, 0.0, 0.0, 1.0, reference.kv_layout.bytes_per_token("fp32"))}
    mean_tokens = round(sum(len(d.token_ids) for d in dialogues) / len(dialogues))
    for mode, t in totals.items():
        ppl = math.exp(t.nll / t.tokens)
        stored = stored_bytes_per_token(runners[mode].model.kv_layout, runners[mode].cache_mode, mean_tokens)
        results[mode] = ModeResult(ppl, 100 * (ppl / ref_ppl - 1), t.kl / t.tokens, t.agree / t.tokens, stored)
    return results


def results_json(results: dict[str, ModeResult]) -> dict:
    """The JSON object of cabin-eval: one entry per mode keyed by mode name."""
    return {mode: asdict(r) for mode, r in results.items()}
