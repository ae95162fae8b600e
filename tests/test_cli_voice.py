"""cabin-chat hears: spoken script lines, /audio, --listen on stdin; each bad clip is one line and the session goes on
(the tiny random engine: mechanics; its replies mean nothing)."""
import builtins
import io
import json
import re
import sys
import types

import numpy as np

from cabinllm.cli.chat import main
from cabinllm.runtime.speech import asr
from speech_helpers import command_stream, needs_espeak, speak_wav, wav_bytes

FLAGS = ["--max-new-tokens", "4", "--kv-budget-mb", "8", "--system", "Be brief."]


def write_script(path, lines):
    path.write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    return path


def bad_clips(folder):
    """Clips cabin-chat refuses, by file name: an MP3, a corrupt WAV, ten minutes, one that is not there."""
    (folder / "cmd.mp3").write_bytes(b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(500))
    (folder / "corrupt.wav").write_bytes(wav_bytes(np.zeros(16_000), 16_000)[:-5000])
    (folder / "long.wav").write_bytes(wav_bytes(np.zeros(600 * 8000), 8000))
    return {"cmd.mp3": "MP3 audio is not a WAV file", "corrupt.wav": "cut short",
            "long.wav": "over the 60 s a clip may take; cut it into shorter clips; send clips of 60 s at most "
                        r"\(or raise --audio-max-seconds\)", "missing.wav": "cannot read the audio"}


@needs_espeak
def test_a_script_speaks_and_each_bad_clip_is_one_line(engine_dir, tmp_path, capsys):
    speak_wav("turn the temperature up to twenty two degrees", tmp_path / "cmd.wav")  # 22.05 kHz: resampled
    refused = bad_clips(tmp_path)
    lines = [{"role": "user", "audio": "cmd.wav"}, *({"role": "user", "audio": name} for name in refused),
             {"role": "user", "content": "and the passenger side"}]
    code = main(["--engine", str(engine_dir), "--script", str(write_script(tmp_path / "s.jsonl", lines)), "--json",
                 *FLAGS])
    assert code == 0
    out, err = capsys.readouterr()
    turns = [json.loads(line) for line in out.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    heard = turns[0]["heard"][0]
    assert heard["clip"] == "cmd.wav" and "22 degrees" in heard["text"] and 0 < heard["rtf"] < 1
    assert turns[1]["heard"] == []
    errors = err.strip().splitlines()
    assert len(errors) == len(refused)
    for number, (line, (name, problem)) in enumerate(zip(errors, refused.items()), start=2):
        assert line.startswith(f"cabin-chat: error: message {number} of the script: ") and name in line
        assert line.endswith("it was not sent")
        assert re.search(problem, line), line


@needs_espeak
def test_audio_command_says_a_clip_and_a_bad_one_keeps_the_chat(tiny_engine_dir, tmp_path, monkeypatch, capsys):
    speak_wav("turn the temperature up to twenty two degrees", tmp_path / "cmd.wav")
    bad_clips(tmp_path)
    typed = iter([f"/audio {tmp_path / 'cmd.mp3'}", "/audio", f"/audio {tmp_path / 'cmd.wav'}", "hello", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(typed))
    assert main(["--engine", str(tiny_engine_dir), *FLAGS]) == 0
    out = capsys.readouterr().out
    assert out.count("heard cmd.wav: 'Turn the temperature up to 22 degrees.'") == 1
    assert "error: cmd.mp3: MP3 audio is not a WAV file" in out and "(the conversation is kept)" in out
    assert "usage: /audio PATH" in out and out.count(" prefill ") == 2


def test_without_the_front_end_a_spoken_line_is_one_line_with_the_install(tiny_engine_dir, tmp_path, monkeypatch,
                                                                          capsys):
    (tmp_path / "cmd.wav").write_bytes(wav_bytes(np.full(16_000, 0.1), 16_000))
    script = write_script(tmp_path / "s.jsonl", [{"role": "user", "audio": "cmd.wav"},
                                                 {"role": "user", "content": "Open the sunroof."}])
    monkeypatch.setitem(sys.modules, "faster_whisper", None)
    asr.front_end.cache_clear()
    try:
        assert main(["--engine", str(tiny_engine_dir), "--script", str(script), "--json", *FLAGS]) == 0
    finally:
        asr.front_end.cache_clear()
    out, err = capsys.readouterr()
    assert [json.loads(line)["turn"] for line in out.splitlines()] == [1]
    assert err.strip() == ("cabin-chat: error: message 1 of the script: speech needs the speech front end "
                           "(faster-whisper), which is not installed; install the speech front end: pip install "
                           "'cabinllm[voice]'; it was not sent")


def stdin_of(monkeypatch, data: bytes) -> None:
    """Standard input as a pipe of ``data``."""
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BufferedReader(io.BytesIO(data)),
                                                            isatty=lambda: False))


@needs_espeak
def test_listen_takes_each_utterance_of_stdin_as_a_turn(tiny_engine_dir, tmp_path, monkeypatch, capsys):
    stream, _ = command_stream(["Set the fan speed to three.", "Navigate to the nearest charging station."], [1.5, 1.0],
                               tmp_path)
    stdin_of(monkeypatch, stream + b"\x00" * 32000)
    assert main(["--engine", str(tiny_engine_dir), "--listen", "-", "--json", *FLAGS]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]
    assert [t["heard"][0]["clip"].split(" (")[0] for t in turns] == ["utterance 1", "utterance 2"]
    assert "fan" in turns[0]["heard"][0]["text"].lower() and "charging" in turns[1]["heard"][0]["text"].lower()


def test_listen_with_a_script_a_confirmation_or_a_terminal_is_one_line(tiny_engine_dir, tmp_path, monkeypatch,
                                                                      capsys):
    script = write_script(tmp_path / "s.jsonl", [{"role": "user", "content": "hi"}])
    engine = ["--engine", str(tiny_engine_dir)]
    assert main([*engine, "--listen", "-", "--script", str(script)]) == 2
    assert main([*engine, "--listen", "-", "--tools", "builtin", "--confirm-below", "0.5"]) == 2
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: True))
    assert main([*engine, "--listen", "-"]) == 2
    assert main([*engine, "--listen-max-utterance-s", "90"]) == 2
    assert main([*engine, "--listen", str(tmp_path / "missing.raw")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["cabin-chat: error: --listen and --script are two sources of messages; give one of them",
                   "cabin-chat: error: --confirm-below asks on the terminal, which --listen leaves to the audio; "
                   "leave one out",
                   "cabin-chat: error: --listen - reads raw PCM from standard input, which is a terminal here; pipe a "
                   "recorder into it (arecord -f S16_LE -r 16000 -c 1 | cabin-chat ... --listen -)",
                   "cabin-chat: error: --listen-max-utterance-s 90 is longer than the 60 s a clip may take "
                   "(--audio-max-seconds); lower it",
                   f"cabin-chat: error: {tmp_path / 'missing.raw'}: No such file or directory"]
