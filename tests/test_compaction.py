"""Media compaction: when a turn does not fit the KV budget, the pictures (and audio clips) of answered turns become
text, oldest first, before the overflow policy drops any word. On a tiny random LLaVA whose pictures take 64 tokens
(random weights prove mechanics only), on a word tokenizer for audio-shaped parts, and the study's spoken dialogue."""
from __future__ import annotations

import argparse
import io
import json
import shutil
from dataclasses import replace

import pytest
from test_hf_folders import cabin_build

from cabinllm.benchmarks.random_vlm import image, write_random_vlm
from cabinllm.benchmarks.studies import media_compaction
from cabinllm.cli.args import CLI_WORDS, overflow_steps
from cabinllm.cli.chat import format_stats
from cabinllm.runtime.dialogue.overflow import (Compacted, OverflowPolicy, Room, answered_media, compacted_steps,
                                                media_replacement, plan_turn)
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.dialogue.session_file import read_session_file, write_session_file
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import AudioError, CapacityError, ConfigError
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.speech.asr import front_end

SYSTEM = "You are the car's assistant."
FIRST = "hello, can you watch the cameras for me while I drive?"
BLOCK = 16
BUDGET_TOKENS = 32 * BLOCK  # a few picture turns: the dialogue overflows by its fifth


def question(i: int) -> str:
    """The user's words of picture turn ``i``."""
    return f"what is in picture {i}?"


def png(i: int) -> bytes:
    """Picture ``i`` (64 x 64, random pixels) as PNG bytes."""
    buffer = io.BytesIO()
    image(64, 64, seed=i).save(buffer, "PNG")
    return buffer.getvalue()


def marker(i: int) -> str:
    """The text that takes picture ``i``'s place."""
    return f"[picture: cam{i}.png]"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    """A tiny random LLaVA whose pictures take 64 tokens, its engine with fp16 KV."""
    root = tmp_path_factory.mktemp("llava-64")
    return Engine.load(cabin_build(write_random_vlm(root / "hf", "llava-64"), root / "engine", kv_cache="fp16"))


def budgeted(engine: Engine, policy: OverflowPolicy) -> DialogueSession:
    """A greedy session whose fp32 KV budget holds BUDGET_TOKENS tokens."""
    config = engine.kv_cache_config(KvCacheConfig("fp32", tokens_per_block=BLOCK))
    cache = engine.new_cache(replace(config, max_bytes=config.bytes_per_token(engine.model.kv_layout) * BUDGET_TOKENS))
    params = SamplingParams(8, temperature=0, stop_token_ids=engine.stop_token_ids())
    return DialogueSession(engine, cache, params, SYSTEM, policy)


def picture_turns(chat: DialogueSession, start: int, until, most: int = 12) -> list:
    """Turns with picture start, start + 1, ... until ``until(stats)``; each turn's stats with the picture spans the
    cache held before it."""
    turns = []
    for i in range(start, start + most):
        held = list(chat.seq.media)
        stats = chat.chat(question(i), images=[(f"cam{i}.png", png(i))])
        assert stats.finish_reason in ("stop", "length"), stats.error
        turns.append((stats, held))
        if until(stats):
            return turns
    raise AssertionError(f"no turn of {most} did what the test waits for")


def user_words(chat: DialogueSession) -> list[str]:
    """The text of every user message, in order."""
    return [m["content"] if isinstance(m["content"], str) else m["content"][-1]["text"]
            for m in chat.messages if m["role"] == "user"]


