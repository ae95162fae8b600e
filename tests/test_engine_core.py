"""The engine core alone: a request that continues a sequence, one stopped by its caller, a failed model step, and
a request that cannot fit."""
import pytest

from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.errors import CapacityError
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.kv.blocks import Sequence

HISTORY, NEW = [3, 10, 17, 4, 11, 18, 5, 12, 19], [6, 13, 1, 7]


def cache(engine, budget=1 << 20):
    return engine.new_cache(KvCacheConfig("fp32", budget, 4))


def test_a_continued_sequence_holds_the_reply_and_answers_as_a_fresh_one(tiny_engine):
    kv, seq = cache(tiny_engine), Sequence()
    first = tiny_engine.new_core(kv).generate(Request(HISTORY, SamplingParams(6), seq=seq))
    assert seq.token_ids == HISTORY + first.token_ids[:-1]  # the last token is the next turn's
    feed = first.token_ids[-1:] + NEW
    second = tiny_engine.new_core(kv).generate(Request(feed, SamplingParams(6), seq=seq))
    whole = HISTORY + first.token_ids + NEW
    fresh = tiny_engine.new_core(cache(tiny_engine)).generate(Request(whole, SamplingParams(6)))
    assert second.token_ids == fresh.token_ids and second.cached_tokens == 0
    kv.free(seq)
    assert kv.stats().blocks_in_use == 0


def test_should_stop_interrupts_after_a_token_and_keeps_the_sequence(tiny_engine):
    kv, seq = cache(tiny_engine), Sequence()
    request = tiny_engine.new_core(kv).generate(Request(HISTORY, SamplingParams(20), seq=seq),
                                                should_stop=lambda: True)
    assert request.finish_reason == "interrupted" and len(request.token_ids) == 1
    assert seq.token_ids == HISTORY


def test_a_failed_step_discards_what_it_did_not_write_and_raises(tiny_engine, monkeypatch):
    kv = cache(tiny_engine)
    core = tiny_engine.new_core(kv)
    monkeypatch.setattr(tiny_engine.model, "step", lambda *_, **__: (_ for _ in ()).throw(RuntimeError("boom")))
    request = Request(HISTORY * 2, SamplingParams(4))
    with pytest.raises(RuntimeError, match="boom"):
        core.generate(request)
    monkeypatch.undo()
    assert request.finish_reason == "error" and "boom" in request.error
    assert kv.stats().blocks_in_use == 0 and kv.blocks.blocks_to_admit(HISTORY * 2, 0)[1] == 0  # no prefix hit
    kv.blocks.check_invariants()


def test_a_request_that_cannot_fit_raises_before_anything_runs(tiny_engine):
    kv = cache(tiny_engine, budget=2 * cache(tiny_engine).bytes_per_block)
    with pytest.raises(CapacityError, match="need .* KV blocks and 2 are free"):
        tiny_engine.new_core(kv).generate(Request(HISTORY, SamplingParams(8)))
    assert kv.stats().blocks_in_use == 0
