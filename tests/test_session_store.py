"""Session save/restore: same next reply without re-prefill; bad files are clear errors."""
import dataclasses
import os

import pytest
from runtime.dialogue import SessionFileError
from runtime.kv_cache import KvCacheConfig, PagedKVCache
from runtime.kv_storage import KVScales
from runtime.sampling import SamplingParams
from runtime.session import DialogueSession
from runtime.session_store import SESSION_FORMAT, read_session_file, write_session_file

SYSTEM = "You are the in-car assistant. Answer in one sentence."


def two_turn_session(engine, mode):
    params = SamplingParams(max_new_tokens=10, stop_token_ids=engine.stop_token_ids())
    session = DialogueSession(engine, engine.new_cache(KvCacheConfig(mode, 8 << 20, tokens_per_block=16)), params,
                              SYSTEM)
    session.chat("Where is the nearest charger?")
    session.chat("And how long will charging take?")
    return session


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic"])
def test_restored_session_gives_the_same_next_reply_without_reprefill(engine, tmp_path, mode):
    session = two_turn_session(engine, mode)
    assert session.save(tmp_path / "s.cabin") == len(session.fed) > 0
    header, _ = read_session_file(tmp_path / "s.cabin")
    assert header["format"] == SESSION_FORMAT == "cabin-session/2"
    assert header["kv_cache"] == session.cache.config.to_dict()
    restored = DialogueSession.restore(tmp_path / "s.cabin", engine)
    assert restored.cache.config == session.cache.config  # the new cache is built from the saved config
    assert restored.messages == session.messages and restored.fed == session.fed
    want, got = session.chat("Thanks, play the news."), restored.chat("Thanks, play the news.")
    assert got.token_ids == want.token_ids
    assert (got.prefill_tokens, got.reused_tokens) == (want.prefill_tokens, want.reused_tokens)
    assert got.reused_tokens > 3 * got.prefill_tokens  # the history came from the file, not a re-prefill


def test_truncated_file_is_detected_and_previous_save_survives_a_crash(engine, tmp_path, monkeypatch):
    session = two_turn_session(engine, "int8")
    path = tmp_path / "s.cabin"
    session.save(path)
    good = path.read_bytes()
    cut = tmp_path / "cut.cabin"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(SessionFileError, match="cut short"):
        DialogueSession.restore(cut, engine)
    session.chat("One more thing.")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("power lost")))
    with pytest.raises(OSError):
        session.save(path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_other_model_or_other_scales_are_refused(engine, tmp_path):
    session = two_turn_session(engine, "int8")
    session.save(tmp_path / "s.cabin")
    other_model = dataclasses.replace(engine, fingerprint="0000000000000000")
    with pytest.raises(SessionFileError, match="saved with model"):
        DialogueSession.restore(tmp_path / "s.cabin", other_model)
    scales = engine.scales
    other = KVScales(k=[s * 2 for s in scales.k], v=scales.v)
    cache = PagedKVCache(engine.model.kv_layout, KvCacheConfig("int8", 8 << 20, 16), other)
    with pytest.raises(SessionFileError, match="scales"):
        DialogueSession.restore(tmp_path / "s.cabin", engine, cache)


def test_other_format_or_block_storage_is_refused(engine, tmp_path):
    session = two_turn_session(engine, "int8")
    session.save(tmp_path / "s.cabin")
    header, tensors = read_session_file(tmp_path / "s.cabin")
    write_session_file(tmp_path / "old.cabin", {**header, "format": "cabin-session/1"}, tensors)
    with pytest.raises(SessionFileError, match="cabin-session/2"):
        DialogueSession.restore(tmp_path / "old.cabin", engine)
    int4 = DialogueSession(engine, engine.new_cache(KvCacheConfig("int4", 8 << 20, 16)), system_prompt=SYSTEM)
    with pytest.raises(SessionFileError, match="per-token"):
        int4.save(tmp_path / "int4.cabin")
    assert not (tmp_path / "int4.cabin").exists()
