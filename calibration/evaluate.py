"""Accuracy of KV cache modes against full precision, teacher-forced on held-out dialogues.

For every dialogue the model runs once with an fp32 cache (the reference) and
once per mode with a fresh cache of that mode; each run is one prefill of the
whole dialogue, so every position attends to K/V as the mode stores them.
A mode that keeps the newest tokens at higher precision (``int4``'s fp16 window)
is prefilled in chunks of one block (cabinllm.runtime.model.run_tokens.run_tokens): every position
then sees 96 to 127 earlier tokens at full precision (with the default 128-token
window), as in decode, where it sees 127 or more. The modes measured are the
reference engine's KV modes (cabinllm.runtime.kv.modes) under their registry names, plus each
shared-scale mode on weights with KV equalization folded in (``-eq``); a former name of a mode is read as its
current one, and results are keyed by the names asked for.
Per mode: perplexity of the dialogue's next tokens, mean KL(reference || mode)
of the next-token distributions, and how often the top-1 token agrees; KL and
top-1 also per bucket of positions (POSITION_BUCKETS), so drift with dialogue
length shows, and, where the dialogues show pictures, at text and at image positions (a position whose input is
a picture's encoder row); perplexity then counts text targets only (as transformers' labels leave picture tokens
out). Quantized weights (cabinllm.calibration.weight_quant) are measured the same way against the same
reference (fp32 weights, fp32 KV), alone (fp32 KV) and with each KV mode.
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from cabinllm.calibration.equalize import FIRST_TOKEN, equalize
from cabinllm.calibration.selection import TokenizedDialogue
from cabinllm.calibration.stats import POSITION_KINDS
from cabinllm.calibration.weight_quant import stored_bytes
from cabinllm.runtime.errors import ConfigError, Fix, Hint
from cabinllm.runtime.formats.checkpoint import ModelConfig
from cabinllm.runtime.formats.scales_file import KVScales, ScalesFile
from cabinllm.runtime.model.run_tokens import run_tokens
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.cache import DEFAULT_TOKENS_PER_BLOCK
from cabinllm.runtime.kv.modes import KV_MODES, KVMode, kv_mode, kv_mode_name
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.cuda import CudaRunner, check_device, check_kv_mode
from cabinllm.runtime.model.interface import ModelRunner
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import Checkpoint

REFERENCE_MODE = "fp32"
REFERENCE_WEIGHTS = "fp32"
EQUALIZED_SUFFIX = "-eq"
WEIGHTS_SEPARATOR = "/"  # a row of quantized weights is named "<weights>/<KV mode>", e.g. "int4-awq/int8"
_CHUNK = 128  # rows of logits compared at a time, to bound memory
POSITION_BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192))


def bucket_label(bucket: tuple[int, int]) -> str:
    """``0-512``, ``1k-2k``, ...: how tables, JSON and charts name a bucket of positions."""
    def short(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"{short(bucket[0])}-{short(bucket[1])}"


def eval_name(mode_name: str, equalized: bool = False) -> str:
    """The name cabin-eval gives a KV mode: the registry's (with ``-eq`` on equalized weights where asked and the mode
    has a shared scale)."""
    mode = kv_mode(mode_name)
    return mode.name + EQUALIZED_SUFFIX if equalized and mode.shared_scale else mode.name


@dataclass(frozen=True)
class EvalMode:
    """A KV mode as cabin-eval measures it: the cache's storage, on equalized weights or not."""

    kv_mode: KVMode
    equalized: bool = False


EVAL_MODES: dict[str, EvalMode] = {
    eval_name(mode.name, equalized): EvalMode(mode, equalized)
    for mode in KV_MODES.values() if mode.reference and mode.name != REFERENCE_MODE
    for equalized in (False, True) if not equalized or mode.shared_scale}
STATIC_MODES = tuple(name for name, mode in EVAL_MODES.items() if mode.kv_mode.static_scales)


def current_name(name: str) -> str:
    """A result's name as cabin-eval gives it now: a former KV mode name (alone, with ``-eq`` or after
    ``<weights>/``) read as the registry's."""
    weights, separator, mode = name.rpartition(WEIGHTS_SEPARATOR)
    base = mode.removesuffix(EQUALIZED_SUFFIX)
    return weights + separator + kv_mode_name(base) + mode[len(base):]


