"""cabin-serve on an audio-language engine: ``input_audio`` parts reach the model as clips (encoder rows in the KV
cache), as a dialogue session sends them, instead of as transcripts. On the tiny random Qwen2-Audio of
cabinllm.benchmarks.random_audio_lm fed real speech (espeak-ng) the replies prove mechanics only: the server's
greedy reply equals a session's on the same engine and clip, a conversation re-sent reuses the clip's blocks (its
digest is in the block hash: other speech of the same length reuses nothing from the clip's block on), an answered
clip compacts to the words the server's speech front end heard, the clip reaches the model without a front end, and
a clip over the encoder's window is a 400 naming it. The engine is built once for the module (about 2 s); the tests
that hear speech (the front end transcribes each clip) and run a session or several requests are slow."""
from __future__ import annotations

import base64
import shutil
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from serve_helpers import metrics
from test_audio_lm import QUESTION, speech
from test_hf_folders import cabin_build
from test_serve_audio import wav

from cabinllm.benchmarks.random_audio_lm import write_random_audio_lm
from cabinllm.runtime.dialogue.interface import TurnStats
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.core import EngineCore
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.speech.asr import SpeechFrontEnd
from cabinllm.runtime.speech.audio import Clip
from cabinllm.server import speech as speech_module
from cabinllm.server.app import ServeConfig, create_app

REPLY_TOKENS = 6
FOLLOW_UP = "and for the passenger?"

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


@pytest.fixture(scope="module")
def alm(tmp_path_factory) -> dict:
    """The tiny random Qwen2-Audio engine (INT8 KV), a spoken command and other speech of the same length."""
    root = tmp_path_factory.mktemp("serve-alm")
    engine = Engine.load(cabin_build(write_random_audio_lm(root / "hf"), root / "engine", kv_cache="int8"))
    heat = speech(root, "Turn on the seat heating.", "heat.wav")
    other = Clip.from_pcm(np.resize(speech(root, "Navigate home.", "route.wav").pcm, len(heat.pcm)), "route.wav")
    return {"engine": engine, "heat": heat, "other": other}


@pytest.fixture(scope="module")
def session_turn(alm) -> tuple[DialogueSession, TurnStats]:
    """A greedy dialogue session's first turn: the spoken command, then the question."""
    engine = alm["engine"]
    chat = DialogueSession(engine, engine.new_cache(KvCacheConfig("int8"), 2), SamplingParams(
        max_new_tokens=REPLY_TOKENS, temperature=0, stop_token_ids=engine.stop_token_ids()))
    return chat, chat.chat(QUESTION, audio=[alm["heat"]])


@pytest.fixture
def server(alm) -> Iterator[tuple[TestClient, EngineCore]]:
    """A cabin-serve app on the engine and its core (a KV cache of its own), the engine thread running."""
    engine = alm["engine"]
    core = engine.new_core(engine.new_cache(KvCacheConfig("int8", 8 << 20), 4))
    with TestClient(create_app(engine, core, ServeConfig("alm", OverflowPolicy("error")))) as client:
        yield client, core


def spoken(clip: Clip, text: str = QUESTION) -> dict:
    """A user message of the clip (as a 16-bit WAV) then ``text``."""
    data = base64.b64encode(wav(clip.pcm)).decode()
    return {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                        {"type": "text", "text": text}]}


def complete(client: TestClient, messages: list[dict]) -> dict:
    """A greedy chat completion with its tokens' log-probabilities (each token's bytes)."""
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": REPLY_TOKENS,
                                                         "temperature": 0, "logprobs": True})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_a_clip_reaches_the_model_as_a_session_sends_it(alm, session_turn, server):
    engine, (chat, turn) = alm["engine"], session_turn
    answer = complete(server[0], [spoken(alm["heat"])])
    stops = set(engine.stop_token_ids())
    assert [bytes(t["bytes"]) for t in answer["choices"][0]["logprobs"]["content"]] == [
        engine.vocabulary.token_bytes(token) for token in turn.token_ids if token not in stops]
    assert answer["usage"]["prompt_tokens"] == turn.prefill_tokens + turn.reused_tokens > chat.seq.media[0].length


