"""Every error a user can act on: ``CabinError`` and its kinds, in one place.

A kind says what went wrong (a checkpoint, a scales file, a session file, the KV capacity, ...); its
message names the problem and the fix. Where the fix is a choice the user makes in a front end (a
flag, a command, an API field), the library states it as structured hints (``Hint``: a ``Fix`` and a
detail; e.g. ``runtime.dialogue.overflow.capacity_message``) that each front end words in its own terms:
the command line names flags and ``/reset``, the server names neither. Commands catch ``CabinError`` only, so any other exception is a bug, shown
as one line that asks for a report. Each kind keeps the builtin base it always had (``ValueError``
for bad input, ``RuntimeError`` for a state that cannot go on), so callers that catch those still do.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Fix(Enum):
    """Something a user can do about an error; the value is the command line's words for it."""

    LOWER_MAX_NEW_TOKENS = "lower --max-new-tokens"
    NEW_CONVERSATION = "start a new conversation (/reset)"
    RAISE_KV_BUDGET = "raise --kv-budget-mb"
    OTHER_OVERFLOW = "choose --overflow sink-window|drop-turns"
    SMALLER_PICTURES = 'send fewer or smaller pictures (detail "low"), or lower --max-image-tokens'


@dataclass(frozen=True)
class Hint:
    """One fix and what it is about (e.g. how many tokens the reply reserves)."""

    fix: Fix
    detail: str = ""

    def words(self, phrases: dict[Fix, str] | None = None) -> str:
        """The hint in a front end's words (``phrases``; by default the command line's)."""
        phrase = (phrases or {}).get(self.fix, self.fix.value)
        return f"{phrase} ({self.detail})" if self.detail else phrase


def join_hints(hints: tuple[Hint, ...] | list[Hint], phrases: dict[Fix, str] | None = None) -> str:
    """``a, b or c`` of the hints in a front end's words."""
    words = [hint.words(phrases) for hint in hints]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


class CabinError(Exception):
    """An error the user can act on; the message names the problem and the fix."""


class ConfigError(CabinError, ValueError):
    """A setting or argument is out of range or unknown; the message names it and what it takes."""


class MissingDependency(CabinError, ImportError):
    """An optional package a path needs is not installed; the message names the package and its install line."""


class CheckpointError(CabinError, ValueError):
    """A checkpoint (or a model being imported) is unusable; the message says why and what to do."""


class WeightFormatError(CabinError, ValueError):
    """A checkpoint's weight quantization the reference engine cannot run; the message names the fix."""


class ScalesError(CabinError, ValueError):
    """A scales file is unreadable, malformed or made for another model."""


class SessionFileError(CabinError, ValueError):
    """A session cannot be saved here, or a session file is unreadable, cut short, or belongs to another
    model or other scales."""


class ScriptError(CabinError, ValueError):
    """A dialogue script is unreadable or malformed; the message names the line."""


class DataError(CabinError, ValueError):
    """Dialogue data is missing, unreadable or too small for the request; the message says what to do."""


class ImageError(CabinError, ValueError):
    """A picture that cannot be taken: unreadable, truncated, empty, too large, over a cap."""


class GrammarError(CabinError, ValueError):
    """A grammar, JSON schema or tool definition that cannot constrain decoding; the message names the part."""


class CapacityError(CabinError, RuntimeError):
    """The tokens to prefill do not fit the KV budget or the model's context."""


class OutOfBlocks(CabinError, RuntimeError):
    """No free or evictable KV block is left for a request."""


class TargetError(CabinError, ValueError):
    """An unknown target or a malformed profile; the message lists what is known."""


class PlanRefused(CabinError, ValueError):
    """The request cannot work on the target: ``reason`` says why, ``nearest`` is the closest plan that works
    (a ``builders.planner.Plan``; anything with a ``summary()``)."""

    def __init__(self, reason: str, nearest: object | None) -> None:
        hint = f"; nearest working config: {nearest.summary()}" if nearest else "; no listed target fits this model"
        super().__init__(reason + hint)
        self.reason, self.nearest = reason, nearest


class TrtllmError(CabinError, RuntimeError):
    """trtllm-build is unusable here or failed; the message says why and where its log is."""


class QueueFull(CabinError, RuntimeError):
    """The server's waiting queue holds ``max_queue`` requests already."""


class EvalJsonError(CabinError, ValueError):
    """The cabin-eval JSON is missing or not in the expected form."""
