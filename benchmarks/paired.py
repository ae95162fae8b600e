"""Medians and ours/peer ratios computed pair by pair (the two runs of one repeat, measured back to back)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass


def median(values: list[float]) -> float | None:
    """Median of the values, None if there are none."""
    return statistics.median(values) if values else None


@dataclass
class PairRatio:
    """ours / peer of one metric, as the median over repeats of the ratio within each repeat."""

    ours: str
    peer: str
    metric: str
    context: int | None
    ratio: float | None
    pairs: int  # repeats in which both ran


def paired_ratio(ours: list[float | None], peer: list[float | None]) -> tuple[float | None, int]:
    """Median of ours[i] / peer[i] over the repeats i where both have a value; and how many there were."""
    ratios = [a / b for a, b in zip(ours, peer) if a is not None and b]
    return median(ratios), len(ratios)
