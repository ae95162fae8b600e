"""cabin-serve hears: ``input_audio`` parts of chat completions read as their transcripts in their place, and
``/v1/audio/transcriptions`` through the real openai client, over the real speech front end (Whisper tiny.en) and
speech that espeak-ng makes. On the tiny random engine with a tokenizer of every byte the replies prove mechanics
only: a spoken command and its transcript typed are the same prompt (the same tokens, the same greedy reply or
tool call). Every clip the server cannot take is a 400 naming it, counted in /metrics; a request over the speech
thread's queue is a 429; no fuzzed body gets a 5xx.
The default 135M model turning the spoken command into the right tool call is the slow test at the end."""
from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import subprocess
import sys
import wave

import httpx
import jiwer
import jsonschema
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cabinllm.cli.args import speech_settings
from cabinllm.cli.chat import BUILTIN_TOOLS
from cabinllm.cli.serve import parse_args
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.speech.asr import AsrConfig, SpeechFrontEnd
from cabinllm.runtime.speech.audio import AudioLimits
from cabinllm.server import speech as speech_module
from cabinllm.server.app import ServeConfig, create_app

from serve_helpers import metrics, running_server

SPOKEN = "turn on the seat heater"
ASR_MODEL = "whisper-tiny.en"
CHOSEN = ("set_seat_heating", "set_window", "play_media")  # a byte per token: a few tools keep the prompt short
TOOLS = [tool for tool in json.loads(BUILTIN_TOOLS.read_text(encoding="utf-8")) if tool["function"]["name"] in CHOSEN]
SYSTEM = {"role": "system", "content": "You control the car."}


def wav(pcm: np.ndarray, rate: int = 16_000, width: int = 2) -> bytes:
    """Float samples in [-1, 1] as a mono PCM WAV file of ``width`` bytes a sample."""
    kind = {1: np.uint8, 2: "<i2"}[width]
    samples = (pcm * 127 + 128) if width == 1 else pcm * 32767
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(width)
        file.setframerate(rate)
        file.writeframes(samples.round().astype(kind).tobytes())
    return out.getvalue()


def tone(seconds: float, hz: float = 440.0, rate: int = 16_000, width: int = 2) -> bytes:
    """A sine tone as a WAV file (no speech: for what is refused before the front end hears anything)."""
    t = np.arange(int(seconds * rate)) / rate
    return wav(0.3 * np.sin(2 * np.pi * hz * t), rate, width)


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    """An OpenAI ``input_audio`` content part."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


@pytest.fixture(scope="module")
def spoken(tmp_path_factory) -> bytes:
    """The spoken command, as espeak-ng says it."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("needs espeak-ng to speak the test command")
    path = tmp_path_factory.mktemp("speech") / "heater.wav"
    subprocess.run(["espeak-ng", "-s", "140", "-w", str(path), SPOKEN], check=True, timeout=60, capture_output=True)
    return path.read_bytes()


@pytest.fixture(scope="module")
def server(bytes_engine_dir):
    with running_server(bytes_engine_dir, "--kv-budget-mb", "32", "--audio-max-clips", "2",
                        "--max-request-audio", "5") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def transcript(client, spoken) -> str:
    """The server's transcript of the spoken command: the one clip this module's server hears (then keeps)."""
    return client.audio.transcriptions.create(model=ASR_MODEL, file=("heater.wav", spoken)).text


def _words(text: str) -> str:
    return " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())


