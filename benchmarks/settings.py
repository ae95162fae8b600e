"""How much a cabin-bench run measures: the full run and the quick one."""
from __future__ import annotations

from dataclasses import dataclass, field

OUR_MODES = ["fp16", "int8", "int8-dynamic", "int4"]


@dataclass
class BenchSettings:
    """Sizes and repeat counts of one run."""

    contexts: list[int] = field(default_factory=lambda: [512, 2048, 4096])
    repeats: int = 3
    decode_steps: int = 128  # covers one flush of QuantizedCache's 128-token residual, as a real reply does
    turns: int = 20
    turn_repeats: int = 2
    reply_tokens: int = 32
    max_user_tokens: int = 96
    kv_budget_mib: int = 64
    modes: list[str] = field(default_factory=lambda: list(OUR_MODES))
    quick: bool = False
    overrides: list[str] = field(default_factory=list)  # settings given on the command line

    def label(self) -> str:
        """'quick' or 'full', with the settings changed on the command line."""
        name = "quick" if self.quick else "full"
        return f"{name}, with {', '.join(self.overrides)} set on the command line" if self.overrides else name


def quick_settings() -> BenchSettings:
    """Two repeats, 32 decode tokens per run (within QuantizedCache's residual, so it never flushes), one pass
    of the dialogue: about half the time of the full run."""
    return BenchSettings(repeats=2, decode_steps=32, turn_repeats=1, quick=True)
