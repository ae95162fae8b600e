"""What the command-line tools share: argparse types for numbers that must be finite and in range (argparse
names the flag in its error line and exits with code 2), the flags of a dialogue's KV cache and sampling (defined
once, their help read from the config dataclasses' field descriptions), one line for a failed read or write, and
the entry-point wrapper that tells a bug from a user error."""
from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import math
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, TextIO

from cabinllm.runtime.dialogue.overflow import COMPACT_MEDIA, OverflowPolicy
from cabinllm.runtime.errors import CabinError, ConfigError, Fix
from cabinllm.runtime.generation.sampling import MAX_SEED, SamplingParams
from cabinllm.runtime.kv.cache import DEFAULT_KV_BYTES, KvCacheConfig
from cabinllm.runtime.kv.memory import available_memory
from cabinllm.runtime.kv.modes import REFERENCE_KV_MODES, kv_mode_name
from cabinllm.runtime.model.cuda import DEVICES
from cabinllm.runtime.model.threads import AUTO, CPU_THREADS, parse_threads
from cabinllm.runtime.model.vision import ImageLimits
from cabinllm.runtime.speech.asr import AsrConfig
from cabinllm.runtime.speech.audio import AudioLimits
from cabinllm.runtime.speech.listen import ListenConfig


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


def help_of(config: type, name: str) -> str:
    """The description a config dataclass gives its field ``name``: the help of the flag that sets it."""
    return next(f for f in dataclasses.fields(config) if f.name == name).metadata["help"]


def add_image_flags(parser: argparse.ArgumentParser) -> None:
    """The caps on pictures a message may show (a vision-language engine's; ImageLimits' fields)."""
    for cap in dataclasses.fields(ImageLimits):
        parser.add_argument("--" + cap.name.replace("_", "-"), type=positive_int, default=cap.default,
                            help=f"{help_of(ImageLimits, cap.name)} (default {cap.default:,})")


def add_speech_flags(parser: argparse.ArgumentParser, listen: bool = False) -> None:
    """The speech front end's flags (AsrConfig's fields with a help, as --asr-*), the caps on a message's clips
    (AudioLimits', as --audio-*) and, with ``listen``, where --listen cuts a stream (ListenConfig's, as --listen-*)."""
    kinds = {int: positive_int, float: positive_float, str: str}
    configs = ((AsrConfig, "asr"), (AudioLimits, "audio")) + (((ListenConfig, "listen"),) if listen else ())
    for config, prefix in configs:
        for option in (option for option in dataclasses.fields(config) if "help" in option.metadata):
            kind = float_range(0, 1) if option.name == "threshold" else kinds[type(option.default)]
            words = option.metadata["help"]
            if "default" not in words:  # else the help says what the default means
                words += f" (default {option.default:g})" if isinstance(option.default, float) else \
                    f" (default {option.default})"
            parser.add_argument(f"--{prefix}-{option.name.replace('_', '-')}", type=kind, default=option.default,
                                help=words)


def speech_settings(args: argparse.Namespace) -> tuple[AsrConfig, AudioLimits, ListenConfig | None]:
    """The AsrConfig, AudioLimits and ListenConfig (None without the --listen-* flags) of add_speech_flags' flags;
    ConfigError for an --asr-model folder that holds no model, or where an utterance the listener may cut is longer
    than a clip may be."""
    def of(config: type, prefix: str):
        return config(**{option.name: getattr(args, f"{prefix}_{option.name}") for option in dataclasses.fields(config)
                         if "help" in option.metadata})

    asr, limits = of(AsrConfig, "asr"), of(AudioLimits, "audio")
    if asr.model and not (Path(asr.model) / "model.bin").is_file():
        raise ConfigError(f"--asr-model {asr.model}: no CTranslate2 Whisper model there (model.bin); give the folder "
                          "of a converted Whisper model, or leave it out for Whisper tiny.en")
    if not hasattr(args, "listen_silence_s"):
        return asr, limits, None
    listen = of(ListenConfig, "listen")
    if listen.max_utterance_s > limits.max_seconds:
        raise ConfigError(f"--listen-max-utterance-s {listen.max_utterance_s:g} is longer than the "
                          f"{limits.max_seconds:g} s a clip may take (--audio-max-seconds); lower it")
    return asr, limits, listen


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The picture caps of the flags."""
    return ImageLimits(**{cap.name: getattr(args, cap.name) for cap in dataclasses.fields(ImageLimits)})


def kv_mode_choice(modes: Sequence[str]) -> Callable[[str], str]:
    """An argparse type: a KV mode among ``modes``, a former name read as the registry's (``kv_mode_name``)."""
    def parse(text: str) -> str:
        name = kv_mode_name(text)
        if name not in modes:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r}; choose from {', '.join(modes)}")
        return name

    return parse