def test_transcriptions_answer_the_openai_client_in_each_format(client, spoken, transcript):
    assert jiwer.wer(SPOKEN, _words(transcript)) <= 0.2, transcript
    text = client.audio.transcriptions.create(model=ASR_MODEL, file=("heater.wav", spoken), response_format="text")
    assert text.strip() == transcript
    verbose = client.audio.transcriptions.create(model=ASR_MODEL, file=("heater.wav", spoken),
                                                 response_format="verbose_json", language="en", temperature=0,
                                                 timestamp_granularities=["segment"])
    with wave.open(io.BytesIO(spoken)) as file:
        seconds = file.getnframes() / file.getframerate()
    assert verbose.text == transcript and verbose.duration == pytest.approx(seconds, abs=1e-3)
    assert verbose.segments and " ".join(s.text for s in verbose.segments) == transcript
    assert all(0 <= s.start < s.end for s in verbose.segments)
    srt = client.audio.transcriptions.create(model=ASR_MODEL, file=("heater.wav", spoken), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and transcript in srt
    vtt = client.audio.transcriptions.create(model=ASR_MODEL, file=("heater.wav", spoken), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and transcript in vtt


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
def test_a_spoken_part_is_read_as_its_transcript_in_its_place(client, spoken, transcript, tools):
    heard = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Please:"}, audio_part(spoken)]}]
    typed = [SYSTEM, {"role": "user", "content": f"Please: {transcript}"}]
    asked = dict(model="tiny", temperature=0, max_tokens=300 if tools else 16)
    if tools:
        asked.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    by_voice, by_hand = (client.chat.completions.create(messages=m, **asked) for m in (heard, typed))
    assert by_voice.usage.prompt_tokens == by_hand.usage.prompt_tokens  # a byte a token: the same prompt's length
    voice, hand = by_voice.choices[0].message, by_hand.choices[0].message
    assert voice.content == hand.content
    if tools:
        calls = [(c.function.name, c.function.arguments) for c in voice.tool_calls]
        assert calls == [(c.function.name, c.function.arguments) for c in hand.tool_calls]
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
        for name, arguments in calls:  # a valid call: the grammar's doing on random weights
            jsonschema.validate(json.loads(arguments), schemas[name])


def test_metrics_count_audio_asr_seconds_and_clips(client, server, spoken, transcript):
    with httpx.Client() as http:
        before = metrics(http, server)
        assert before["cabin_audio_clips_transcribed_total"] >= 1
        assert before["cabin_audio_seconds_total"] >= 1.0 and before["cabin_asr_seconds_total"] > 0
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [audio_part(spoken)]}])  # heard before: kept, not heard again
        refused = http.post(f"{server}/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [audio_part(b"ID3\x04" + bytes(64), "mp3")]}]})
        after = metrics(http, server)
    assert refused.status_code == 400
    assert after["cabin_audio_clips_reused_total"] == before["cabin_audio_clips_reused_total"] + 1
    assert after["cabin_audio_clips_transcribed_total"] == before["cabin_audio_clips_transcribed_total"]
    assert after["cabin_audio_clips_refused_total"] == before["cabin_audio_clips_refused_total"] + 1


def _riff(chunks: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", len(chunks) + 4) + b"WAVE" + chunks


TEN_MINUTES = tone(600, hz=100, rate=1_000, width=1)  # 600 kB: within the body limit, 10 times a clip's cap
REFUSED_PARTS = [
    ([audio_part(b"ID3\x04" + bytes(64), "mp3")], "messages", "audio 0: mp3 audio is not read here; send format wav"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "ogg"}}], "messages[0].content",
     "part 0: input_audio.format must be one of wav, mp3, got \"ogg\""),
    ([{"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}], "messages[0].content",
     "part 0: input_audio.data holds invalid base64"),
    ([{"type": "input_audio", "input_audio": "UklGRg=="}], "messages[0].content",
     'part 0: input_audio must be {"data": "<base64>", "format": "wav"}'),
    ([audio_part(b"RIFF\x24\x00\x00\x00WAVEjunk" + bytes(40))], "messages", "audio 0: not a readable PCM WAV"),
    ([audio_part(b"ID3\x04" + bytes(64))], "messages", "audio 0: MP3 audio is not a WAV file"),
    ([audio_part(tone(1.0)[:-1000])], "messages", "audio 0: the WAV file is cut short"),
    ([audio_part(TEN_MINUTES)], "messages",
     "audio 0: 600.0 s of audio is over the 60 s a clip may take; cut it into shorter clips; send clips of 60 s at "
     "most"),
    ([audio_part(tone(70, rate=22_050, width=1))], "messages", "audio 0: 70.0 s of audio is over the 60 s"),
    ([audio_part(_riff(b"fmt \x10\x00\x00\x00\x01\x00\x01\x00\xff\xff\xff\x7f\x00\x00\x00\x00\x02\x00\x10\x00"
                       b"data\x08\x00\x00\x00" + bytes(8)))], "messages",
     "audio 0: a sample rate of 2,147,483,647 Hz is not read"),
    ([audio_part(_riff(b"b\xc2\xe3k\nB\xf7\x82|g" + bytes(20)))], "messages", "audio 0: not a readable PCM WAV"),
    ([audio_part(tone(0.5, hz=h)) for h in (300, 400, 500)], "messages",
     "messages[0] sends 3 clips, more than the 2 one message may send"),
    ([audio_part(tone(3.0, hz=h)) for h in (300, 400)], "messages",
     "the request's clips hold 6.0 s of audio, over the 5 s one request may send (--max-request-audio)"),
    ([audio_part(wav(np.zeros(16_000)))], "messages[0].content", "no speech was heard in its audio"),
]


@pytest.mark.parametrize("content, param, message", REFUSED_PARTS, ids=[m[:40] for _, _, m in REFUSED_PARTS])
def test_a_clip_the_server_cannot_take_is_a_400_naming_it(server, content, param, message):
    response = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("part", [{"type": {}, "input_audio": {"data": "", "format": "wav"}},
                                  {"type": ["input_audio"]}, {"type": "input_audio", "input_audio": None},
                                  {"type": "input_audio", "input_audio": {"data": 7, "format": "wav"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": {}}}])
def test_a_malformed_spoken_part_is_a_400(server, part):
    response = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[0].content"


def test_a_spoken_part_is_for_user_messages_only(server, spoken):
    response = httpx.post(f"{server}/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [audio_part(spoken)]}]})
    assert response.status_code == 400
    assert "input_audio parts in user messages only" in response.json()["error"]["message"]


REFUSED_FORMS = [
    ({"language": "de"}, 400, "language", "hears English only"),
    ({"prompt": "seat heater"}, 400, "prompt", "leave it out"),
    ({"temperature": "0.7"}, 400, "temperature", "0.7 asks for sampled decoding"),
    ({"timestamp_granularities[]": "word"}, 400, "timestamp_granularities[]", "segments only"),
    ({"include[]": "logprobs"}, 400, "include[]", "log-probabilities"),
    ({"stream": "true"}, 400, "stream", "streamed transcript"),
    ({"response_format": "xml"}, 400, "response_format", "response_format is invalid"),
    ({"model": "whisper-1"}, 404, "model", "send model 'whisper-tiny.en'"),
]


@pytest.mark.parametrize("fields, status, param, message", REFUSED_FORMS, ids=[f[2] for f in REFUSED_FORMS])
def test_a_transcription_field_the_server_does_not_act_on_is_refused_by_name(server, fields, status, param, message):
    form = {"model": ASR_MODEL, **fields}
    response = httpx.post(f"{server}/v1/audio/transcriptions", data=form, files={"file": ("t.wav", tone(0.5))})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_transcription_of_no_wav_or_no_file_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError, match="clip.mp3: MP3 audio is not a WAV file"):
        client.audio.transcriptions.create(model=ASR_MODEL, file=("clip.mp3", b"ID3\x04" + bytes(64)))
    response = httpx.post(f"{server}/v1/audio/transcriptions", data={"model": ASR_MODEL})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


def test_without_a_speech_front_end_a_clip_is_a_400_for_the_operator(server, monkeypatch):
    """No front end installed is how this server is set up, not a fault of its: the same request would fail again
    (a 5xx would be retried in vain by OpenAI's clients), as an image_url part on a text engine is a 400."""
    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # the import fails as when it is not installed
    monkeypatch.setattr(speech_module, "front_end", SpeechFrontEnd)  # not the front end loaded already
    with httpx.Client(timeout=60) as http:
        before = metrics(http, server)["cabin_audio_clips_refused_total"]
        chat = http.post(f"{server}/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [audio_part(tone(0.5, hz=250))]}]})
        file = http.post(f"{server}/v1/audio/transcriptions", data={"model": ASR_MODEL},
                         files={"file": ("t.wav", tone(0.5, hz=260))})
        assert metrics(http, server)["cabin_audio_clips_refused_total"] == before + 2
    for response in (chat, file):
        assert response.status_code == 400
        assert "ask the server's operator to install the speech front end (pip install 'cabinllm[voice]')" in \
            response.json()["error"]["message"]


FMT_CHUNKS = st.builds(  # a WAV's fmt and data chunks with any fields: too few samples to hold speech
    lambda tag, channels, width, rate, data, claimed: _riff(
        b"fmt " + struct.pack("<IHHIIHH", 16, tag, channels, rate, rate * channels * width % 2 ** 32,
                              channels * width % 2 ** 16, 8 * width) + b"data" + struct.pack("<I", claimed(len(data)))
        + data),
    st.sampled_from([1, 3, 0xFFFE]), st.integers(0, 300), st.integers(0, 8), st.integers(0, 2 ** 32 - 1),
    st.binary(max_size=64), st.sampled_from([lambda n: n, lambda n: n + 9, lambda n: 0, lambda n: 2 ** 32 - 1]))


def test_a_request_over_the_speech_thread_s_queue_is_told_to_retry(tiny_engine):
    app = create_app(tiny_engine, tiny_engine.new_core(tiny_engine.new_cache(KvCacheConfig("int8", 1 << 20)),
                                                       SchedulerConfig(max_queue=2)),
                     ServeConfig("tiny", OverflowPolicy("error")))
    app.state.speech.waiting = 2  # two requests wait for the speech thread (no engine thread: nothing runs here)
    client = TestClient(app)
    clip = tone(0.5)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [audio_part(clip)]}]})
    file = client.post("/v1/audio/transcriptions", data={"model": ASR_MODEL}, files={"file": ("t.wav", clip)})
    for response in (chat, file):
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert "waiting for the speech front end" in response.json()["error"]["message"]
        assert "--max-queue 2" in response.json()["error"]["message"]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.binary(max_size=200).map(_riff), FMT_CHUNKS), fmt=st.sampled_from(["wav", "mp3"]))
