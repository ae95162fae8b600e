"""Session save/restore: same next reply without re-prefill; a file cut short, damaged, edited or too big for the
cache is refused with one clear message naming it."""
import dataclasses
import json
import os

import pytest
from cli_words import raises_in_cli_words
from safetensors.torch import save

from cabinllm.cli import chat as cli_chat
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.dialogue.session_file import SESSION_FORMAT, read_session_file, write_session_file
from cabinllm.runtime.errors import SessionFileError
from cabinllm.runtime.formats.scales_file import KVScales
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache, sized_config

SYSTEM = "You are the in-car assistant. Answer in one sentence."


def two_turn_session(engine, mode):
    params = SamplingParams(max_new_tokens=10, stop_token_ids=engine.stop_token_ids())
    session = DialogueSession(engine, engine.new_cache(KvCacheConfig(mode, 8 << 20, tokens_per_block=16)), params,
                              SYSTEM)
    session.chat("Where is the nearest charger?")
    session.chat("And how long will charging take?")
    return session


@pytest.mark.parametrize("mode", ["int8", "int8-dynamic", "fp8"])
def test_restored_session_gives_the_same_next_reply_without_reprefill(engine, tmp_path, mode):
    session = two_turn_session(engine, mode)
    assert session.save(tmp_path / "s.cabin") == len(session.fed) > 0
    header, _ = read_session_file(tmp_path / "s.cabin")
    assert header["format"] == SESSION_FORMAT == "cabin-session/3"
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
    with pytest.raises(SessionFileError, match="cabin-session/3"):
        DialogueSession.restore(tmp_path / "old.cabin", engine)
    int4 = DialogueSession(engine, engine.new_cache(KvCacheConfig("int4", 8 << 20, 16)), system_prompt=SYSTEM)
    with pytest.raises(SessionFileError, match="per-token"):
        int4.save(tmp_path / "int4.cabin")
    assert not (tmp_path / "int4.cabin").exists()


def saved_session(engine, tmp_path):
    """A saved two-turn session: its path, header and tensors."""
    path = tmp_path / "s.cabin"
    two_turn_session(engine, "int8").save(path)
    return (path, *read_session_file(path))


def test_overwritten_kv_bytes_are_refused_by_the_checksum(tiny_engine, tmp_path):
    path, _, _ = saved_session(tiny_engine, tmp_path)
    blob = bytearray(path.read_bytes())
    blob[-64:] = bytes(64)  # the end of the K/V data
    path.write_bytes(bytes(blob))
    with pytest.raises(SessionFileError, match="checksum does not match") as refused:
        DialogueSession.restore(path, tiny_engine)
    assert str(refused.value).startswith(f"{path}: ")


def _longer_than_the_context(header, tensors):
    header["fed"] = [1] * 1100  # the tiny model's context is 1024
    return {name: t[:, :1].expand(-1, 1100, *t.shape[2:]).contiguous() for name, t in tensors.items()}


HEADER_EDITS = {  # edit of (header, tensors), returning new tensors or None; what the refusal says
    "token list longer than the KV": (lambda h, t: h["fed"].append(1), "'fed' lists .* tokens but the K/V"),
    "no model fingerprint": (lambda h, t: h.__delitem__("model_fingerprint"),
                             r"the header has no \['model_fingerprint'\]"),
    "unknown params": (lambda h, t: h["params"].update(beam_width=4), r"params has unknown fields \['beam_width'\]"),
    "token id outside the vocabulary": (lambda h, t: h["fed"].__setitem__(3, 10**6),
                                        "token id 1000000 in 'fed' is outside this model's vocabulary"),
    "pending token not an id": (lambda h, t: h.update(pending=["x"]), "pending is .*, expected a list of at most"),
    "NaN temperature": (lambda h, t: h["params"].update(temperature=float("nan")), "params.temperature is NaN"),
    "no tokens per block": (lambda h, t: h["kv_cache"].update(tokens_per_block=0), "kv_cache: .*tokens_per_block"),
    "unknown KV mode": (lambda h, t: h["kv_cache"].update(kv_mode="int3"), "kv_cache.kv_mode is \"int3\""),
    "budget without a block": (lambda h, t: h["kv_cache"].update(max_bytes=100), "holds no block"),
    "no system message": (lambda h, t: h.update(messages=h["messages"][1:]), "start with the system prompt"),
    "turns as text": (lambda h, t: h.update(turns="2"), 'turns is "2", expected an integer'),
    "more tokens than the context": (_longer_than_the_context, "more than this model's context of 1024"),
    "K/V of another model shape": (lambda h, t: {name: x[:2] for name, x in t.items()}, "are not this cache's"),
}