def add_kv_cache(parser: argparse.ArgumentParser, purpose: str, modes: Sequence[str] = REFERENCE_KV_MODES,
                 default: str | None = None, default_help: str | None = None, many: bool = False) -> None:
    """--kv-cache of a command: one of ``modes`` (a set the registry, cabinllm.runtime.kv.modes, derives), or with
    ``many`` a comma-separated list of them that the command checks (default: all); ``purpose`` says what the
    mode is for, ``default_help`` the default where it is not a mode name."""
    listed, default = ", ".join(modes), ",".join(modes) if many else default
    help_text = f"{purpose}: comma-separated, of {listed} (default: all)" if many else \
        f"{purpose}: one of {listed} (default: {default_help or default})"
    parser.add_argument("--kv-cache", default=default, metavar="MODE[,MODE...]" if many else "MODE",
                        type=str if many else kv_mode_choice(modes), help=help_text)


def add_cache_flags(parser: argparse.ArgumentParser, shared_by: str = "") -> None:
    """--kv-cache, --kv-budget-mb, --tokens-per-block and --overflow of a dialogue on the engine (``shared_by``: who
    shares the budget, for the help)."""
    mib = DEFAULT_KV_BYTES / 2**20
    add_kv_cache(parser, help_of(KvCacheConfig, "kv_mode"), default_help="what the engine was built for")
    parser.add_argument("--kv-budget-mb", type=positive_float, default=mib,
                        help=f"{help_of(KvCacheConfig, 'max_bytes')} in MiB{shared_by} (default {mib:g})")
    parser.add_argument("--tokens-per-block", type=positive_int,
                        help=f"{help_of(KvCacheConfig, 'tokens_per_block')} (default: the engine's target's)")
    default = OverflowPolicy().steps
    parser.add_argument("--overflow", type=overflow_steps, default=OverflowPolicy(),
                        metavar=f"[{COMPACT_MEDIA},]POLICY",
                        help=f"{help_of(OverflowPolicy, 'name')}; before that policy, {COMPACT_MEDIA} (named "
                             "first) replaces the pictures and audio of answered turns, oldest first, by a text "
                             "marker ([picture: NAME]) or their transcript until the turn fits, every word kept: their "
                             "KV blocks are freed and what follows them is prefilled again. A policy alone leaves "
                             f"pictures and audio as they are (default {default})")


def overflow_steps(text: str) -> OverflowPolicy:
    """An argparse type: the OverflowPolicy of a list of steps (``compact-media,drop-turns``, ``error``)."""
    try:
        return OverflowPolicy.from_steps(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(err.message) from None


def kv_cache_config(args: argparse.Namespace) -> KvCacheConfig:
    """The KvCacheConfig of add_cache_flags' flags (the budget checked by ``kv_budget_bytes``); what they leave
    unset is the engine's."""
    return KvCacheConfig(args.kv_cache, kv_budget_bytes(args.kv_budget_mb), args.tokens_per_block)


def thread_count(text: str) -> int | str:
    """An argparse type: ``auto`` or a thread count >= 1."""
    try:
        return parse_threads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"need {AUTO} or an integer >= 1, got {text!r}") from None


def add_thread_flag(parser: argparse.ArgumentParser) -> None:
    """--threads of the reference engine: ``auto`` (the default) follows the cores other processes leave idle."""
    parser.add_argument("--threads", type=thread_count, default=AUTO,
                        help="CPU threads of the reference engine's ops: N, or auto (the default): before each step "
                             "as many as the cores other processes (speech, vision) leave idle, at least one, "
                             "re-read every 0.25 s; a prefill split over a busy core waits for it")


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """--device: where the model runs (``Engine.load``'s device)."""
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the model runs: cpu, the reference engine (the default), or cuda, the CUDA runner "
                             "(fp16 weights and the KV pool on an NVIDIA GPU, Triton kernels; needs torch with CUDA "
                             "and pip install 'cabinllm[gpu]')")


def use_threads(args: argparse.Namespace) -> None:
    """Apply --threads to this process."""
    CPU_THREADS.use(args.threads)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """--max-new-tokens, --temperature, --top-k, --top-p and --seed, with SamplingParams' defaults."""
    flags = [("max_new_tokens", positive_int), ("temperature", non_negative_float), ("top_k", non_negative_int),
             ("top_p", float_range(0, 1)), ("seed", int_range(0, MAX_SEED))]
    for name, kind in flags:
        default = getattr(SamplingParams, name)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                            help=help_of(SamplingParams, name) + ("" if default is None else f" (default {default})"))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of add_sampling_flags' flags."""
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)


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


