"""Beam search on the paged cache, as transformers defines it (``GenerationMixin._beam_search`` of transformers
5.x: ``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``, ``_update_finished_beams``,
``_check_early_stop_heuristic``), step for step and with the same tensor operations, so ties break the same way.

Each step every live beam's log-probabilities plus its score give ``beams_to_keep`` candidates (the best of all
beams x vocabulary); the best ``beam_width`` that did not stop continue, those among the first ``beam_width`` that
stopped (a stop token, or the length limit) join the finished ones scored ``sum / length ** length_penalty``. The
beams live in the cache as sequences: a beam continued by several candidates forks (its blocks shared, the
partial last one copied on the first write), a beam nobody continues is freed, so KV is never gathered or copied
to reorder beams. ``BeamSearch`` is one search as a state machine; the engine core's scheduler steps it beside
other requests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.kv.blocks import Sequence, cdiv, fork_blocks
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.model.interface import Span

NEVER = "never"
_FAR = -1.0e9  # transformers' "very large negative value"


@dataclass(frozen=True)
class BeamParams:
    """A beam search, named as transformers' ``GenerationConfig`` names it (TensorRT-LLM: ``beam_width``)."""

    beam_width: int = field(default=4, metadata={"help": "beams kept at each step"})
    max_new_tokens: int = field(default=64, metadata={"help": "longest reply in tokens"})
    length_penalty: float = field(default=1.0, metadata={
        "help": "a finished beam scores its log-probability sum / length ** length_penalty"})
    early_stopping: bool | str = field(default=False, metadata={
        "help": "True: stop once beam_width beams finished; False: once no running beam can do better "
                "(transformers' heuristic); 'never': only at the length limit"})
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.beam_width < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"beam_width and max_new_tokens must be >= 1, got {self.beam_width} and "
                              f"{self.max_new_tokens}")
        if not math.isfinite(self.length_penalty):
            raise ConfigError(f"length_penalty must be a finite number, got {self.length_penalty}")
        if self.early_stopping not in (True, False, NEVER):
            raise ConfigError(f"early_stopping must be true, false or {NEVER!r}, got {self.early_stopping!r}")

    def blocks_needed(self, prompt_tokens: int, tokens_per_block: int) -> int:
        """KV blocks the search may hold at most: the prompt's, and per beam its reply's plus one copied block."""
        return cdiv(prompt_tokens, tokens_per_block) + fork_blocks(self.beam_width, self.max_new_tokens,
                                                                   tokens_per_block)


@dataclass
class BeamResult:
    """The finished beams, best first: their tokens (a stop token last where one ended them) and scores."""

    token_ids: list[list[int]]
    scores: list[float]


class BeamSearch:
    """One beam search over a prompt whose logits ``start`` is given."""

    def __init__(self, cache: PagedKVCache, prompt_len: int, params: BeamParams) -> None:
        self.cache, self.params, self.prompt_len = cache, params, prompt_len
        width = params.beam_width
        self.keep = max(2, 1 + len(params.stop_token_ids)) * width  # transformers' beams_to_keep
        self.cur_len = prompt_len
        self.running_scores = torch.full((width,), _FAR)
        self.running_scores[0] = 0.0
        self.running: list[list[int]] = [[] for _ in range(width)]
        self.finished_scores = torch.full((width,), _FAR)
        self.finished: list[list[int]] = [[] for _ in range(width)]
        self.is_finished = torch.zeros(width, dtype=torch.bool)
        self.improvable = True
        self.seqs: list[Sequence] = []
        self.done = False

    def start(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Begin from the prompt's sequence and its last logits (vocab,): every beam is the prompt."""
        self.seqs = [seq] * self.params.beam_width
        self.advance(logits.expand(self.params.beam_width, -1))

    def advance(self, logits: torch.Tensor) -> None:
        """Take the running beams' next logits (beam_width, vocab): choose, finish, and fork or free sequences."""
        p, width, vocab = self.params, self.params.beam_width, logits.shape[-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1) + self.running_scores[:, None]
        top_scores, top_indices = torch.topk(log_probs.reshape(-1), k=self.keep)
        sources, tokens = (top_indices // vocab).tolist(), (top_indices % vocab).tolist()
        candidates = [self.running[b] + [t] for b, t in zip(sources, tokens)]
        at_limit = self.cur_len + 1 >= self.prompt_len + p.max_new_tokens
        hits = torch.tensor([at_limit or t in p.stop_token_ids for t in tokens])

        running_scores = top_scores + hits.float() * _FAR
        chosen = torch.topk(running_scores, k=width)[1].tolist()
        self.running_scores = running_scores[chosen]
        self.running = [candidates[i] for i in chosen]

        just_finished = hits & (torch.arange(self.keep) < width)
        scores = top_scores / ((self.cur_len + 1 - self.prompt_len) ** p.length_penalty)
        scores += float(bool(self.is_finished.all()) and p.early_stopping is True) * _FAR
        scores += float(not self.improvable) * _FAR
        scores += (~just_finished).float() * _FAR
        merged = torch.cat((self.finished_scores, scores))
        best = torch.topk(merged, k=width)[1].tolist()
        everything = self.finished + candidates
        self.finished = [everything[i] for i in best]
        self.finished_scores = merged[best]
        self.is_finished = torch.cat((self.is_finished, just_finished))[best]

        self.cur_len += 1
        self._check_improvable()
        exists_open = not (bool(self.is_finished.all()) and p.early_stopping is True)
        self.done = not (self.improvable and exists_open and not bool(hits.all()))
        self._reorder([sources[i] for i in chosen])

    def spans(self) -> list[Span]:
        """The next step's spans: each running beam's newest token (slots allocated)."""
        spans = []
        for seq, tokens in zip(self.seqs, self.running):
            self.cache.append(seq, tokens[-1:])
            spans.append(Span(tokens[-1:], len(seq) - 1, seq))
        return spans

    def close(self) -> BeamResult:
        """Free every beam's sequence; the finished beams, best first."""
        for seq in {id(s): s for s in self.seqs}.values():
            if seq:
                self.cache.free(seq)
        self.seqs = []
        kept = [i for i in range(self.params.beam_width) if bool(self.is_finished[i])]
        return BeamResult([self.finished[i] for i in kept], [float(self.finished_scores[i]) for i in kept])

    def _check_improvable(self) -> None:
        """transformers' early-stop heuristic: can the best running beam still beat the worst finished one?"""
        p = self.params
        if p.early_stopping == NEVER and p.length_penalty > 0.0:
            length = p.max_new_tokens
        else:
            length = self.cur_len - self.prompt_len
        best_possible = self.running_scores[0] / (length ** p.length_penalty)
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(), torch.tensor(_FAR))
        self.improvable = self.improvable and bool((best_possible > worst_finished).any())

    def _reorder(self, sources: list[int]) -> None:
        """Give each new running beam the sequence of the beam it continues: the first takes it, the others fork
        it; sequences no beam continues are freed."""
        if self.done:
            return
        old, taken, seqs = self.seqs, set(), []
        for source in sources:
            seq = old[source]
            if id(seq) in taken:
                child = Sequence()
                self.cache.fork(seq, child)
                seq = child
            taken.add(id(seq))
            seqs.append(seq)
        for seq in {id(s): s for s in old}.values():
            if id(seq) not in taken:
                self.cache.free(seq)
        self.seqs = seqs

