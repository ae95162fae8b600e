"""``cabin-chat``: talk to an engine, interactively or from a scripted dialogue."""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import BinaryIO

from cabinllm.cli.args import (CLI_WORDS, add_cache_flags, add_device_flag, add_image_flags, add_sampling_flags,
                               add_speech_flags, add_thread_flag, cli_message, entry_point, float_range, help_of,
                               image_limits, kv_cache_config, os_error_message, output_name, positive_int,
                               sampling_params, speech_settings, use_threads)
from cabinllm.runtime.backends.onnxruntime import ORT_PROVIDERS
from cabinllm.runtime.backends.qnn import HTP_PRECISIONS
from cabinllm.runtime.backends.select import BACKENDS, SessionRequest, open_session
from cabinllm.runtime.dialogue.interface import Session, TurnStats
from cabinllm.runtime.errors import AudioError, CabinError, ConfigError, ImageError, SessionFileError
from cabinllm.runtime.formats.chat_script import read_script, text_problem
from cabinllm.runtime.formats.engine_folder import EngineFolder
from cabinllm.runtime.generation.beam import NEVER, BeamParams
from cabinllm.runtime.model.tools import Tool, read_tools
from cabinllm.runtime.model.vision import read_pictures
from cabinllm.runtime.speech.audio import AudioLimits, Clip, read_clips
from cabinllm.runtime.speech.listen import ListenConfig, listen

HELP_COMMANDS = ("commands: /reset (new conversation), /stats (KV memory), /save FILE, /image PATH (show a picture "
                 "with the next message), /audio PATH (say a message: a WAV clip, any rate, resampled to 16 kHz), "
                 "/quit; Ctrl-C stops a reply")
