"""n replies and beam search in the Session API (the reference engine): one prefill, the conversation going on
with the first reply (the best beam) exactly as a plain turn would leave it, the others as alternatives."""
import pytest
from core_helpers import beam_search

from cabinllm.runtime.dialogue.session import DialogueSession
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig

SYSTEM = "You are the assistant of a car."
TURNS = ["suggest three songs for the drive", "and one more"]


def session(engine, **params) -> DialogueSession:
    cache = engine.new_cache(KvCacheConfig("fp32", 8 << 20, 4))
    return DialogueSession(engine, cache, SamplingParams(10, stop_token_ids=engine.stop_token_ids(), **params),
                           SYSTEM)


def test_greedy_n_gives_identical_replies_and_the_conversation_goes_on_as_with_one(tiny_engine):
    plain, forked = session(tiny_engine), session(tiny_engine)
    for text in TURNS:
        one = plain.chat(text)
        four = forked.chat(text, n=4)
        assert four.reply == one.reply and four.alternatives == [one.reply] * 3
        assert forked.fed == plain.fed and forked.pending == plain.pending
    assert forked.cache.stats().blocks_in_use == plain.cache.stats().blocks_in_use  # the forks are freed


def test_sampled_n_replies_differ_by_seed(tiny_engine):
    turn = session(tiny_engine, temperature=1.0, seed=3).chat(TURNS[0], n=3)
    alone = session(tiny_engine, temperature=1.0, seed=4).chat(TURNS[0])
    assert turn.alternatives[0] == alone.reply  # choice 1 samples with seed + 1
    assert len({turn.reply, *turn.alternatives}) > 1


def test_a_beam_turn_gives_the_best_beam_and_keeps_its_kv(tiny_engine):
    beams = session(tiny_engine)
    params = BeamParams(3, 10, 1.0, False, tuple(tiny_engine.stop_token_ids()))
    turn = beams.chat(TURNS[0], beam=params)
    tok = tiny_engine.tokenizer
    prompt = tok.encode(tok.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]))
    cache = tiny_engine.new_cache(KvCacheConfig("fp32", 8 << 20, 4))
    found = beam_search(tiny_engine, cache, prompt, params)
    assert turn.token_ids == found[0] and turn.alternatives == [tok.decode_reply(t) for t in found[1:]]
    assert beams.fed == prompt + turn.token_ids[:-1] and beams.pending == turn.token_ids[-1:]
    assert beams.chat(TURNS[1]).finish_reason in ("stop", "length")  # the conversation goes on
    beams.cache.blocks.check_invariants()


def test_what_cannot_be_forked_is_refused(tiny_engine):
    with pytest.raises(ConfigError, match="n must be >= 1"):
        session(tiny_engine).chat(TURNS[0], n=2, beam=BeamParams(2))
    small = DialogueSession(tiny_engine, tiny_engine.new_cache(KvCacheConfig("fp32", 12 * 4 * 1536, 4)),
                            SamplingParams(10, stop_token_ids=tiny_engine.stop_token_ids()))
    turn = small.chat(TURNS[0], n=4)
    assert turn.finish_reason == "capacity" and "ask for fewer replies" in turn.error
