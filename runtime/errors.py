"""Every error a user can act on: ``CabinError`` and its kinds, in one place.

A kind says what went wrong (a checkpoint, a scales file, a session file, the KV capacity, ...). Its message names
the problem in the library's words; what the user can change about it travels beside the message as hints
(``Hint``: a ``Fix``, the setting or action by the library's name, and a detail), which each front end words in its
own terms through one table ``Fix -> words`` (the command line's flags and ``/reset``; the server's request fields),
``CabinError.words``. ``str(error)`` is the message with the hints in the library's words. Commands catch
``CabinError`` only, so any other exception is a bug, shown as one line that asks for a report. Each kind keeps the
builtin base it always had (``ValueError`` for bad input, ``RuntimeError`` for a state that cannot go on), so
callers that catch those still do.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping


class Fix(Enum):
    """Something a user can change about an error; the value is the library's words for it (a ``{}`` takes the
    hint's detail). Front ends word each member in their own terms (``cli.args.CLI_WORDS``,
    ``server.app.SERVER_WORDS``)."""

    LOWER_MAX_NEW_TOKENS = "lower SamplingParams.max_new_tokens"
    RAISE_MAX_NEW_TOKENS = "raise SamplingParams.max_new_tokens to {} at least"
    NEW_CONVERSATION = "start a new conversation (DialogueSession.reset)"
    RAISE_KV_BUDGET = "raise KvCacheConfig.max_bytes"
    LOWER_KV_BUDGET = "lower KvCacheConfig.max_bytes"
    OTHER_OVERFLOW = "choose OverflowPolicy.name sink-window or drop-turns"
    SMALLER_PICTURES = 'send fewer or smaller pictures (detail "low"), or lower ImageLimits.max_image_tokens'
    SHORTER_AUDIO = "send clips of {} at most (AudioLimits.max_seconds)"
    INSTALL_VOICE = "install the speech front end: pip install 'cabinllm[voice]'"
    PER_TOKEN_KV_MODE = "choose a KvCacheConfig.kv_mode that stores per token"
    BACKEND = "choose SessionRequest.backend {}"
    BACKEND_NAME = "SessionRequest.backend {}"
    ORT_PROVIDER = "choose SessionRequest.ort_provider {}"
    ONE_REPLY = "ask for one reply (n 1) or a beam search (BeamParams)"
    BUILD_BEAM_WIDTH = "build the engine again with BuildRequest.max_beam_width {}"
    BUILD_VISION = ("build the engine again from the vision- or audio-language model's folder, which sizes its "
                    "prompt table (BuildRequest.model)")
    BUILD_WEIGHTS = "build the engine again with BuildRequest.weights {}"
    BUILD_HEAD = "build the engine again with BuildRequest.head {}"
    BUILD_TARGET = "build for BuildRequest.target {}"
    BUILD_FLOAT32 = "import it as float32 (BuildRequest.dtype float32)"
    EXPORT_ONNX = "export the engine as ONNX graphs (builders.onnx_export)"
    EXPORT_PROFILE = "export it again with OnnxExportRequest.profile {}"
    EXPORT_PRECISION = "export the graphs with OnnxExportRequest.precision {}"
    EXPORT_HTP_ARCH = "export it again with OnnxExportRequest.htp_arch {}"
    EXPORT_CHUNK = "export the graphs with OnnxExportRequest.chunk {} at most"
    GRAPHS_KV_MODE = ("leave SessionRequest.kv_mode out, or export the graphs again with OnnxExportRequest.kv_cache "
                      "{}")
    CALIBRATION_DATA = "give CalibrationRequest.data builtin, sharegpt, a .jsonl or a ShareGPT .json file"
    NO_MIX = "leave the mix out (CalibrationRequest.mix none)"
    LONGER_DIALOGUES = ("calibrate on longer dialogues (CalibrationRequest.max_tokens, or data builtin for long "
                        "cabin sessions)")
    NUM_DIALOGUES = "give CalibrationRequest.num_dialogues"
    LOWER_MIN_TOKENS = "lower CalibrationRequest.min_tokens"
    STITCH_SESSIONS = "stitch dialogues into sessions (prepare_dialogues' sessions)"
    SCALES = "give the scales (a ScalesFile) or calibrate first"
    RAISE_MAX_QUEUE = "raise SchedulerConfig.max_queue (now {})"
    DEVICE = "load the engine on device {} (Engine.load's device)"
    KV_MODE = "choose KvCacheConfig.kv_mode {}"


@dataclass(frozen=True)
class Hint:
    """One fix and what it is about (e.g. how many tokens the reply reserves, or the value to choose)."""

    fix: Fix
    detail: str = ""

    def words(self, phrases: Mapping[Fix, str | None] | None = None) -> str:
        """The hint in a front end's words (``phrases``; the library's by default): the detail in the phrase's
        ``{}``, else after it in parentheses."""
        phrase = (phrases or {}).get(self.fix, self.fix.value) or ""
        if "{}" in phrase:
            return phrase.replace("{}", self.detail)
        return f"{phrase} ({self.detail})" if self.detail else phrase


def join_hints(hints: Iterable[Hint], phrases: Mapping[Fix, str | None] | None = None) -> str:
    """``a, b or c`` of the hints in a front end's words; a hint whose phrase is None there is left out."""
    words = [hint.words(phrases) for hint in hints if (phrases or {}).get(hint.fix, hint.fix.value) is not None]
    return "" if not words else words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


class CabinError(Exception):
    """An error the user can act on: ``message`` names the problem in the library's words, ``hints`` what the user
    can change about it; ``words`` puts both in a front end's terms."""

    def __init__(self, message: str = "", hints: Iterable[Hint] = ()) -> None:
        super().__init__(message)
        self.message, self.hints = message, tuple(hints)

    def words(self, phrases: Mapping[Fix, str | None] | None = None) -> str:
        """``message; hint, hint or hint`` in a front end's ``phrases`` (the library's by default), or the message
        with the hints in its ``{}``."""
        hints = join_hints(self.hints, phrases)
        if self.hints and "{}" in self.message:
            return self.message.replace("{}", hints)
        return f"{self.message}; {hints}" if hints else self.message

    def __str__(self) -> str:
        return self.words()


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


class AudioError(CabinError, ValueError):
    """Audio that cannot be taken: another format, corrupt, empty, too long, over a cap, or no front end for it."""


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