TOOLS_HELP = "; /tool RESULT answers the reply's call"
BUILTIN_TOOLS = Path(__file__).parent / "data" / "vehicle_functions.json"
DECLINED = '{"error": "not carried out: the user declined this call"}'  # the result of a call not confirmed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of cabin-chat."""
    parser = argparse.ArgumentParser(prog="cabin-chat", description="Chat with a CabinLLM engine on a paged KV cache.")
    parser.add_argument("--engine", required=True, type=Path,
                        help="engine folder written by cabin-build, or graph folder written by cabin-export")
    parser.add_argument("--script", type=Path, help="JSONL dialogue: optional first system line, then user lines (a "
                        "user line may be spoken: {\"role\": \"user\", \"audio\": \"cmd.wav\"}, the path from the "
                        "script's folder; a WAV of any rate and channels, resampled to 16 kHz mono)")
    parser.add_argument("--listen", metavar="SOURCE",
                        help="take spoken commands from raw 16-bit little-endian 16 kHz mono PCM: - for stdin (e.g. "
                             "arecord -f S16_LE -r 16000 -c 1 | cabin-chat --engine E --listen -) or a file; each "
                             "utterance (cut by the VAD at a silence) is a turn, what was heard printed with the reply")
    parser.add_argument("--json", action="store_true", help="print one JSON object per turn")
    parser.add_argument("--system", help="system prompt (default: the engine's, recorded by cabin-build; \"\" for "
                        "none; a script's system line wins)")
    add_cache_flags(parser)
    add_image_flags(parser)
    add_speech_flags(parser, listen=True)
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                        help="tensorrt-llm runs the engine's trt_engine/ through ModelRunnerCpp (needs tensorrt_llm); "
                             "onnxruntime runs the graphs of a cabin-export folder on our paged cache; reference runs "
                             "the PyTorch engine; auto picks by the folder (tensorrt-llm when both are present)")
    parser.add_argument("--ort-provider", choices=tuple(ORT_PROVIDERS), default="cpu",
                        help="ONNX Runtime execution provider of --backend onnxruntime; qnn runs the graphs on "
                             "Qualcomm's HTP (onnxruntime-qnn; its emulator on x86_64) with CPU fallback disabled, "
                             "from the context binaries cabin-export compiled (default cpu)")
    parser.add_argument("--htp-arch", type=int, choices=tuple(HTP_PRECISIONS),
                        help="--ort-provider qnn: this device's HTP architecture; graphs compiled for another are "
                             "refused (default: the one the graphs were compiled for)")
    parser.add_argument("--restore", type=Path, help="continue a session saved with /save (default: a new one)")
    parser.add_argument("--tools", help="functions the replies may call: 'builtin' (the car's climate, seats, windows, "
                        "lights, media, navigation and charging) or a JSON file of OpenAI tool definitions; each call "
                        "is printed and answered by a script's tool line or /tool RESULT (default: none)")
    parser.add_argument("--tool-choice", default="auto",
                        help="with --tools, for the replies to user messages: auto (call or answer), required (always "
                             "call), none, or one function's name (default auto); calls are constrained to valid calls "
                             "by a grammar; the reply to a tool's result is words")
    parser.add_argument("--confirm-below", type=float_range(0, 1, low_included=True), default=0.0, metavar="P",
                        help="with --tools, ask the user to confirm a call whose function name the model gave a "
                             "probability below P (y/n; in --script, a {\"role\": \"user\", \"confirm\": true} line "
                             "after the message; none: declined); a declined call is answered with a result saying "
                             "so (default 0: never ask)")
    parser.add_argument("--choices", type=positive_int, default=1,
                        help="replies per turn, sampled from one prefill on shared KV blocks (seeds --seed, --seed + "
                             "1, ...); the conversation goes on with the first, the others are printed as "
                             "alternatives (default 1; reference engine)")
    parser.add_argument("--beam-width", type=positive_int, default=1,
                        help="beams of a beam search per turn instead of sampling, as transformers' generate "
                             "(num_beams) defines it; the best beam is the reply (default 1: no search)")
    parser.add_argument("--length-penalty", type=float_range(-10, 10, low_included=True),
                        default=BeamParams.length_penalty,
                        help=f"{help_of(BeamParams, 'length_penalty')} (default {BeamParams.length_penalty:g})")
    parser.add_argument("--early-stopping", choices=("true", "false", NEVER), default="false",
                        help=f"{help_of(BeamParams, 'early_stopping')} (default false)")
    add_thread_flag(parser)
    add_device_flag(parser)
    add_sampling_flags(parser)
    return parser.parse_args(argv)


def turn_options(args: argparse.Namespace, session: Session) -> dict:
    """What each turn asks for beyond one sampled reply: --choices or a beam search (ending at the session's stop
    tokens)."""
    if args.beam_width == 1:
        return {"n": args.choices}
    if args.choices > 1:
        raise ConfigError("--choices and --beam-width ask for two ways of several replies; give one of them")
    early = {"true": True, "false": False}.get(args.early_stopping, args.early_stopping)
    return {"beam": BeamParams(args.beam_width, args.max_new_tokens, args.length_penalty, early,
                               tuple(session.params.stop_token_ids))}


def chat_tools(args: argparse.Namespace) -> tuple[Tool, ...]:
    """The tools of --tools, --tool-choice checked against them."""
    if not args.tools:
        if args.tool_choice != "auto":
            raise ConfigError("--tool-choice needs --tools: name the functions the replies may call")
        if args.confirm_below:
            raise ConfigError("--confirm-below needs --tools: it asks about the calls of their functions")
        return ()
    tools = read_tools(BUILTIN_TOOLS if args.tools == "builtin" else args.tools)
    names = [tool.name for tool in tools]
    if args.tool_choice not in ("auto", "required", "none", *names):
        raise ConfigError(f"--tool-choice {args.tool_choice!r}: choose auto, required, none or one of the tools: "
                          f"{', '.join(names)}")
    return tuple(tools)


def session_request(args: argparse.Namespace, system: str | None) -> SessionRequest:
    """The session cabin-chat's flags ask for."""
    asr, audio_limits, _ = speech_settings(args)
    return SessionRequest(args.engine, kv_cache_config(args), sampling_params(args), system,
                          args.overflow, args.backend, args.ort_provider, args.htp_arch, args.restore,
                          chat_tools(args), args.tool_choice, max(args.choices, args.beam_width), image_limits(args),
                          args.device, asr, audio_limits)


