"""Dialogue sessions on the tiny and the default model: reuse across turns, shared prefixes, capacity, streaming."""
import pytest
from core_helpers import generate

from cabinllm.cli.args import CLI_WORDS
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.generation.streaming import TextStream
from cabinllm.runtime.kv.cache import KvCacheConfig, sized_config

SYSTEM = "You are the in-car assistant. Answer in one sentence."
TURNS = ["Turn on the seat heating, please.", "How long until we reach Munich?", "Play something calm."]
CHINESE = "前方两公里有充电站，预计三分钟到达。空调已调到二十二度。"


def params(engine, n=12):
    return SamplingParams(max_new_tokens=n, stop_token_ids=engine.stop_token_ids())


def new_cache(engine, mode, max_bytes, tokens_per_block=None):
    return engine.new_cache(KvCacheConfig(mode, max_bytes, tokens_per_block))


@pytest.mark.parametrize("mode", ["fp16", "int8-dynamic"])
def test_reusing_history_gives_the_same_reply_as_prefilling_it(engine, mode):
    session = DialogueSession(engine, new_cache(engine, mode, 16 << 20), params(engine), SYSTEM)
    for text in TURNS[:-1]:
        session.chat(text)
    last = session.chat(TURNS[-1])
    assert last.reused_tokens > 0 and last.prefill_tokens < last.reused_tokens
    history = session.fed[: last.reused_tokens + last.prefill_tokens]
    fresh = generate(engine, new_cache(engine, mode, 16 << 20), history, params(engine))
    assert len(history) - fresh.cached_tokens == len(history)
    assert fresh.token_ids == last.token_ids


def test_second_session_reuses_the_shared_system_prompt(engine):
    cache = new_cache(engine, "int8", 16 << 20, tokens_per_block=8)
    first = DialogueSession(engine, cache, params(engine, 4), SYSTEM).chat(TURNS[0])
    second = DialogueSession(engine, cache, params(engine, 4), SYSTEM).chat(TURNS[1])
    assert first.reused_tokens == 0
    assert second.reused_tokens >= 8
    assert cache.stats().reuse_hits >= second.reused_tokens // 8


def test_turn_that_does_not_fit_ends_with_capacity_and_session_stays_usable(engine):
    config = sized_config(engine.model.kv_layout, "fp16", 64, tokens_per_block=16)  # 64 tokens
    session = DialogueSession(engine, engine.new_cache(config), params(engine, 8), SYSTEM)
    stats = session.chat("Tell me everything about the adaptive cruise control. " * 6)
    assert stats.finish_reason == "capacity" and "kv-budget-mb" in stats.error_words(CLI_WORDS)
    session.reset()
    assert session.chat("Hi").finish_reason in ("stop", "length")


def test_streaming_never_splits_a_chinese_character(default_engine):
    tok = default_engine.tokenizer
    ids = tok.encode(CHINESE)
    assert len(ids) > len(CHINESE) // 2  # byte-level tokens: some characters span several ids
    stream = TextStream(tok.decode_reply)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == CHINESE


def test_streaming_holds_back_a_character_until_its_last_byte():
    """The same property without a model: one id per UTF-8 byte, decoded as a byte-level tokenizer does."""
    ids = list(CHINESE.encode("utf-8"))
    stream = TextStream(lambda part: bytes(part).decode("utf-8", errors="replace"))
    pieces = [stream.push(i) for i in ids]
    assert pieces.count("") == len(ids) - len(CHINESE)  # each 3-byte character comes out on its last byte
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == CHINESE
