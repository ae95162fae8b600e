"""cabin-serve on an audio-language engine: ``input_audio`` parts reach the model as clips (encoder rows in the KV
cache), as a dialogue session sends them, instead of as transcripts. On the tiny random Qwen2-Audio of
cabinllm.benchmarks.random_audio_lm fed real speech (espeak-ng) the replies prove mechanics only: the server's
greedy reply equals a session's on the same engine and clip, a conversation re-sent reuses the clip's blocks (its
digest is in the block hash: other speech of the same length reuses nothing from the clip's block on), and a clip
over the encoder's window is a 400 naming it. The engine is built once for the module (about 2 s); the tests that
hear speech (the front end transcribes each clip) and run the model are slow."""
from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from test_audio_lm import QUESTION, speech
from test_hf_folders import cabin_build

from cabinllm.benchmarks.random_audio_lm import write_random_audio_lm
from cabinllm.runtime.dialogue.interface import TurnStats
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.engine.core import EngineCore
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.speech.audio import Clip
from cabinllm.server.app import ServeConfig, create_app

from test_serve_audio import wav

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