def open_chat_session(args: argparse.Namespace, system: str | None) -> Session:
    """Load the engine and start (or restore, saying what it restored) a session on the chosen backend."""
    session = open_session(session_request(args, system))
    if args.restore:
        print(f"cabin-chat: restored {args.restore}: {session.turns} turns ({len(session.messages)} messages), "
              f"{len(session.seq)} tokens of KV, no re-prefill", file=sys.stderr)
    return session


def format_stats(stats: TurnStats) -> str:
    """One human line of a turn's cost."""
    return (f"[{stats.finish_reason}] prefill {stats.prefill_tokens} tok, reused {stats.reused_tokens} tok, "
            f"TTFT {stats.ttft_s * 1000:.0f} ms, {stats.decode_tok_s:.1f} tok/s, "
            f"KV {stats.kv_mode} {stats.kv_bytes_used / 2**20:.2f}/{stats.kv_bytes_budget / 2**20:.2f} MiB "
            f"({stats.kv_bytes_per_token} B/token){format_compacted(stats)}")


def format_compacted(stats: TurnStats) -> str:
    """The media a turn compacted, on a line of their own (none: empty)."""
    if not stats.compacted:
        return ""
    words = {"marker": "a marker", "transcript": "its transcript"}
    return "\n  compacted " + ", ".join(f"{c.name} ({c.tokens} tokens) to {words[c.replacement]}"
                                       for c in stats.compacted)


def format_heard(stats: TurnStats) -> str:
    """What the turn's clips were heard as, a line each (none: empty)."""
    return "".join(f"\n  heard {h['clip']}: {h['text']!r} ({h['audio_s']:.1f} s of audio, ASR {h['asr_s']:.2f} s, "
                   f"RTF {h['rtf']:.2f})" for h in stats.heard)


def format_calls(stats: TurnStats) -> str:
    """The reply's calls, one line each."""
    return "\n".join(f"call {c['id']}: {c['function']['name']}({c['function']['arguments']})" for c in stats.tool_calls)


def calls_to_confirm(stats: TurnStats, below: float) -> list[tuple[dict, float]]:
    """The reply's calls whose function name the model gave a probability below ``below``, with it."""
    return [(call, p) for call, p in zip(stats.tool_calls, stats.call_confidence) if p < below]


def confirm_question(call: dict, probability: float, below: float) -> str:
    """How cabin-chat asks the user to confirm a call."""
    return (f"confirm {call['function']['name']}({call['function']['arguments']})? the model gave this function "
            f"{probability:.0%}, below {below:.0%}")


def reply_choice(message: str | dict) -> str | None:
    """The tool choice of the reply to a message: a tool's result is answered in words (the user's messages by
    --tool-choice)."""
    return "none" if isinstance(message, dict) and message["role"] == "tool" else None