# The command line's words for each Fix of a CabinError (a {} takes the hint's detail): its flags and commands.
CLI_WORDS: dict[Fix, str] = {
    Fix.LOWER_MAX_NEW_TOKENS: "lower --max-new-tokens",
    Fix.RAISE_MAX_NEW_TOKENS: "raise --max-new-tokens to {} at least",
    Fix.NEW_CONVERSATION: "start a new conversation (/reset)",
    Fix.RAISE_KV_BUDGET: "raise --kv-budget-mb",
    Fix.LOWER_KV_BUDGET: "give a smaller --kv-budget-mb",
    Fix.OTHER_OVERFLOW: "choose --overflow compact-media,sink-window or compact-media,drop-turns",
    Fix.SMALLER_PICTURES: 'send fewer or smaller pictures (detail "low"), or lower --max-image-tokens',
    Fix.SHORTER_AUDIO: "send clips of {} at most (or raise --audio-max-seconds)",
    Fix.INSTALL_VOICE: "install the speech front end: pip install 'cabinllm[voice]'",
    Fix.PER_TOKEN_KV_MODE: "choose another --kv-cache",
    Fix.BACKEND: "chat with --backend {}",
    Fix.BACKEND_NAME: "--backend {}",
    Fix.ORT_PROVIDER: "choose --ort-provider {}",
    Fix.ONE_REPLY: "ask for one reply or a beam search (no --choices, or --beam-width N)",
    Fix.BUILD_BEAM_WIDTH: "rebuild it with cabin-build --max-beam-width {}",
    Fix.BUILD_VISION: "build it again with cabin-build from the vision- or audio-language model's folder, which "
                      "passes --max_multimodal_len",
    Fix.BUILD_WEIGHTS: "use --weights {}",
    Fix.BUILD_HEAD: "build the engine again with --head {}",
    Fix.BUILD_TARGET: "build for --target {}",
    Fix.BUILD_FLOAT32: "import it as float32 (cabin-build --dtype float32)",
    Fix.EXPORT_ONNX: "write one with cabin-export --format onnx",
    Fix.EXPORT_PROFILE: "export it again with cabin-export --profile {}",
    Fix.EXPORT_PRECISION: "export --precision {}",
    Fix.EXPORT_HTP_ARCH: "export it again with cabin-export --htp-arch {} (or the --target of this board)",
    Fix.GRAPHS_KV_MODE: "leave --kv-cache out or export them again with cabin-export --kv-cache {}",
    Fix.CALIBRATION_DATA: "use --data builtin, sharegpt, a .jsonl or a ShareGPT .json file",
    Fix.NO_MIX: "--mix none leaves it out",
    Fix.LONGER_DIALOGUES: "calibrate on longer dialogues (--max-tokens, or --data builtin for long cabin sessions)",
    Fix.NUM_DIALOGUES: "pass --num-dialogues",
    Fix.LOWER_MIN_TOKENS: "lower --min-tokens",
    Fix.STITCH_SESSIONS: "stitch dialogues into sessions (cabin-eval --sessions)",
    Fix.SCALES: "pass --scales or calibrate first",
    Fix.EXPORT_CHUNK: "export the graphs with cabin-export --chunk {} at most",
    Fix.RAISE_MAX_QUEUE: "raise cabin-serve's --max-queue (now {})",
    Fix.DEVICE: "run with --device {}",
    Fix.KV_MODE: "choose --kv-cache {}",
}


def cli_message(err: BaseException) -> str:
    """An error as a command prints it: a CabinError's message and its hints in the command line's words."""
    return err.words(CLI_WORDS) if isinstance(err, CabinError) else str(err)


DEBUG_ENV = "CABIN_DEBUG"  # set to 1: a bug shows its whole traceback
BUG_EXIT = 70  # EX_SOFTWARE: the command failed by a fault of its own


def entry_point(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Wrap a command's ``main``: it handles the CabinError kinds (user errors, exit code 2) itself; any other
    exception is a bug, shown as one line that asks for a report (the traceback with CABIN_DEBUG=1, exit code 70),
    Ctrl-C ends the command with code 130 and no traceback, and a warning is one line that names the command."""
    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            warnings.formatwarning = lambda message, *_args, **_kwargs: f"{prog}: warning: {message}\n"
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