def test_the_oldest_answered_pictures_go_first_every_word_stays_and_their_blocks_are_freed(engine):
    chat = budgeted(engine, OverflowPolicy("drop-turns"))
    chat.chat(FIRST)
    turns = picture_turns(chat, 0, lambda s: s.compacted)
    stats, held = turns[-1]
    count = len(stats.compacted)
    assert [c.name for c in stats.compacted] == [f"cam{i}.png" for i in range(count)]  # oldest first
    assert stats.compacted == [Compacted(f"cam{i}.png", "picture", 64 - len(marker(i)), "marker")
                               for i in range(count)]  # a byte tokenizer: a token a byte of the marker
    assert stats.evicted_tokens == 0 and user_words(chat) == [FIRST] + [question(i) for i in range(len(turns))]
    shown = [m["content"][0] for m in chat.messages if m["role"] == "user" and isinstance(m["content"], list)]
    assert shown[:count] == [{"type": "text", "text": marker(i)} for i in range(count)]
    assert all(part["type"] == "image" for part in shown[count:])  # the current message's picture among them
    assert {span.digest.hex() for span in chat.seq.media} == set(chat.images)  # the compacted let go, KV and all
    assert len(chat.seq.media) == len(turns) - count  # the pictures left, the current one among them
    assert chat.cache.stats().blocks_in_use == cdiv(len(chat.seq), BLOCK)  # the old sequence's blocks released
    # the prefix before the first compacted picture came from the cache; what follows it was prefilled again
    assert stats.reused_tokens == held[0].start // BLOCK * BLOCK > BLOCK
    assert stats.prefill_tokens + stats.reused_tokens == len(chat.seq) - len(stats.token_ids) + 1
    assert f"compacted cam0.png ({64 - len(marker(0))} tokens) to a marker" in format_stats(stats)
    assert stats.to_dict(CLI_WORDS)["compacted"][0] == {"name": "cam0.png", "kind": "picture",
                                                       "tokens": 64 - len(marker(0)), "replacement": "marker"}


def test_the_policy_runs_only_once_compaction_cannot_make_room(engine):
    chat = budgeted(engine, OverflowPolicy("drop-turns"))
    chat.chat(FIRST)
    turns = picture_turns(chat, 0, lambda s: s.evicted_tokens)
    stats, _ = turns[-1]
    assert any(s.compacted for s, _ in turns[:-1])  # earlier overflows compacted alone
    assert stats.compacted  # this one compacted what was left, then dropped turns
    assert FIRST not in user_words(chat)
    kept_pictures = [p for m in chat.messages for p in (m["content"] if isinstance(m["content"], list) else [])
                     if p["type"] == "image"]
    assert kept_pictures == [chat.messages[-2]["content"][0]]  # only the current message shows a picture
    # the policy alone: the first overflow drops turns, pictures and words with them
    alone = budgeted(engine, OverflowPolicy("drop-turns", compact_media=False))
    alone.chat(FIRST)
    alone_turns = picture_turns(alone, 0, lambda s: s.evicted_tokens)
    assert all(s.compacted == [] for s, _ in alone_turns) and len(alone_turns) < len(turns)
    assert FIRST not in user_words(alone)


def test_the_current_messages_pictures_are_never_compacted_and_a_refused_turn_changes_nothing(engine):
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "image", "digest": "a" * 32}, {"type": "text", "text": "q"}]},
                {"role": "assistant", "content": "r"},
                {"role": "user", "content": [{"type": "image", "digest": "b" * 32}, {"type": "text", "text": "q"}]}]
    assert answered_media(messages) == [(1, 0)]
    assert answered_media(messages[:2]) == []
    chat = budgeted(engine, OverflowPolicy("error"))
    picture_turns(chat, 0, lambda s: len(chat.seq.media) == 2)
    before, images = [dict(m) for m in chat.messages], dict(chat.images)
    many = [(f"big{i}.png", png(50 + i)) for i in range(4)]  # fits alone; not beside the words, pictures compacted
    stats = chat.chat("compare these four pictures of the road ahead " * 3, images=many)
    assert stats.finish_reason == "capacity" and stats.compacted == []
    assert chat.messages == before and chat.images.keys() >= images.keys()


