"""Time to first token over the turns of one ShareGPT dialogue: ours reusing earlier turns, peers as they serve it."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from tqdm import tqdm

from cabinllm.benchmarks.paired import median
from cabinllm.benchmarks.runners.base import Runner
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig

MIB = 1 << 20
SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass
class TurnContext:
    """What every system sees at one turn: the history up to the new user message."""

    turn: int
    history: list[int]
    new_tokens: int  # what ours prefilled this turn (the rest was reused)


def growth(ttfts: list[float]) -> float | None:
    """Median TTFT of the last quarter of turns over that of the first quarter after turn 1 (>= 1 turn each).

    Turn 1 is left out: it prefills the system prompt too. Flat is about 1; re-prefilling grows with the history.
    """
    k = max(1, len(ttfts) // 4)
    early, late = ttfts[1:1 + k], ttfts[-k:]
    return median(late) / median(early) if len(ttfts) > 1 and median(early) else None


def measure_multiturn(engine: Engine, mode: str, users: list[str], peers: list[Runner], repeats: int,
                      max_new_tokens: int, budget_mib: int, bar: tqdm | None = None) -> dict:
    """Play the user turns with our DialogueSession (KV of earlier turns reused); after each turn every peer
    answers the same history token for token. Per-turn medians over repeats."""
    ours = f"cabin {mode} (reuse)"
    samples: dict[str, list[list[float]]] = {name: [[] for _ in users] for name in [ours] + [p.name for p in peers]}
    errors: dict[str, str] = {}
    contexts: list[TurnContext] = []
    for _ in range(repeats):
        params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=engine.stop_token_ids())
        session = DialogueSession(engine, engine.new_cache(KvCacheConfig(mode, budget_mib * MIB)), params,
                                  SYSTEM_PROMPT)
        contexts = []
        for index, text in enumerate(users):
            stats = session.chat(text)
            if stats.error:
                raise RuntimeError(f"turn {index + 1} of the dialogue failed in our session: {stats.error}")
            samples[ours][index].append(stats.ttft_s)
            history = session.fed[:stats.reused_tokens + stats.prefill_tokens]
            contexts.append(TurnContext(index + 1, history, stats.prefill_tokens))
            for peer in peers:
                if bar is not None:
                    bar.set_postfix_str(f"turn {index + 1}: {peer.name}")
                if peer.name not in errors:
                    try:
                        samples[peer.name][index].append(peer.turn(history, index == 0))
                    except Exception as err:  # a peer that breaks is a result, reported with its reason
                        errors[peer.name] = f"{type(err).__name__}: {err}"
                        print(f"cabin-bench: {peer.name} failed: {errors[peer.name]}", file=sys.stderr)
            if bar is not None:
                bar.update()
    medians = {name: [median(s) for s in per_turn] for name, per_turn in samples.items()}
    turns = [{"turn": c.turn, "context_tokens": len(c.history), "new_tokens": c.new_tokens,
              "ttft_s": {name: m[i] for name, m in medians.items()}} for i, c in enumerate(contexts)]
    notes = {ours: "prefills only the tokens new since the last turn; earlier turns' KV stay in the paged cache"}
    notes.update({p.name: p.turn_note for p in peers})
    return {"mode": mode, "max_new_tokens": max_new_tokens, "repeats": repeats, "turns": turns, "notes": notes,
            "growth_last_vs_first_quarter": {name: growth([v for v in m if v is not None]) if None not in m else None
                                             for name, m in medians.items()},
            "errors": errors}
