"""Session save/restore: same next reply without re-prefill; bad files are clear errors."""
import dataclasses
import os

import pytest
from runtime.kv_cache import KVScales, PagedKVCache
from runtime.sampling import SamplingParams
from runtime.session import DialogueSession
from runtime.session_store import SessionFileError

SYSTEM = "You are the in-car assistant. Answer in one sentence."


def two_turn_session(engine, mode):
    params = SamplingParams(max_new_tokens=10, stop_token_ids=engine.stop_token_ids())
    session = DialogueSession(engine, engine.new_cache(mode, 8 << 20, tokens_per_block=16), params, SYSTEM)
    session.chat("Where is the nearest charger?")
    session.chat("And how long will charging take?")
    return session


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic"])
def test_restored_session_gives_the_same_next_reply_without_reprefill(default_engine, tmp_path, mode):
    session = two_turn_session(default_engine, mode)
    session.save(tmp_path / "s.cabin")
    restored = DialogueSession.restore(tmp_path / "s.cabin", default_engine)
    assert restored.messages == session.messages and restored.fed == session.fed
    want, got = session.chat("Thanks, play the news."), restored.chat("Thanks, play the news.")
    assert got.token_ids == want.token_ids
    assert (got.prefill_tokens, got.reused_tokens) == (want.prefill_tokens, want.reused_tokens)
    assert got.reused_tokens > 3 * got.prefill_tokens  # the history came from the file, not a re-prefill


def test_truncated_file_is_detected_and_previous_save_survives_a_crash(default_engine, tmp_path, monkeypatch):
    session = two_turn_session(default_engine, "int8")
    path = tmp_path / "s.cabin"
    session.save(path)
    good = path.read_bytes()
    cut = tmp_path / "cut.cabin"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(SessionFileError, match="cut short"):
        DialogueSession.restore(cut, default_engine)
    session.chat("One more thing.")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("power lost")))
    with pytest.raises(OSError):
        session.save(path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_other_model_or_other_scales_are_refused(default_engine, tmp_path):
    session = two_turn_session(default_engine, "int8")
    session.save(tmp_path / "s.cabin")
    other_model = dataclasses.replace(default_engine, fingerprint="0000000000000000")
    with pytest.raises(SessionFileError, match="saved with model"):
        DialogueSession.restore(tmp_path / "s.cabin", other_model)
    scales = default_engine.scales
    other = KVScales(k=[s * 2 for s in scales.k], v=scales.v)
    cache = PagedKVCache(default_engine.model.kv_layout, "int8", 8 << 20, 16, other)
    with pytest.raises(SessionFileError, match="scales"):
        DialogueSession.restore(tmp_path / "s.cabin", default_engine, cache)