def test_a_restored_session_continues_as_the_compacted_one_does(engine, tmp_path):
    chat = budgeted(engine, OverflowPolicy("drop-turns"))
    chat.chat(FIRST)
    picture_turns(chat, 0, lambda s: s.compacted)
    chat.save(tmp_path / "s.cabin")
    restored = DialogueSession.restore(tmp_path / "s.cabin", engine)
    assert restored.messages == chat.messages and restored.images.keys() == chat.images.keys()
    assert [i.name for i in restored.images.values()] == [i.name for i in chat.images.values()]
    header, tensors = read_session_file(tmp_path / "s.cabin")  # a file from before compaction: compaction is on
    for key in ("format", "sha256", "image_names"):
        header.pop(key)
    header["overflow"].pop("compact_media")
    write_session_file(tmp_path / "old.cabin", header, tensors)
    old = DialogueSession.restore(tmp_path / "old.cabin", engine)
    assert old.overflow == OverflowPolicy("drop-turns") and old.messages == chat.messages
    ours = picture_turns(chat, 10, lambda s: s.compacted)
    theirs = picture_turns(restored, 10, lambda s: s.compacted)
    assert [(s.token_ids, s.compacted) for s, _ in theirs] == [(s.token_ids, s.compacted) for s, _ in ours]
    assert restored.messages == chat.messages


