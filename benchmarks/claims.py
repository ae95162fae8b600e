"""The issue's claims, checked against a run's numbers: each with its value, threshold and verdict."""
from __future__ import annotations

from dataclasses import dataclass

from cabinllm.benchmarks.paired import PairRatio

CLAIM_CONTEXT = 2048
FLAT_GROWTH = 1.5  # last-quarter TTFT within 1.5x the first quarter's counts as flat
WEIGHT_PEER = "llama.cpp q8_0"  # quantized weights of ours against the GGUF's, KV int8 against q8_0
WEIGHT_CLAIMS = {"W4A16_AWQ": 1.5, "W8A16": 1.0}  # decode ratio each weight format must reach


@dataclass
class Claim:
    """One claim and whether this run supports it (None: not measured in this run)."""

    claim: str
    value: float | None
    threshold: str
    passed: bool | None


def _ratio(ratios: list[PairRatio], ours: str, peer: str, context: int) -> float | None:
    return next((r.ratio for r in ratios if (r.ours, r.peer, r.metric, r.context) ==
                 (ours, peer, "decode_tok_s", context)), None)


def check_claims(ratios: list[PairRatio], contexts: list[int], quantized_peers: list[str],
                 growth: dict[str, float | None], ours_turns: str) -> list[Claim]:
    """Decode of cabin int8 vs transformers (default cache >= 1x, quantized caches >= 2x) and, where measured, of
    cabin int8 on quantized weights vs llama.cpp q8_0 at 2,048 tokens of context (the largest measured if 2,048
    was not), and a flat multi-turn TTFT against a growing re-prefill."""
    context = CLAIM_CONTEXT if CLAIM_CONTEXT in contexts else max(contexts)
    claims = []
    for peer, need in [("transformers dynamic", 1.0)] + [(p, 2.0) for p in quantized_peers]:
        value = _ratio(ratios, "cabin int8", peer, context)
        claims.append(Claim(f"cabin int8 decode tok/s / {peer} at {context} tokens of context", value,
                            f">= {need:g}", None if value is None else value >= need))
    for algo, need in WEIGHT_CLAIMS.items():
        value = _ratio(ratios, f"cabin int8 + {algo}", WEIGHT_PEER, context)
        if value is not None:
            claims.append(Claim(f"cabin int8 + {algo} decode tok/s / {WEIGHT_PEER} at {context} tokens of context",
                                value, f">= {need:g}", value >= need))
    ours, peer = growth.get(ours_turns), growth.get("transformers dynamic")
    claims.append(Claim(f"{ours_turns}: TTFT of the last quarter of turns / the first quarter", ours,
                        f"<= {FLAT_GROWTH:g} (flat)", None if ours is None else ours <= FLAT_GROWTH))
    claims.append(Claim("transformers dynamic (re-prefill): TTFT of the last quarter of turns / the first quarter",
                        peer, f"> {ours_turns}'s (grows)",
                        None if peer is None or ours is None else peer > ours))
    return claims
