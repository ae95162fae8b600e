"""What every benchmarked system offers the measurements: a run, a KV footprint and, for peers, a dialogue turn."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass
class RunTiming:
    """One prefill of a prompt, then greedy decode steps."""

    prompt_tokens: int
    prefill_s: float  # from the call to the first token (prefill + first sampling)
    decode_tokens: int  # tokens after the first
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens per second of time to first token."""
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token."""
        return self.decode_tokens / self.decode_s


@dataclass
class KVFootprint:
    """What the KV cache of one system costs and how long a context fits a byte budget."""

    bytes_per_token: float
    fixed_bytes: int  # held whatever the length: full-precision windows, residual buffers
    max_tokens: int  # longest context whose KV fits the budget
    how: str  # where the figures come from


def footprint_lengths(prompt: list[int]) -> tuple[int, int]:
    """Two prefix lengths of the prompt whose KV sizes give bytes per token (the slope) and fixed bytes."""
    long = min(1024, len(prompt))
    return long // 4, long


@dataclass
class Runner:
    """A system under test: ours in one KV mode, or a peer with one cache setting.

    ``run(prompt_ids, new_tokens)`` prefills the prompt from scratch and decodes greedily.
    ``footprint(budget_bytes, prompt_ids)`` measures its KV bytes per token (on prefixes of the prompt) and the
    longest context in the budget.
    ``turn(history_ids, fresh)`` is the time to first token of one dialogue turn given the whole
    history, as that system would serve it (``fresh``: a new conversation starts); None for ours,
    whose dialogue runs through DialogueSession.
    """

    name: str
    family: str  # "cabin", "transformers" or "llama.cpp"
    kv: str  # how the KV cache is stored
    weights: str  # how the weights are stored and computed
    run: Callable[[list[int], int], RunTiming]
    footprint: Callable[[int, list[int]], KVFootprint]
    turn: Callable[[list[int], bool], float] | None = None
    mode: str | None = None  # our KV mode, for the accuracy columns
    turn_note: str = ""  # how this system treats the history in a dialogue turn
    read_bytes: Callable[[int], int] | None = None  # bytes one decode step reads at a context (ours only)


@dataclass
class Unavailable:
    """A peer that could not be set up, and why (reported in the results, never dropped)."""

    name: str
    family: str
    reason: str


def missing_module(module: str, package: str) -> str | None:
    """None if ``module`` imports, else why not and how to install ``package``."""
    try:
        importlib.import_module(module)
    except Exception as err:  # a broken install raises more than ImportError
        return f"{package} is not installed or does not import ({type(err).__name__}: {err}); " \
               f"install the peers with `pip install -e '.[bench]'`"
    return None
