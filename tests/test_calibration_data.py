"""Dialogue data: the built-in cockpit set, the ShareGPT and JSONL loaders, split and seeded selection."""
from __future__ import annotations

import json

import pytest

from cabinllm.calibration import sharegpt
from cabinllm.calibration.dialogue_data import Dialogue, LoadReport, check_messages
from cabinllm.calibration.jsonl import load_jsonl
from cabinllm.calibration.selection import prepare_dialogues, select_dialogues, split_of, tokenize_dialogue
from cabinllm.calibration.sources import builtin_path, open_source
from cabinllm.calibration.stitch import conversation_order, stitch
from cabinllm.runtime.errors import DataError

from cli_words import raises_in_cli_words


def test_builtin_set_is_big_bilingual_multi_turn_and_canonical():
    text = builtin_path().read_text(encoding="utf-8")
    dialogues, report = open_source("builtin")
    dialogues = list(dialogues)
    assert len(dialogues) >= 150 and report.skipped == 0
    records = [json.loads(line) for line in text.splitlines()]
    # The shipped JSONL is the data (its generator is gone): one UTF-8 object per line, as it was rendered.
    assert text == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    assert all(set(r) == {"id", "language", "messages"} for r in records)
    assert len({r["id"] for r in records}) == len(records) == len(dialogues)
    assert {r["language"] for r in records} == {"en", "zh"}
    for d in dialogues:
        assert d.messages[0]["role"] == "system"
        turns = d.messages[1:]
        assert 4 <= len(turns) <= 16
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
        assert all("{" not in m["content"] for m in turns), "an unfilled slot"
    assert len({json.dumps(d.messages) for d in dialogues}) == len(dialogues)


def _record(i: int) -> dict:
    return {"id": f"conv{i}_{i % 3}", "conversations": [{"from": "human", "value": f"question {i} ü"},
                                                       {"from": "gpt", "value": f"answer {i} 好"}]}


def test_sharegpt_reader_reads_complete_records_of_a_truncated_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sharegpt, "CHUNK_CHARS", 7)  # records straddle many chunk boundaries
    good = [_record(i) for i in range(4)]
    bad = [{"id": "x", "conversations": [{"from": "robot", "value": "hi"}]},
           {"id": "y", "conversations": []},
           {"id": "z"}]
    body = json.dumps(good[:2] + bad + good[2:], indent=2)
    path = tmp_path / "cut.json"
    path.write_text(body[:-1] + ",\n" + json.dumps(_record(9), indent=2)[:40], encoding="utf-8")
    report = LoadReport("test")
    dialogues = list(sharegpt.load_sharegpt(path, report))
    assert [d.id for d in dialogues] == [r["id"] for r in good]
    assert dialogues[0].messages == [{"role": "user", "content": "question 0 ü"},
                                     {"role": "assistant", "content": "answer 0 好"}]
    assert dialogues[1].group == "conv1"
    assert (report.records, report.skipped, report.truncated) == (7, 3, True)
    assert report.skip_reasons == {"unknown role": 1, "no messages": 1, "no conversations list": 1}


def test_sharegpt_reader_on_a_complete_file(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([_record(1), _record(2)]), encoding="utf-8")
    report = LoadReport("test")
    assert len(list(sharegpt.load_sharegpt(path, report))) == 2
    assert not report.truncated and report.skipped == 0


def test_packaged_sharegpt_file_is_read_to_its_last_complete_record():
    dialogues, report = open_source("sharegpt")
    count = sum(1 for _ in dialogues)
    assert report.truncated and report.records > 10_000
    assert count == report.records - report.skipped > 0


def test_jsonl_loader_skips_malformed_lines(tmp_path):
    path = tmp_path / "chats.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
             "{not json",
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
             json.dumps({"id": "a", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                                  {"role": "assistant", "content": "r"}]}),
             '{"messages": [{"role": "user", "content": "cut"}, {"role": "assis']
    path.write_text("\n".join(lines), encoding="utf-8")
    report = LoadReport("test")
    dialogues = list(load_jsonl(path, report))
    assert [d.id for d in dialogues] == ["line-1", "a"]
    assert (report.records, report.skipped, report.truncated) == (5, 3, True)