class CallsToAnswer:
    """The calls of the last reply that no tool result has answered yet."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def after(self, stats: TurnStats) -> None:
        """Note the calls a reply made."""
        self.ids = [call["id"] for call in stats.tool_calls]

    def declined(self, call: dict) -> dict:
        """The tool message answering a call the user did not confirm (it no longer waits for a result)."""
        self.ids = [open_id for open_id in self.ids if open_id != call["id"]]
        return {"role": "tool", "tool_call_id": call["id"], "content": DECLINED}

    def result(self, message: dict) -> dict:
        """A tool message answering the next call (its tool_call_id filled in); ConfigError when none is open."""
        if not self.ids:
            raise ConfigError("a tool result answers a call, and the reply before it made none")
        return {**message, "tool_call_id": message.get("tool_call_id") or self.ids.pop(0)}


def run_script(session: Session, turns: list[dict], as_json: bool, options: dict | None = None,
               confirm_below: float = 0.0, audio_limits: AudioLimits | None = None) -> None:
    """Play user turns (and tool results) from a script and print each reply (``options``: turn_options; a spoken
    line's clips read under ``audio_limits``). A call below ``confirm_below`` is confirmed by a confirm line right
    after its message; without one it is declined, and a declined call is answered with ``DECLINED``."""
    calls = CallsToAnswer()

    def play(number: int, message: dict) -> TurnStats | None:
        message = dict(message)
        try:
            stats = session.chat(message, tool_choice=reply_choice(message),
                                 images=read_pictures(message.pop("images", [])),
                                 audio=read_clips(message.pop("audio", []), audio_limits), **(options or {}))
        except (ImageError, AudioError) as err:
            script_error(number, cli_message(err))
            return None
        calls.after(stats)
        return stats

    def show(message: dict, stats: TurnStats, asked: list[tuple[dict, float, bool]]) -> None:
        if as_json:
            shown = stats.to_dict(CLI_WORDS)
            confirmations = [{"id": call["id"], "name": call["function"]["name"], "probability": probability,
                              "confirmed": confirmed} for call, probability, confirmed in asked]
            print(json.dumps({**shown, "confirmations": confirmations} if confirm_below else shown,
                             ensure_ascii=False), flush=True)
            return
        reply = format_calls(stats) if stats.tool_calls else stats.reply
        print(f"{message['role']}> {message['content'] or '(spoken)'}{format_heard(stats)}\nassistant> {reply}"
              f"{format_alternatives(stats)}\n  {format_stats(stats)}", flush=True)
        if stats.error:
            print(f"  error: {stats.error_words(CLI_WORDS)}", flush=True)
        for call, probability, confirmed in asked:
            print(f"  {confirm_question(call, probability, confirm_below)}: {'yes' if confirmed else 'no, declined'}",
                  flush=True)

    number = 0
    while number < len(turns):
        message, number = turns[number], number + 1
        if "confirm" in message:
            script_error(number, "a confirm line answers a call that asked for confirmation, and the reply before it "
                                 "asked none")
            continue
        if message["role"] == "tool":
            try:
                message = calls.result(message)
            except ConfigError as err:
                script_error(number, cli_message(err))
                continue
        stats = play(number, message)
        if stats is None:
            continue
        asked = []
        for call, probability in calls_to_confirm(stats, confirm_below):
            answer = turns[number].get("confirm") if number < len(turns) else None
            if answer is not None:  # the confirm line is used up
                number += 1
            asked.append((call, probability, answer is True))
        show(message, stats, asked)
        for result in [calls.declined(call) for call, _, confirmed in asked if not confirmed]:
            if (stats := play(number, result)) is not None:
                show(result, stats, [])
    if not as_json:
        print(f"after {session.turns} turns: {session.describe_kv()}")


def script_error(number: int, problem: str) -> None:
    """Say that a script's message was not sent and why."""
    print(f"cabin-chat: error: message {number} of the script: {problem}; it was not sent", file=sys.stderr,
          flush=True)


def save_command(session: Session, path: str) -> str:
    """Run /save FILE and say what happened."""
    if not path:
        return "usage: /save FILE"
    try:
        tokens = session.save(path)
    except SessionFileError as err:
        return f"could not save: {cli_message(err)}"
    except OSError as err:
        return f"could not save to {path}: {err.strerror}"
    return f"saved {len(session.messages)} messages and {tokens} tokens of KV to {path}"


def run_command(session: Session, command: str, argument: str) -> str:
    """Run a slash command other than /quit and say what happened."""
    if command == "/reset":
        session.reset()
        return "(conversation reset)"
    if command == "/stats":
        return session.describe_kv()
    if command == "/save":
        return save_command(session, argument)
    return f"unknown command {command}; {HELP_COMMANDS}"


def format_alternatives(stats: TurnStats) -> str:
    """The other replies of a turn, a line each (none: empty)."""
    return "".join(f"\n  alternative {i}> {text}" for i, text in enumerate(stats.alternatives, start=2))


def chat_turn(session: Session, text: str | dict, calls: CallsToAnswer, options: dict | None = None,
              images: list[tuple[str, bytes]] | None = None, audio: list[Clip] | None = None) -> TurnStats | None:
    """Stream the reply to one message (with ``images``, and ``audio``: what was heard is printed after the reply;
    several replies, ``options``, come whole); Ctrl-C stops it and keeps the session. None: the message could not be
    sent."""
    problem = text_problem(text if isinstance(text, str) else text["content"])
    if problem:
        print(f"  error: the message {problem}")
        return None
    interrupted = False

    def on_sigint(signum, frame):
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    print("assistant> ", end="", flush=True)
    try:
        stats = session.chat(text, on_text=lambda piece: print(piece, end="", flush=True),
                             should_stop=lambda: interrupted, tool_choice=reply_choice(text), images=images,
                             audio=audio, **(options or {}))
    finally:
        signal.signal(signal.SIGINT, previous)
    calls.after(stats)
    if stats.alternatives or (options and options.get("beam")):  # not streamed
        print(f"{stats.reply}{format_alternatives(stats)}", end="")
    if stats.tool_calls:
        print(f"\n{format_calls(stats)}", end="")
    print(f"{format_heard(stats)}\n  {format_stats(stats)}")
    if stats.error:
        print(f"  error: {stats.error_words(CLI_WORDS)}")
    return stats


def confirm_calls(session: Session, stats: TurnStats, calls: CallsToAnswer, options: dict | None,
                  below: float) -> None:
    """Ask the user to confirm each call below ``below`` (y/n); a call not confirmed is answered with
    ``DECLINED`` and its reply streamed."""
    for call, probability in calls_to_confirm(stats, below):
        try:
            answer = input(f"  {confirm_question(call, probability, below)} [y/N] ").strip().lower()
        except (EOFError, KeyboardInterrupt, UnicodeDecodeError):
            answer = ""
        if answer not in ("y", "yes"):
            print("  (declined: not carried out)")
            chat_turn(session, calls.declined(call), calls, options)


def run_interactive(session: Session, options: dict | None = None, confirm_below: float = 0.0,
                    audio_limits: AudioLimits | None = None) -> None:
    """A terminal chat with streaming replies (/audio clips read under ``audio_limits``); a command or turn that
    fails is one line and the session is kept."""
    system = session.messages[0]["content"] if session.messages and session.messages[0]["role"] == "system" else None
    calls = CallsToAnswer()
    tools = session.tools
    attached: list[tuple[str, bytes]] = []  # pictures for the next message
    print(f"cabin-chat: {session.describe_kv()}\nsystem prompt: {system or '(none)'}\n{HELP_COMMANDS}"
          f"{TOOLS_HELP if tools else ''}")
    if tools:
        print(f"tools: {', '.join(tool.name for tool in tools)}")
    while True:
        try:
            text = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        except UnicodeDecodeError:
            print("  error: that line is not valid UTF-8 and was not sent; set the terminal to UTF-8")
            continue
        command, _, argument = text.partition(" ")
        if command in ("/quit", "/exit"):
            return
        if not text:
            continue
        try:
            if command == "/tool" and not argument.strip():
                print("usage: /tool RESULT (the result of the reply's call, e.g. {\"ok\": true})")
            elif command == "/tool":
                chat_turn(session, calls.result({"role": "tool", "content": argument.strip()}), calls, options)
            elif command == "/image":
                attached += read_pictures([argument.strip()] if argument.strip() else [])
                print(f"({len(attached)} picture(s) attached, shown with your next message)" if argument.strip()
                      else "usage: /image PATH (a PNG, JPEG or WebP the next message shows)")
            elif command == "/audio" and not argument.strip():
                print("usage: /audio PATH (a WAV clip, any rate and channels: resampled to 16 kHz mono; said as your "
                      "next message)")
            elif command == "/audio":
                clips = read_clips([argument.strip()], audio_limits)
                pictures, attached = attached, []
                stats = chat_turn(session, "", calls, options, pictures, clips)
                if stats:
                    confirm_calls(session, stats, calls, options, confirm_below)
            elif command.startswith("/"):
                print(run_command(session, command, argument.strip()))
            else:
                pictures, attached = attached, []
                stats = chat_turn(session, text, calls, options, pictures)
                if stats:
                    confirm_calls(session, stats, calls, options, confirm_below)
        except Exception as err:  # one failed command or turn never ends the chat
            again = "; attach pictures again with /image" if isinstance(err, ImageError) else ""
            print(f"\n  error: {cli_message(err) or type(err).__name__} (the conversation is kept{again})", flush=True)


def run_listen(session: Session, source: BinaryIO, config: ListenConfig, as_json: bool,
               options: dict | None = None) -> None:
    """Each utterance of a raw PCM stream as a turn, what was heard printed with the reply (``as_json``: one JSON
    object per turn); an utterance that cannot be taken is one line and the listener goes on."""
    calls = CallsToAnswer()
    print(f"cabin-chat: listening (an utterance ends after {config.silence_s:g} s of silence); "
          f"{session.describe_kv()}", file=sys.stderr, flush=True)
    for clip in listen(source, config):
        try:
            if as_json:
                stats = session.chat("", audio=[clip], **(options or {}))
                print(json.dumps(stats.to_dict(CLI_WORDS), ensure_ascii=False), flush=True)
            else:
                print(f"({clip.name}, {clip.seconds:.1f} s)", flush=True)
                chat_turn(session, "", calls, options, audio=[clip])
        except AudioError as err:
            print(f"\ncabin-chat: error: {cli_message(err)}; listening on", file=sys.stderr, flush=True)
    if not as_json:
        print(f"after {session.turns} turns: {session.describe_kv()}")


def check_modes(args: argparse.Namespace) -> None:
    """ConfigError where cabin-chat's ways of taking messages are mixed or cannot run here."""
    if args.listen is None:
        return
    if args.script:
        raise ConfigError("--listen and --script are two sources of messages; give one of them")
    if args.confirm_below:
        raise ConfigError("--confirm-below asks on the terminal, which --listen leaves to the audio; leave one out")
    if args.listen == "-" and sys.stdin.isatty():
        raise ConfigError("--listen - reads raw PCM from standard input, which is a terminal here; pipe a recorder "
                          "into it (arecord -f S16_LE -r 16000 -c 1 | cabin-chat ... --listen -)")


@entry_point("cabin-chat")
def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    try:
        system, turns = read_script(args.script) if args.script else (None, [])
        if args.system and (problem := text_problem(args.system)):
            raise ConfigError(f"--system {problem}")
        check_modes(args)
        _, audio_limits, listen_config = speech_settings(args)
        if args.htp_arch is not None and args.ort_provider != "qnn":
            raise ConfigError(f"--htp-arch names the HTP of --ort-provider qnn, not {args.ort_provider}; add "
                              "--ort-provider qnn or leave --htp-arch out")
        if system is None:
            system = args.system if args.system is not None else EngineFolder(args.engine).system_prompt()
        use_threads(args)
        session = open_chat_session(args, system or None)
        options = turn_options(args, session)
    except CabinError as err:
        print(f"cabin-chat: error: {cli_message(err)}", file=sys.stderr)
        return 2
    try:
        if args.script:
            run_script(session, turns, args.json, options, args.confirm_below, audio_limits)
        elif args.listen is not None:
            with open(args.listen, "rb") if args.listen != "-" else contextlib.nullcontext(sys.stdin.buffer) as source:
                run_listen(session, source, listen_config, args.json, options)
        else:
            run_interactive(session, options, args.confirm_below, audio_limits)
    except (ConfigError, AudioError) as err:  # the backend cannot run the turns as asked; the stream failed
        print(f"cabin-chat: error: {cli_message(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # the output: a full disk under --json > FILE
        print(f"cabin-chat: error: {os_error_message(err, output_name(sys.stdout))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