@pytest.mark.slow
def test_the_conversation_re_sent_reuses_the_clip_s_blocks(alm, session_turn, server):
    """The second request re-sends the first with its reply and a follow-up: its cached tokens cover the clip. The
    same conversation with other speech of the same length (the same tokens) reuses nothing from the clip's block."""
    (client, core), span = server, session_turn[0].seq.media[0]
    first = complete(client, [spoken(alm["heat"])])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    second = complete(client, [spoken(alm["heat"]), reply, {"role": "user", "content": FOLLOW_UP}])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= span.end
    other = complete(client, [spoken(alm["other"]), reply, {"role": "user", "content": FOLLOW_UP}])
    tokens_per_block = core.cache.tokens_per_block
    assert other["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == span.start // tokens_per_block * tokens_per_block


def test_a_clip_over_the_encoder_s_window_is_a_400_naming_it(alm, server):
    long = Clip.from_pcm(np.resize(alm["heat"].pcm, 31 * 16_000), "long.wav")
    response = server[0].post("/v1/chat/completions", json={"messages": [spoken(alm["heat"], "first"), spoken(long)]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and error["message"].startswith("messages[1] audio 0: 31.0 s of audio is over")
    assert "30 s the model's audio encoder hears at once" in error["message"]
    assert "send clips of 30 s at most" in error["message"]


def test_without_a_speech_front_end_the_model_still_hears_the_clip(alm, server, monkeypatch):
    """The front end is not installed (its import fails): a text engine refuses clips, this engine hears them."""
    monkeypatch.setitem(sys.modules, "faster_whisper", None)
    monkeypatch.setattr(speech_module, "front_end", SpeechFrontEnd)  # not the front end loaded already
    unheard = Clip.from_pcm(alm["heat"].pcm[::-1].copy(), "unheard.wav")  # no transcript kept for it
    answer = complete(server[0], [spoken(unheard)])
    assert answer["usage"]["prompt_tokens"] > alm["engine"].audio.prepare(unheard).tokens
    assert metrics(server[0], "")["cabin_audio_clips_refused_total"] == 0


@pytest.mark.slow
def test_an_answered_clip_compacts_to_the_words_the_server_heard(alm, server):
    """A conversation one clip too long for the KV budget: the answered clip becomes its transcript (the server's
    own, as /v1/audio/transcriptions gives it), the new clip stays a clip."""
    engine, audio = alm["engine"], alm["engine"].audio
    silence = np.zeros(6 * 16_000, dtype=np.float32)  # 8 s of clip (200 tokens) with a transcript of a few words
    heat = Clip.from_pcm(np.concatenate([alm["heat"].pcm, silence]), "heat.wav")
    other = Clip.from_pcm(np.concatenate([alm["other"].pcm, silence]), "route.wav")
    client = server[0]
    words = client.post("/v1/audio/transcriptions", data={"model": "whisper-tiny.en"},
                        files={"file": ("heat.wav", wav(heat.pcm))}).json()["text"]
    first = complete(client, [spoken(heat)])
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    tokenizer = engine.tokenizer.with_audio({c.digest.hex(): audio.prepare(c) for c in (heat, other)},
                                            audio.placeholder)
    asked = {"role": "user", "content": [{"type": "audio", "digest": other.digest.hex()},
                                         {"type": "text", "text": QUESTION}]}
    said = {"role": "user", "content": [{"type": "text", "text": f"[audio: {words}]"},
                                        {"type": "text", "text": QUESTION}]}
    kept = {**said, "content": [{"type": "audio", "digest": heat.digest.hex()}, said["content"][1]]}
    whole, compacted = (len(tokenizer.encode_prompt_media(tokenizer.render([one, reply, asked]))[0])
                        for one in (kept, said))
    tokens_per_block = server[1].cache.tokens_per_block
    pool = -(-(compacted + REPLY_TOKENS) // tokens_per_block) * tokens_per_block
    assert words and pool < whole
    bytes_per_token = server[1].cache.stats().bytes_per_token
    core = engine.new_core(engine.new_cache(KvCacheConfig("int8", pool * bytes_per_token, tokens_per_block), 2))
    assert core.capacity_tokens() == pool
    with TestClient(create_app(engine, core, ServeConfig("alm", OverflowPolicy("error")))) as small:
        answer = complete(small, [spoken(heat), reply, spoken(other)])
    assert answer["usage"]["prompt_tokens"] == compacted