def test_split_never_overlaps_and_selection_is_seeded():
    train = select_dialogues(open_source("builtin")[0], "train", 1000, seed=1)
    held = select_dialogues(open_source("builtin")[0], "heldout", 1000, seed=1)
    assert train and held and not {d.id for d in train} & {d.id for d in held}
    assert all(split_of(d.id) == "heldout" for d in held)
    first = [d.id for d in select_dialogues(open_source("builtin")[0], "train", 5, seed=1)]
    again = [d.id for d in select_dialogues(open_source("builtin")[0], "train", 5, seed=1)]
    other = [d.id for d in select_dialogues(open_source("builtin")[0], "train", 5, seed=2)]
    assert first == again != other
    assert set(first) <= {d.id for d in train}


def test_dialogues_are_selected_and_cut_to_the_token_budget(engine):
    tok = engine.tokenizer
    # at least 64 tokens: the tiny model's word-level tokenizer makes a Chinese dialogue a few <unk> tokens
    chosen, summary = prepare_dialogues("builtin", "heldout", 2, 0, tok, max_tokens=64, min_tokens=64)
    assert len(chosen) == 2 and all(len(d.token_ids) == 64 for d in chosen)
    assert summary["tokens"] == 128 and summary["split"] == "heldout"
    dialogue = next(d for d in open_source("builtin")[0] if d.id == chosen[0].id)
    full = tokenize_dialogue(dialogue, tok, 10_000).token_ids
    assert len(full) > 64 and full[:64] == chosen[0].token_ids
    with pytest.raises(DataError, match="only .* dialogues of at least 100000 tokens"):
        prepare_dialogues("builtin", "train", 2, 0, tok, max_tokens=100_000, min_tokens=100_000)


def test_dialogues_render_with_the_engine_chat_template(default_engine):
    """The real tokenizer gives back every character of the rendered dialogue, Chinese ones included."""
    tok = default_engine.tokenizer
    chosen, _ = prepare_dialogues("builtin", "heldout", 2, 0, tok, max_tokens=64)
    for chosen_dialogue in chosen:
        dialogue = next(d for d in open_source("builtin")[0] if d.id == chosen_dialogue.id)
        full = tokenize_dialogue(dialogue, tok, 10_000).token_ids
        assert full[:64] == chosen_dialogue.token_ids
        assert tok.decode(full) == tok.render(dialogue.messages, add_generation_prompt=False)
        assert tok.decode(full).startswith("<|im_start|>system\n" + dialogue.messages[0]["content"])
    assert {d.id.split("-")[1] for d in chosen} == {"en", "zh"}


def test_sessions_stitch_consecutive_dialogues_under_one_system_prompt():
    a = Dialogue("conv_1", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
                            {"role": "assistant", "content": "1"}], group="conv")
    b = Dialogue("other", [{"role": "system", "content": "be long"}, {"role": "user", "content": "two"},
                           {"role": "assistant", "content": "2"}])
    c = Dialogue("conv_10", [{"role": "user", "content": "three"}, {"role": "assistant", "content": "3"}], group="conv")
    d = Dialogue("conv_2", [{"role": "user", "content": "four"}, {"role": "assistant", "content": "4"}], group="conv")
    ordered = conversation_order([c, b, a, d])
    # the conversation first met (c's) comes first, its parts in part order; then the other dialogue
    assert [x.id for x in ordered] == ["conv_1", "conv_2", "conv_10", "other"]
    session = stitch([a, b])
    assert session.id == "conv_1+other" and check_messages(session.messages) is None
    assert [m["content"] for m in session.messages] == ["be brief", "one", "1", "two", "2"]


def test_prepare_sessions_reach_the_token_count_from_one_split(engine):
    tok = engine.tokenizer
    chosen, summary = prepare_dialogues("builtin", "heldout", 2, 0, tok, max_tokens=900, min_tokens=900,
                                        sessions=True)
    assert [len(d.token_ids) for d in chosen] == [900, 900] and summary["sessions"] is True
    parts = [part for d in chosen for part in d.id.split("+")]
    assert len(parts) == len(set(parts)) > 2 and all(split_of(p) == "heldout" for p in parts)
    with raises_in_cli_words(DataError, match=r"only 0 heldout dialogues .*cabin-eval --sessions"):
        prepare_dialogues("builtin", "heldout", 1, 0, tok, max_tokens=900, min_tokens=900)