def eval_mode(name: str) -> EvalMode | None:
    """What cabin-eval measures under ``name`` (a former KV mode name read as the registry's), None if nothing."""
    return EVAL_MODES.get(current_name(name))


@dataclass
class PositionResult:
    """KL and top-1 agreement of one KV mode over the positions of one bucket."""

    kl: float
    top1_agree: float
    tokens: int


@dataclass
class ModeResult:
    """Accuracy of one KV mode; ``by_position`` is keyed by bucket label, buckets without tokens left out."""

    ppl: float
    ppl_delta_pct: float
    kl: float
    top1_agree: float
    kv_bytes_per_token: int  # at the mean dialogue length; int4 includes its fp16 window
    weights: str = REFERENCE_WEIGHTS  # the weights the row ran on (cabinllm.calibration.weight_quant.EVAL_WEIGHTS)
    weight_bytes: int = 0  # their checkpoint bytes, floats as fp16 (cabinllm.calibration.weight_quant.stored_bytes)
    by_position: dict[str, PositionResult] = field(default_factory=dict)
    by_kind: dict[str, PositionResult] = field(default_factory=dict)  # text / image positions, where pictures were


@dataclass
class ModeRunner:
    """The weights and cache settings one mode runs with."""

    model: ModelRunner  # the reference Transformer, or the CUDA runner of one
    kv_mode: KVMode
    scales: KVScales | None
    weights: str = REFERENCE_WEIGHTS
    weight_bytes: int = 0


def build_runners(model: Checkpoint, modes: list[str], scales_file: ScalesFile | None) -> dict[str, ModeRunner]:
    """A runner per mode; an equalized mode runs on weights equalized from the scales' channel ranges (and with the
    first token of the calibration data on the grid when the file names it)."""
    chosen = {name: eval_mode(name) for name in modes}
    unknown = [name for name, mode in chosen.items() if mode is None]
    if unknown:
        raise ConfigError(f"unknown KV mode(s) {unknown}; choose from {', '.join(EVAL_MODES)}")
    if scales_file is None and any(mode.kv_mode.static_scales for mode in chosen.values()):
        raise ConfigError(f"modes {', '.join(STATIC_MODES)} need calibrated scales", (Hint(Fix.SCALES),))
    equalized = [name for name, mode in chosen.items() if mode.equalized]
    if equalized and scales_file.ranges is None:
        raise ConfigError(f"{', '.join(equalized)} need per-channel ranges in the scales file (schema version 2); "
                         "re-run cabin-calibrate")
    if scales_file is not None and scales_file.equalized:
        raise ConfigError("the scales file belongs to equalized weights; pass the scales of the original model")
    base = model.transformer()
    runners = {}
    for name, mode in chosen.items():
        if mode.equalized:
            weights, scales = equalize(model.config, model.weights, scales_file.ranges,
                                       first_token=scales_file.data.get(FIRST_TOKEN))
            runners[name] = ModeRunner(Transformer(model.config, weights), mode.kv_mode, scales)
        else:
            scales = scales_file.scales if mode.kv_mode.static_scales else None
            runners[name] = ModeRunner(base, mode.kv_mode, scales)
    return runners


def weight_runners(weights: dict[str, tuple[ModelConfig, dict[str, torch.Tensor]]], modes: list[str],
                   scales_file: ScalesFile | None) -> dict[str, ModeRunner]:
    """A runner per quantized checkpoint and KV mode (fp32 KV, then each requested mode that runs on unequalized
    weights), named ``<weights>/<KV mode>``."""
    runners = {}
    for name, (config, tensors) in weights.items():
        model, size = Transformer(config, tensors), stored_bytes(tensors)
        for kv in [REFERENCE_MODE] + [m for m in modes if not eval_mode(m).equalized]:
            mode = kv_mode(REFERENCE_MODE) if kv == REFERENCE_MODE else eval_mode(kv).kv_mode
            scales = scales_file.scales if mode.static_scales else None
            runners[f"{name}{WEIGHTS_SEPARATOR}{kv}"] = ModeRunner(model, mode, scales, name, size)
    return runners


