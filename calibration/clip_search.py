"""Clips chosen by what the user sees: each candidate rule's clips, folded into equalized weights, are scored by
the next-token KL of ``int8-eq`` against full precision on a validation part of the calibration data.

The candidates reuse the collected statistics (a clip rule is a few histogram reads), so a candidate costs one
teacher-forced run over the validation tokens; the reference runs once. Per-tensor quantization error is a
candidate rule, not the score: which clips lose least depends on what equalization does with them (least-error
clips were the worst rule on held-out dialogues before the first token was stored exactly, and are within the
noise of the abs-max now),
so the KL decides, and the first candidate holds unless a later one is clearly better.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from cabinllm.calibration.clips import LayerClips, compute_clips, layer_ranges
from cabinllm.calibration.equalize import equalize
from cabinllm.calibration.evaluate import Totals, accumulate, run_logits
from cabinllm.calibration.selection import TokenizedDialogue
from cabinllm.calibration.stats import KVStats
from cabinllm.runtime.kv.modes import kv_mode
from cabinllm.runtime.model.transformer import Transformer
from cabinllm.runtime.sources.model_source import Checkpoint

SEARCH_METHOD = "kl"  # cabin-calibrate's name for choosing among CANDIDATES by validation KL


@dataclass(frozen=True)
class ClipRule:
    """How every layer's (and channel's) clip is read from the statistics: a method of cabinllm.calibration.clips."""

    method: str
    percentile: float = 100.0

    @property
    def name(self) -> str:
        """``max``, ``percentile-99.99``: as kv_scales.json records a method."""
        return f"percentile-{self.percentile:g}" if self.method == "percentile" else self.method

    def clips(self, stats: KVStats) -> LayerClips:
        """The clips this rule reads from the statistics."""
        return compute_clips(stats, self.method, self.percentile)


# Measured on the default model's validation part (KL of int8-eq): per-channel least-error (mse) clips
# 0.00094, abs-max 0.00097, percentile 99.99 0.00103, percentile 99.9 0.00154, 1.25 x the abs-max 0.00165; on the
# held-out grade part mse 0.00111 against abs-max 0.00116 (both gains within the noise: z = -1.28 on the
# validation part, so the abs-max holds). The last three never won and each cost a run of the calibration's
# 2-minute budget, so the search keeps the two that compete.
CANDIDATES = (ClipRule("max"), ClipRule("mse"))
MIN_Z = 2.0  # a later candidate replaces the one holding when its paired KL gain is this many standard errors


@dataclass
class CandidateScore:
    """One candidate's next-token KL and top-1 agreement (int8-eq vs fp32) on the validation tokens."""

    rule: str
    kl: float
    top1_agree: float


def reference_logprobs(model: Transformer, dialogues: list[TokenizedDialogue]) -> list[torch.Tensor]:
    """Full-precision next-token log-probabilities of each validation dialogue."""
    return [run_logits(model, d, kv_mode("fp32"), None)[:-1].log_softmax(-1) for d in dialogues]


def score_clips(model: Checkpoint, stats: KVStats, clips: LayerClips, dialogues: list[TokenizedDialogue],
                references: list[torch.Tensor], first_token: int | None = None) -> tuple[Totals, torch.Tensor]:
    """KL and top-1 sums of int8-eq with these clips over the validation dialogues, and the KL of every
    validation position (``first_token``: the token equalization puts on the grid, cabinllm.calibration.equalize)."""
    weights, scales = equalize(model.config, model.weights, layer_ranges(stats, clips), first_token=first_token)
    equalized = Transformer(model.config, weights)
    totals, token_kl = Totals(), []
    for dialogue, reference in zip(dialogues, references):
        logits = run_logits(equalized, dialogue, kv_mode("int8"), scales)[:-1]
        token_kl.append(accumulate(totals, reference, logits, torch.tensor(dialogue.token_ids[1:]),
                                   dialogue.kinds()))
    return totals, torch.cat(token_kl)


def clearly_lower(token_kl: torch.Tensor, than: torch.Tensor) -> bool:
    """Whether the KL of the same positions is lower by more than MIN_Z standard errors of their paired differences."""
    difference = (token_kl - than).double()
    return bool(difference.mean() < -MIN_Z * difference.std() / len(difference) ** 0.5)


def choose_clips(model: Checkpoint, stats: KVStats, dialogues: list[TokenizedDialogue],
                 candidates: tuple[ClipRule, ...] = CANDIDATES, progress: bool = True,
                 first_token: int | None = None) -> tuple[ClipRule, LayerClips, list[CandidateScore]]:
    """The chosen candidate, its clips and every score. The first candidate holds unless a later one's validation
    KL is clearly lower (clearly_lower, against the one holding), so a difference within the noise of the
    validation part never changes the clips.

    A candidate whose clips equal an earlier one's (least-error clips that are the abs-max) takes its score.
    """
    references = reference_logprobs(model.transformer(), dialogues)
    scored = []  # (rule, clips, totals, KL per validation position)
    for rule in tqdm(candidates, desc="choosing clips by KL", unit="candidate", file=sys.stderr,
                     disable=not progress):
        clips = rule.clips(stats)
        same = [s for s in scored if s[1].k == clips.k and s[1].v == clips.v
                and torch.equal(s[1].k_channel, clips.k_channel) and torch.equal(s[1].v_channel, clips.v_channel)]
        scored.append((rule, clips, *same[0][2:]) if same else
                      (rule, clips, *score_clips(model, stats, clips, dialogues, references, first_token)))
    best = 0
    for i in range(1, len(scored)):
        if clearly_lower(scored[i][3], scored[best][3]):
            best = i
    scores = [CandidateScore(rule.name, totals.kl / totals.tokens, totals.agree / totals.tokens)
              for rule, _, totals, _ in scored]
    return scored[best][0], scored[best][1], scores
