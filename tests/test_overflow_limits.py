"""Overflow at the edges: a policy never cuts into the current message, drop-turns evicts as far as the turn
needs, and a turn that cannot fit says what does not fit."""
from __future__ import annotations

from cabinllm.cli.args import CLI_WORDS
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import sized_config

SYSTEM = "navigate to the station"
SHORT = "set cabin temperature"
LONG = " ".join(["play some jazz what does the charging light mean"] * 5)  # words the tiny vocabulary knows
REPLY = 8


def session(engine, policy: str, tokens: int) -> DialogueSession:
    """A session of the tiny engine on an fp16 cache that holds ``tokens`` tokens, short replies."""
    cache = engine.new_cache(sized_config(engine.model.kv_layout, "fp16", tokens, tokens_per_block=16))
    params = SamplingParams(max_new_tokens=REPLY, stop_token_ids=[])
    return DialogueSession(engine, cache, params, SYSTEM, OverflowPolicy(policy))


def message_ids(engine, messages: list[dict]) -> list[int]:
    """The ids of the last message with its template headers and the generation prompt."""
    tok = engine.tokenizer
    return tok.encode(tok.render(messages)[len(tok.render(messages[:-1], add_generation_prompt=False)):])


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_sink_window_keeps_the_whole_current_message_and_the_system_prompt(tiny_engine):
    chat = session(tiny_engine, "sink-window", 96)
    for _ in range(3):
        assert chat.chat(SHORT).finish_reason != "capacity"
    messages = chat.messages + [{"role": "user", "content": LONG}]
    stats = chat.chat(LONG)
    assert stats.finish_reason != "capacity" and stats.evicted_tokens > 0
    tok = tiny_engine.tokenizer
    system = tok.encode_prompt(tok.render(messages[:1], add_generation_prompt=False))
    assert chat.fed[:len(system)] == system
    assert contains(chat.fed, message_ids(tiny_engine, messages)), "the window cut into the current message"


def test_drop_turns_evicts_as_far_as_the_turn_needs(tiny_engine):
    chat = session(tiny_engine, "drop-turns", 96)
    for _ in range(3):
        assert chat.chat(SHORT).finish_reason != "capacity"
    before = len(chat.messages)
    stats = chat.chat(LONG)  # fits the budget once older turns go, but not in half of it
    assert stats.error is None and stats.finish_reason != "capacity", stats.error
    assert stats.evicted_tokens > 0 and chat.messages[0]["role"] == "system"
    assert chat.messages[-2]["content"] == LONG and len(chat.messages) < before + 2


def test_a_turn_whose_message_and_system_prompt_do_not_fit_says_what(tiny_engine):
    for policy in ("sink-window", "drop-turns", "error"):
        chat = session(tiny_engine, policy, 48)
        stats = chat.chat(LONG)
        assert stats.finish_reason == "capacity" and "shorten the message" in stats.error
        assert "system prompt" in stats.error
        assert ("choose --overflow" in stats.error_words(CLI_WORDS)) == (policy == "error")  # no hint for a policy already on
        assert chat.chat(SHORT).finish_reason != "capacity"  # the session stays usable


def test_the_reply_reservation_is_named_when_it_is_what_does_not_fit(tiny_engine):
    cache = tiny_engine.new_cache(sized_config(tiny_engine.model.kv_layout, "fp16", 32, tokens_per_block=16))
    chat = DialogueSession(tiny_engine, cache, SamplingParams(max_new_tokens=28, stop_token_ids=[]), SYSTEM)
    stats = chat.chat(SHORT)
    assert stats.finish_reason == "capacity" and "lower --max-new-tokens" in stats.error_words(CLI_WORDS)