@pytest.mark.parametrize("edit", HEADER_EDITS)
def test_edited_headers_are_refused_with_one_clear_message(tiny_engine, tmp_path, edit):
    path, header, tensors = saved_session(tiny_engine, tmp_path)
    change, message = HEADER_EDITS[edit]
    tensors = change(header, tensors) or tensors
    kept_checksum = {**header, "format": SESSION_FORMAT}
    path.write_bytes(save(tensors, metadata={"session": json.dumps(kept_checksum)}))
    with pytest.raises(SessionFileError, match="checksum does not match"):
        DialogueSession.restore(path, tiny_engine)
    write_session_file(path, header, tensors)  # edited and sealed again: the header itself is checked
    with pytest.raises(SessionFileError, match=message) as refused:
        DialogueSession.restore(path, tiny_engine)
    assert str(refused.value).startswith(f"{path}: ")


def test_restoring_into_a_smaller_cache_is_refused_and_the_session_still_restores_into_a_large_one(tiny_engine,
                                                                                                 tmp_path):
    path, header, _ = saved_session(tiny_engine, tmp_path)
    small = tiny_engine.new_cache(sized_config(tiny_engine.model.kv_layout, "int8", 16, 16))  # one block
    with raises_in_cli_words(SessionFileError, match="raise --kv-budget-mb"):
        DialogueSession.restore(path, tiny_engine, small)
    assert DialogueSession.restore(path, tiny_engine).fed == header["fed"]


def test_cabin_chat_refuses_a_damaged_session_file_with_exit_code_2(tiny_engine, tiny_engine_dir, tmp_path, capsys):
    path, _, _ = saved_session(tiny_engine, tmp_path)
    script = tmp_path / "turn.jsonl"
    script.write_text(json.dumps({"role": "user", "content": "And the weather?"}), encoding="utf-8")
    args = ["--engine", str(tiny_engine_dir), "--restore", str(path), "--script", str(script), "--json",
            "--max-new-tokens", "4", "--kv-budget-mb", "8"]
    assert cli_chat.main(args) == 0
    assert json.loads(capsys.readouterr().out)["reused_tokens"] > 0
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01
    path.write_bytes(bytes(blob))
    assert cli_chat.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cabin-chat: error: {path}: the checksum does not match") and "Traceback" not in err


def test_a_saved_budget_beyond_this_machine_restores_into_a_cache_given_to_it(tiny_engine, tmp_path):
    path, header, tensors = saved_session(tiny_engine, tmp_path)
    write_session_file(path, {**header, "kv_cache": {**header["kv_cache"], "max_bytes": 2**62}}, tensors)
    with pytest.raises(SessionFileError, match="restore it into a smaller cache"):
        DialogueSession.restore(path, tiny_engine)
    cache = tiny_engine.new_cache(KvCacheConfig("int8", 8 << 20, 16))
    assert DialogueSession.restore(path, tiny_engine, cache).fed == header["fed"]


def test_a_missing_session_file_is_not_found_not_cut_short(tiny_engine, tmp_path):
    with pytest.raises(SessionFileError, match="cannot read it") as caught:
        DialogueSession.restore(tmp_path / "missing.cabin", tiny_engine)
    assert "cut short" not in str(caught.value)
