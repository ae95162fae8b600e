"""What the command-line tools share: argparse types for numbers that must be finite and in range (argparse
names the flag in its error line and exits with code 2), one line for a failed read or write, and the entry-point
wrapper that tells a bug from a user error."""
from __future__ import annotations

import argparse
import errno
import functools
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Callable, TextIO

from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.kv.memory import available_memory


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (no upper end when None)."""
    need = f"an integer >= {low}" + ("" if high is None else f" and <= {high}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need {need}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"need {need}, got {text!r}")
        return value

    return parse


def float_range(low: float, high: float = math.inf, low_included: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number above ``low`` (or equal to it when ``low_included``) and at most ``high``."""
    need = (f"a finite number {'>=' if low_included else '>'} {low:g}"
            + (f" and <= {high:g}" if math.isfinite(high) else ""))

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"need {need}, got {text!r}") from None
        if not (math.isfinite(value) and (value >= low if low_included else value > low) and value <= high):
            raise argparse.ArgumentTypeError(f"need {need}, got {text!r}")
        return value

    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
positive_float = float_range(0)
non_negative_float = float_range(0, low_included=True)
reserve_gib = float_range(0, 1024, low_included=True)  # GiB held on a board for other models (none has 1 TiB)


def os_error_message(err: OSError, path: str | Path) -> str:
    """One line for a failed read or write of ``path`` (or the file the error names): a full disk says so."""
    where = err.filename or path
    if err.errno == errno.ENOSPC:
        return f"cannot write {where}: the disk is full; free some space (or write elsewhere) and run again"
    return f"{where}: {err.strerror or err}"


def output_name(stream: TextIO) -> str:
    """The file a stream writes to (where the system can say, e.g. a redirected stdout), else its name."""
    try:
        return os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, ValueError):
        return getattr(stream, "name", "standard output")


def kv_budget_bytes(megabytes: float) -> int:
    """``--kv-budget-mb`` in bytes, refused (ValueError naming the flag) before anything is allocated when it is
    under one byte or more than this machine's available memory."""
    requested, available = megabytes * (1 << 20), available_memory()
    if requested < 1:
        raise ConfigError(f"--kv-budget-mb {megabytes:g} is less than one byte; give a budget of some MiB")
    if requested > available:
        raise ConfigError(f"--kv-budget-mb {megabytes:g} is more than the {available / 2**20:,.0f} MiB of "
                         "memory this machine has available; choose a smaller --kv-budget-mb")
    return int(requested)


DEBUG_ENV = "CABIN_DEBUG"  # set to 1: a bug shows its whole traceback
BUG_EXIT = 70  # EX_SOFTWARE: the command failed by a fault of its own


def entry_point(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a command's ``main``: it handles the CabinError kinds (user errors, exit code 2) itself; any other
    exception is a bug, shown as one line that asks for a report (the traceback with CABIN_DEBUG=1, exit code 70),
    and Ctrl-C ends the command with code 130 and no traceback."""
    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130
            except Exception as err:  # the boundary: everything a command did not expect is a bug
                if os.environ.get(DEBUG_ENV):
                    traceback.print_exc()
                print(f"{prog}: internal error: {type(err).__name__}: {err}. This is a bug in CabinLLM, not in what "
                      f"you gave it; please report it with the command line (run again with {DEBUG_ENV}=1 for the "
                      "traceback)", file=sys.stderr)
                return BUG_EXIT
        return run
    return wrap
