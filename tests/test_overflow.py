"""Overflow policies on the tiny and the default model: long dialogues under a small KV budget."""
import dataclasses

import pytest

from cabinllm.cli.args import CLI_WORDS
from cabinllm.runtime.dialogue.overflow import OverflowPolicy, drop_oldest_turns, sink_window
from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import sized_config

SYSTEM = "You are the in-car assistant. Answer in one short sentence."
QUESTIONS = ["navigate to the nearest charging station",  # in the tiny model's words too: distinct tokens on both
             "Turn the music down.", "Find a parking garage near the station.", "How does lane assist work?",
             "Call Anna.", "Is the trunk closed?", "What's the range left?", "Set the temperature to 20 degrees."]
_DIALOGUE_TOKENS: dict[str, int] = {}  # engine fingerprint -> tokens the dialogue takes without a limit


def test_sink_window_keeps_the_head_and_the_tail():
    assert sink_window(list(range(10)), 2, 5)[0] == [0, 1, 7, 8, 9]
    assert sink_window(list(range(4)), 2, 5)[0] == [0, 1, 2, 3]


def test_drop_oldest_turns_keeps_system_and_whole_turns():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    kept = drop_oldest_turns(messages, lambda m: len(m) <= 2)
    assert kept == [messages[0], messages[3]]
    assert drop_oldest_turns(messages, lambda m: False) is None


def budgeted_session(engine, policy, tokens=None, sink_token_length=4):
    """A session whose KV budget holds ``tokens`` tokens (default ``small_budget``)."""
    config = sized_config(engine.model.kv_layout, "int8", tokens or small_budget(engine), tokens_per_block=16)
    cache = engine.new_cache(dataclasses.replace(config, sink_token_length=sink_token_length))
    params = SamplingParams(max_new_tokens=16, stop_token_ids=engine.stop_token_ids())
    return DialogueSession(engine, cache, params, SYSTEM, OverflowPolicy(policy))


def small_budget(engine) -> int:
    """Three quarters of the tokens the whole dialogue of QUESTIONS takes without a limit, in whole 16-token blocks
    (192 on the default model): greedy decoding repeats that dialogue until it no longer fits, so it must overflow."""
    if engine.fingerprint not in _DIALOGUE_TOKENS:
        session = budgeted_session(engine, "error", tokens=4096)
        turns = [session.chat(q) for q in QUESTIONS]
        assert all(t.finish_reason in ("stop", "length") for t in turns)
        _DIALOGUE_TOKENS[engine.fingerprint] = len(session.fed)
    return _DIALOGUE_TOKENS[engine.fingerprint] * 3 // 4 // 16 * 16


@pytest.mark.parametrize("policy", ["sink-window", "drop-turns"])
def test_every_turn_completes_under_a_small_budget(engine, policy):
    session, budget = budgeted_session(engine, policy), small_budget(engine)
    turns = [session.chat(q) for q in QUESTIONS]
    assert all(t.finish_reason in ("stop", "length") for t in turns), [t.error for t in turns]
    assert sum(t.evicted_tokens for t in turns) > 0
    assert all(t.kv_bytes_used <= t.kv_bytes_budget for t in turns)
    assert len(session.fed) + 1 <= budget
    session.cache.blocks.check_invariants()
    assert session.cache.stats().blocks_in_use == len(session.seq.block_table) == -(-len(session.fed) // 16)
    if policy == "drop-turns":
        assert session.messages[0]["role"] == "system" and len(session.messages) < 2 * len(QUESTIONS) + 1


def test_sink_window_keeps_the_system_prompt_and_the_configured_sink_tokens(engine):
    tok, system = engine.tokenizer, {"role": "system", "content": SYSTEM}
    first = tok.encode_prompt(tok.render([system, {"role": "user", "content": QUESTIONS[0]}]))
    system_tokens = len(tok.encode_prompt(tok.render([system], add_generation_prompt=False)))
    sink = (len(first) - system_tokens) // 2  # sink tokens that end in the middle of the first question
    session = budgeted_session(engine, "sink-window", sink_token_length=sink)
    head = system_tokens + sink
    turns = [session.chat(q) for q in QUESTIONS]
    assert sum(t.evicted_tokens for t in turns) > 0
    assert session.fed[:head] == first[:head] and session.fed[:head + 1] != first[:head + 1]


def test_error_policy_refuses_and_stays_usable(engine):
    session = budgeted_session(engine, "error")
    turns = [session.chat(q) for q in QUESTIONS]
    refused = [t for t in turns if t.finish_reason == "capacity"]
    assert refused and "kv-budget-mb" in refused[0].error_words(CLI_WORDS) and refused[0].evicted_tokens == 0
    session.reset()
    assert session.chat(QUESTIONS[0]).finish_reason in ("stop", "length")


def test_a_message_longer_than_the_budget_is_a_clear_error(engine):
    session = budgeted_session(engine, "sink-window")
    stats = session.chat("Please read this out loud: " + "the quick brown fox jumps over the lazy dog " * 60)
    assert stats.finish_reason == "capacity" and "shorten the message" in stats.error
    assert session.chat(QUESTIONS[0]).finish_reason in ("stop", "length")
