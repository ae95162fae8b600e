"""A progress display over a build's steps: ``[2/5] measuring KV scales ... done in 3.1 s``."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator


class Steps:
    """Numbered steps of a known count, each logged when it starts and when it ends."""

    def __init__(self, total: int, log: Callable[[str], None]) -> None:
        self.total, self.log, self.done = total, log, 0

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        """Log ``[i/N] text``, run the block, then log its duration (or that it failed)."""
        self.done += 1
        prefix = f"[{self.done}/{self.total}]"
        self.log(f"{prefix} {text}")
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self.log(f"{prefix} failed after {time.perf_counter() - started:.1f} s")
            raise
        self.log(f"{prefix} done in {time.perf_counter() - started:.1f} s")