def test_no_fuzzed_clip_gets_a_5xx(server, body, fmt):
    with httpx.Client(timeout=60) as http:
        chat = http.post(f"{server}/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [audio_part(body, fmt)]}]})
        file = http.post(f"{server}/v1/audio/transcriptions", data={"model": ASR_MODEL}, files={"file": ("f", body)})
    assert chat.status_code == 400 and file.status_code == 400


def test_the_speech_flags_make_the_front_end_and_the_clip_caps(tmp_path, tiny_engine_dir):
    args = parse_args(["--engine", str(tiny_engine_dir), "--asr-threads", "2", "--audio-max-seconds", "30",
                       "--audio-max-clips", "1", "--max-request-audio", "90"])
    assert speech_settings(args) == (AsrConfig(threads=2), AudioLimits(30.0, 1), None)
    assert args.max_request_audio_s == 90.0
    with pytest.raises(ConfigError, match="--asr-model .*: no CTranslate2 Whisper model there"):
        speech_settings(parse_args(["--engine", str(tiny_engine_dir), "--asr-model", str(tmp_path)]))


def test_the_default_model_calls_the_tool_a_spoken_command_asks_for(default_engine_dir, spoken):
    tools = json.loads(BUILTIN_TOOLS.read_text(encoding="utf-8"))
    with running_server(default_engine_dir) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", temperature=0, max_tokens=128, tools=tools,
                                               tool_choice="required", parallel_tool_calls=False,
                                               messages=[{"role": "user", "content": [audio_part(spoken)]}])
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    assert calls[0].function.name == "set_seat_heating", calls
    assert json.loads(calls[0].function.arguments)["level"] > 0, calls[0].function.arguments