def run_logits(model: ModelRunner, dialogue: TokenizedDialogue, mode: KVMode, scales: KVScales | None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Logits (tokens, vocab) of a dialogue (its pictures too) prefilled over a fresh cache of the given mode (on
    ``device``, the model's)."""
    return run_tokens(model, dialogue.token_ids, mode.name, scales, all_logits=True, media=dialogue.media,
                      device=device).logits


def on_device(runners: dict[str, ModeRunner], device: str) -> torch.device:
    """Move each runner's model to ``device`` (cuda: the CUDA runner, each model once; the KV modes checked first);
    the device."""
    where = check_device(device)
    if where.type == "cpu":
        return where
    for runner in runners.values():
        check_kv_mode(runner.kv_mode.name, where)
    moved = {}
    for runner in runners.values():
        if id(runner.model) not in moved:
            moved[id(runner.model)] = CudaRunner.of(runner.model, device)
        runner.model = moved[id(runner.model)]
    return where


def stored_bytes_per_token(layout: KVLayout, mode: KVMode, tokens: int) -> int:
    """Bytes per token of a sequence of ``tokens`` tokens, scales and what the mode reserves (int4's fp16
    window) included."""
    tpb = DEFAULT_TOKENS_PER_BLOCK
    return cdiv(mode.bytes_per_token(layout, tpb) * tokens + mode.reserved_bytes(layout, tpb), tokens)


def _bucket_sums() -> torch.Tensor:
    return torch.zeros(len(POSITION_BUCKETS), dtype=torch.float64)


def _kind_sums() -> torch.Tensor:
    return torch.zeros(len(POSITION_KINDS), dtype=torch.float64)


@dataclass
class Totals:
    """Sums over the positions of the dialogues seen so far, in all and per bucket of positions."""

    nll: float = 0.0
    nll_tokens: int = 0  # the targets perplexity counts (text tokens)
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0
    bucket_kl: torch.Tensor = field(default_factory=_bucket_sums)
    bucket_agree: torch.Tensor = field(default_factory=_bucket_sums)
    bucket_tokens: torch.Tensor = field(default_factory=_bucket_sums)
    kind_kl: torch.Tensor = field(default_factory=_kind_sums)
    kind_agree: torch.Tensor = field(default_factory=_kind_sums)
    kind_tokens: torch.Tensor = field(default_factory=_kind_sums)

    def by_position(self) -> dict[str, PositionResult]:
        """Mean KL and top-1 agreement per bucket that has positions."""
        return {bucket_label(b): PositionResult(float(self.bucket_kl[i] / n), float(self.bucket_agree[i] / n), int(n))
                for i, (b, n) in enumerate(zip(POSITION_BUCKETS, self.bucket_tokens.tolist())) if n > 0}

    def by_kind(self) -> dict[str, PositionResult]:
        """Mean KL and top-1 agreement at text and at image positions; {} where no image position was seen."""
        if not self.kind_tokens[1]:
            return {}
        return {kind: PositionResult(float(self.kind_kl[i] / n), float(self.kind_agree[i] / n), int(n))
                for i, (kind, n) in enumerate(zip(POSITION_KINDS, self.kind_tokens.tolist())) if n > 0}


def _bucket_index(positions: torch.Tensor) -> torch.Tensor:
    """Bucket of each position (len(POSITION_BUCKETS) for a position past the last bucket)."""
    upper = torch.tensor([b[1] for b in POSITION_BUCKETS])
    return torch.searchsorted(upper, positions, right=True)


def accumulate(totals: Totals, ref_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
               kinds: torch.Tensor | None = None) -> torch.Tensor:
    """Add one dialogue's NLL, KL and top-1 agreement over its positions that have a next token (``kinds``: what
    each of its positions, one more than the targets, takes, as POSITION_KINDS' index: a token, a picture's row, a
    clip's); returns the KL of each of those positions."""
    buckets = len(POSITION_BUCKETS)
    kinds = torch.zeros(len(targets) + 1, dtype=torch.long) if kinds is None else kinds
    token_kl = []
    for start in range(0, len(targets), _CHUNK):
        rows = slice(start, start + _CHUNK)
        ref, logp = ref_logp[rows], logits[rows].log_softmax(-1)
        text_target = kinds[start + 1:start + 1 + _CHUNK] == 0
        totals.nll -= float(logp.gather(1, targets[rows, None]).squeeze(1)[text_target].sum())
        totals.nll_tokens += int(text_target.sum())
        kl = (ref.exp() * (ref - logp)).sum(-1).double()
        agree = (ref.argmax(-1) == logp.argmax(-1)).double()
        totals.kl += float(kl.sum())
        token_kl.append(kl)
        totals.agree += int(agree.sum())
        index = _bucket_index(torch.arange(start, start + len(kl)))
        totals.bucket_kl += torch.bincount(index, kl, minlength=buckets + 1)[:buckets]
        totals.bucket_agree += torch.bincount(index, agree, minlength=buckets + 1)[:buckets]
        totals.bucket_tokens += torch.bincount(index, minlength=buckets + 1)[:buckets].double()
        kind = kinds[rows][:len(kl)]
        totals.kind_kl += torch.bincount(kind, kl, minlength=len(POSITION_KINDS))
        totals.kind_agree += torch.bincount(kind, agree, minlength=len(POSITION_KINDS))
        totals.kind_tokens += torch.bincount(kind, minlength=len(POSITION_KINDS)).double()
    totals.tokens += len(targets)
    return torch.cat(token_kl)


def evaluate(model: Checkpoint, dialogues: list[TokenizedDialogue], modes: list[str],
             scales_file: ScalesFile | None, progress: bool = True,
             weights: dict[str, tuple[ModelConfig, dict[str, torch.Tensor]]] | None = None,
             device: str = "cpu") -> dict[str, ModeResult]:
    """Accuracy of each mode over the dialogues, after the ``fp32`` reference itself; with ``weights`` (name ->
    quantized checkpoint of the same model), also of each of them with fp32 KV and with each mode. ``device`` cuda
    runs the modes on the CUDA runner (fp16 weights), the reference staying the fp32 reference engine."""
    runners = build_runners(model, modes, scales_file)
    full_bytes = stored_bytes(model.weights)
    for runner in runners.values():
        runner.weight_bytes = full_bytes
    runners.update(weight_runners(weights or {}, modes, scales_file))
    where = on_device(runners, device)
    vocab = model.config.vocab_size  # an AWQ export pads the vocabulary: its extra logits are left out
    reference = model.transformer()
    ref_totals, totals = Totals(), {mode: Totals() for mode in runners}
    steps = len(dialogues) * (len(runners) + 1)
    with tqdm(total=steps, desc="evaluating KV modes", unit="run", file=sys.stderr, disable=not progress) as bar:
        for dialogue in dialogues:
            targets, kinds = torch.tensor(dialogue.token_ids[1:]), dialogue.kinds()
            ref_logp = run_logits(reference, dialogue, kv_mode(REFERENCE_MODE), None)[:-1].log_softmax(-1)
            accumulate(ref_totals, ref_logp, ref_logp, targets, kinds)
            bar.update()
            for mode, runner in runners.items():
                bar.set_postfix_str(mode)
                logits = run_logits(runner.model, dialogue, runner.kv_mode, runner.scales, where)[:-1, :vocab]
                accumulate(totals[mode], ref_logp, logits, targets, kinds)
                bar.update()
    ref_ppl = math.exp(ref_totals.nll / ref_totals.nll_tokens)
    reference_bytes = stored_bytes_per_token(reference.kv_layout, kv_mode(REFERENCE_MODE), 1)
    results = {REFERENCE_MODE: ModeResult(ref_ppl, 0.0, 0.0, 1.0, reference_bytes, REFERENCE_WEIGHTS, full_bytes,
                                          ref_totals.by_position(), ref_totals.by_kind())}
    mean_tokens = round(sum(len(d.token_ids) for d in dialogues) / len(dialogues))
    for mode, t in totals.items():
        ppl = math.exp(t.nll / t.nll_tokens)
        stored = stored_bytes_per_token(runners[mode].model.kv_layout, runners[mode].kv_mode, mean_tokens)
        results[mode] = ModeResult(ppl, 100 * (ppl / ref_ppl - 1), t.kl / t.tokens, t.agree / t.tokens, stored,
                                   runners[mode].weights, runners[mode].weight_bytes, t.by_position(), t.by_kind())
    return results


def results_json(results: dict[str, ModeResult]) -> dict:
    """The JSON object of cabin-eval: one entry per mode keyed by mode name."""
    return {mode: asdict(r) for mode, r in results.items()}
