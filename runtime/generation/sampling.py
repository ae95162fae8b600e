"""Sampling parameters and next-token selection."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cabinllm.runtime.errors import ConfigError

MAX_SEED = 2**64 - 1  # the largest seed torch.Generator takes


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy. Each field carries the description the
    commands' flags show."""

    max_new_tokens: int = field(default=128, metadata={"help": "longest reply in tokens"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature; 0 = greedy"})
    top_k: int = field(default=0, metadata={"help": "sample from the k most likely tokens (0 = all)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling threshold, in (0, 1]"})
    seed: int | None = field(default=None, metadata={"help": "random seed for sampling (none: a fresh one each run)"})
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be a number > 0 and <= 1, got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = all tokens), got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise ConfigError(f"seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ConfigError(f"stop strings must be non-empty text, got {self.stop_strings!r}")

    def stops(self, text: str) -> bool:
        """Whether ``text`` holds one of the stop strings."""
        return any(s in text for s in self.stop_strings)

    def cut_at_stop(self, text: str) -> str:
        """``text`` before the earliest stop string in it (all of it when none is)."""
        for s in self.stop_strings:
            text = text.split(s)[0]
        return text


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU random generator, seeded when a seed is given."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits a token is drawn from: divided by the temperature, outside top-k and top-p at -inf (greedy: the
    logits as they are)."""
    if params.temperature == 0:
        return logits.float()
    logits = (logits.float() - logits.max()) / params.temperature  # shifted first: a tiny temperature stays finite
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # the mass of the more likely tokens
        drop[0] = False  # the most likely token stays, even where top_p rounds to 0 in float32
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def greedy(logits: torch.Tensor) -> int:
    """The id of the largest of logits (vocab,), the first where several tie (on a CPU through numpy's argmax, the
    faster of the two there)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16):
        return int(logits.detach().numpy().argmax())
    return int(torch.argmax(logits))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token id from logits of shape (vocab,)."""
    if params.temperature == 0:
        return greedy(logits)
    probs = torch.softmax(sampling_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely tokens at its place, (token id, log-probability)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, params: SamplingParams, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability and the ``top`` likeliest under the distribution it was sampled from
    (``sampling_logits``: after the grammar's mask, the temperature, top-k and top-p); tokens that distribution
    rules out are not listed."""
    logprobs = torch.log_softmax(sampling_logits(logits, params), dim=-1)
    values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
    return TokenLogprob(token, float(logprobs[token]), [(int(i), float(v)) for i, v in zip(ids, values)
                                                         if math.isfinite(v)])