class WordTokenizer:
    """Enough of a ChatTokenizer to plan turns: a token a word, and an audio part 25 tokens a second of its clip
    (Qwen2-Audio's rate), its length by digest in ``seconds``."""

    images: dict = {}

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return " ".join(f"<{m['role']}> {self._content(m['content'])}" for m in messages) + \
            (" <assistant>" if add_generation_prompt else "")

    def _content(self, content: str | list[dict]) -> str:
        if isinstance(content, str):
            return content
        return " ".join(p["text"] if p["type"] == "text" else
                        " ".join(["<audio>"] * int(25 * self.seconds[p["digest"]])) for p in content)

    def encode_prompt(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def encode_prompt_media(self, text: str) -> tuple[list[int], list]:
        return self.encode_prompt(text), []

    def frame_tokens(self, messages: list[dict], prompt: str) -> tuple[int, int]:
        return len(self.render(messages[:1], False).split()), len(self.render(messages[-1:]).split())


def test_an_audio_part_is_compacted_to_its_transcript():
    said = "turn the seat heating on please"
    clip = {"type": "audio", "digest": "c" * 32, "transcript": said}
    assert media_replacement(clip, "audio cccc") == ({"type": "text", "text": f"[audio: {said}]"},
                                                     Compacted("audio cccc", "audio", 0, "transcript"))
    tokenizer = WordTokenizer({"c" * 32: 4.0, "d" * 32: 4.0})  # 100 tokens each
    messages = [{"role": "system", "content": "you drive"},
                {"role": "user", "content": [clip]}, {"role": "assistant", "content": "done"},
                {"role": "user", "content": [{"type": "audio", "digest": "d" * 32, "transcript": "and warmer"}]}]
    whole = len(tokenizer.render(messages).split())
    capacity = whole - 60 + 8  # 60 tokens short of the conversation and its 8-token reply
    room = Room(capacity, lambda n: n <= capacity, appends_turns=False)
    plan = plan_turn(tokenizer, messages, room, OverflowPolicy("error"), 0, 8)
    freed = 100 - len(f"[audio: {said}]".split())
    assert plan.compacted == [Compacted(f"audio {'c' * 12}", "audio", freed, "transcript")]
    assert plan.messages[1]["content"] == [{"type": "text", "text": f"[audio: {said}]"}]
    assert plan.messages[3] == messages[3] and len(plan.feed) == whole - freed
    with pytest.raises(CapacityError):  # the policy alone refuses
        plan_turn(tokenizer, messages, room, OverflowPolicy("error", compact_media=False), 0, 8)
    tokenizer.seconds["c" * 32] = 0.2  # 5 tokens: its transcript would take more, so it stays
    assert list(compacted_steps(tokenizer, messages, tokenizer.render(messages))) == []


def test_an_audio_part_without_a_transcript_compacts_to_a_marker_naming_its_clip():
    """No speech front end (no transcript) or no words heard: the clip becomes ``[audio: <its name>]``, never an
    empty ``[audio: ]``."""
    for part in ({"type": "audio", "digest": "c" * 32}, {"type": "audio", "digest": "c" * 32, "transcript": " "}):
        assert media_replacement(part, "heat.wav") == ({"type": "text", "text": "[audio: heat.wav]"},
                                                       Compacted("heat.wav", "audio", 0, "marker"))
    tokenizer = WordTokenizer({"c" * 32: 4.0, "d" * 32: 4.0})
    tokenizer.images = {"c" * 32: argparse.Namespace(name="heat.wav")}  # the clips the session holds, by digest
    messages = [{"role": "user", "content": [{"type": "audio", "digest": "c" * 32}]},
                {"role": "assistant", "content": "done"},
                {"role": "user", "content": [{"type": "audio", "digest": "d" * 32}]}]
    (rendering, compacted), = compacted_steps(tokenizer, messages, tokenizer.render(messages))
    assert rendering.messages[0]["content"] == [{"type": "text", "text": "[audio: heat.wav]"}]
    assert compacted == [Compacted("heat.wav", "audio", 100 - 2, "marker")]


def test_overflow_steps_name_compaction_then_one_policy():
    assert OverflowPolicy.from_steps("compact-media,drop-turns") == OverflowPolicy("drop-turns")
    assert OverflowPolicy.from_steps("error") == OverflowPolicy("error", compact_media=False)
    assert OverflowPolicy().steps == "compact-media,sink-window"
    for wrong in ("drop-turns,compact-media", "compact-media", "compact-media,error,drop-turns", ""):
        with pytest.raises(ConfigError):
            OverflowPolicy.from_steps(wrong)
    with pytest.raises(argparse.ArgumentTypeError, match="optionally after compact-media"):
        overflow_steps("drop-turns,compact-media")


def test_cabin_chat_prints_and_reports_what_it_compacted(engine, tmp_path, capsys):
    from cabinllm.cli.chat import main

    lines = [{"role": "user", "content": FIRST}]
    for i in range(6):
        (tmp_path / f"cam{i}.png").write_bytes(png(i))
        lines.append({"role": "user", "content": question(i), "images": [f"cam{i}.png"]})
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(line) for line in lines), encoding="utf-8")
    mib = BUDGET_TOKENS * engine.kv_cache_config().bytes_per_token(engine.model.kv_layout) / 2**20
    argv = ["--engine", str(engine.folder), "--script", str(tmp_path / "d.jsonl"), "--max-new-tokens", "8",
            "--temperature", "0", "--kv-budget-mb", f"{mib}", "--overflow", "compact-media,drop-turns"]
    assert main(argv) == 0
    assert "compacted cam0.png (45 tokens) to a marker" in capsys.readouterr().out
    assert main(argv + ["--json"]) == 0
    turns = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [c["name"] for t in turns for c in t["compacted"]][:1] == ["cam0.png"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_the_audio_study_keeps_every_spoken_turn_where_drop_turns_alone_keeps_one(tmp_path):
    """The study's audio path, 3 spoken turns in 12 MiB (438 tokens: one spoken turn of about 245): compaction turns
    the answered clips into their transcripts and keeps all three; drop-turns alone keeps the last."""
    assert media_compaction.main(["--media", "audio", "--turns", "3", "--kv-budget-mb", "12", "--work",
                                  str(tmp_path / "work"), "--output", str(tmp_path / "audio")]) == 0
    result = json.loads((tmp_path / "audio.json").read_text(encoding="utf-8"))
    on, off = result["summary"]["compaction on"], result["summary"]["compaction off"]
    assert on["turns_held_at_end"] == 3 and on["media_compacted"] == 2 and on["tokens_evicted"] == 0
    assert off["turns_held_at_end"] == 1 and off["media_compacted"] == 0 and off["tokens_evicted"] > 0
    assert max(on["peak_kv_bytes"], off["peak_kv_bytes"]) <= result["budget_bytes"]
    try:
        front_end()
    except AudioError:  # no front end: the clips compacted to markers naming them
        assert on["to_transcripts"] == 0
    else:
        assert on["to_transcripts"] == 2
    assert "| compaction on | compacts, spoken turn | 2 |" in (tmp_path / "audio.md").read_text(encoding="utf-8")
