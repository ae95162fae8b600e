"""Beam search on the paged cache against transformers' ``generate(num_beams=...)`` on the same weights (fp32
weights and KV), token for token, for several prompts, length penalties and early-stopping rules; beam width 1
is greedy; the beams share their blocks (forked, freed) and a search that cannot fit is refused first."""
import pytest
import torch
from core_helpers import beam_search, generate

from cabinllm.calibration.hf_model import transformers_model
from cabinllm.runtime.errors import CapacityError
from cabinllm.runtime.formats.checkpoint import load_checkpoint
from cabinllm.runtime.formats.engine_folder import CHECKPOINT_DIR
from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.kv.cache import KvCacheConfig

# (length_penalty, early_stopping) as transformers names them
RULES = [(1.0, False), (0.0, True), (2.0, "never"), (-1.0, False)]


def hf_beams(hf, prompt: list[int], params: BeamParams) -> list[int]:
    """transformers' best beam, its padding cut after the first stop token."""
    out = hf.generate(torch.tensor([prompt]), num_beams=params.beam_width, do_sample=False,
                      max_new_tokens=params.max_new_tokens, length_penalty=params.length_penalty,
                      early_stopping=params.early_stopping, eos_token_id=list(params.stop_token_ids),
                      pad_token_id=params.stop_token_ids[0], num_return_sequences=1)[0, len(prompt):].tolist()
    ends = [i for i, t in enumerate(out) if t in params.stop_token_ids]
    return out[:ends[0] + 1] if ends else out


def ours(engine, prompt: list[int], params: BeamParams) -> list[int]:
    cache = engine.new_cache(KvCacheConfig("fp32", 8 << 20, 4))
    beams = beam_search(engine, cache, prompt, params)
    assert cache.stats().blocks_in_use == 0
    cache.blocks.check_invariants()
    return beams[0]


@pytest.fixture(scope="module")
def tiny_hf(tiny_engine_dir):
    return transformers_model(*load_checkpoint(tiny_engine_dir / CHECKPOINT_DIR))


@pytest.mark.parametrize("length_penalty, early_stopping", RULES)
def test_beams_equal_transformers_on_the_tiny_model(tiny_engine, tiny_hf, length_penalty, early_stopping):
    stops = tuple(tiny_engine.stop_token_ids())
    for prompt in ([1, 5, 9, 2], [3, 3, 7, 12, 4, 8, 1], [17]):
        for width in (2, 4):
            params = BeamParams(width, 12, length_penalty, early_stopping, stops)
            assert ours(tiny_engine, prompt, params) == hf_beams(tiny_hf, prompt, params), (prompt, width)


def test_beam_width_1_is_greedy(tiny_engine):
    stops = tuple(tiny_engine.stop_token_ids())
    prompt = [1, 5, 9, 2, 6]
    cache = tiny_engine.new_cache(KvCacheConfig("fp32", 8 << 20, 4))
    greedy = generate(tiny_engine, cache, prompt, SamplingParams(10, stop_token_ids=list(stops)))
    assert ours(tiny_engine, prompt, BeamParams(1, 10, stop_token_ids=stops)) == greedy.token_ids


def test_beams_share_blocks_and_a_search_that_cannot_fit_is_refused(tiny_engine):
    prompt = list(range(1, 21)) * 3  # 60 tokens: 15 blocks of 4
    cache = tiny_engine.new_cache(KvCacheConfig("fp32", 8 << 20, 4))
    params = BeamParams(4, 8, stop_token_ids=())
    peak = 0
    original = tiny_engine.model.step

    def watched(spans, kv, *rest):
        nonlocal peak
        peak = max(peak, kv.stats().blocks_in_use)
        return original(spans, kv, *rest)

    tiny_engine.model.step = watched
    try:
        beam_search(tiny_engine, cache, prompt, params)
    finally:
        del tiny_engine.model.step
    assert 15 < peak <= params.blocks_needed(len(prompt), 4) < 4 * 17  # shared, not 4 copies
    small = tiny_engine.new_cache(KvCacheConfig("fp32", 20 * cache.bytes_per_block, 4))
    with pytest.raises(CapacityError, match="lower beam_width or max_new_tokens"):
        beam_search(tiny_engine, small, prompt, params)
    assert small.stats().blocks_in_use == 0


@pytest.mark.slow
def test_beams_equal_transformers_on_the_default_model(default_engine, default_hf_model):
    hf = default_hf_model
    tok = default_engine.tokenizer
    stops = tuple(default_engine.stop_token_ids())
    for question in ("Where is the nearest charging station?", "Set the cabin to 21 degrees, please."):
        prompt = tok.encode(tok.render([{"role": "user", "content": question}]))
        for length_penalty, early_stopping in ((1.0, False), (0.5, True)):
            params = BeamParams(4, 24, length_penalty, early_stopping, stops)
            cache = default_engine.new_cache(KvCacheConfig("fp32", 32 << 20, 16))
            got = beam_search(default_engine, cache, prompt, params)[0]
            assert got == hf_beams(hf, prompt, params), question


def test_the_scheduler_runs_a_beam_search_beside_a_sampled_request(tiny_engine):
    stops = tuple(tiny_engine.stop_token_ids())
    prompt = [1, 5, 9, 2]
    params = BeamParams(4, 12, 1.0, False, stops)
    cache = tiny_engine.new_cache(KvCacheConfig("fp32", 8 << 20, 4))
    scheduler = tiny_engine.new_core(cache, SchedulerConfig(max_sessions=5))
    beam = Request(prompt, SamplingParams(12, stop_token_ids=list(stops)), lambda *_: None, beam=params)
    other = Request([3, 3, 7], SamplingParams(12, stop_token_ids=list(stops)), lambda *_: None)
    scheduler.add_request(beam)
    scheduler.add_request(other)
    while beam.finish_reason is None or other.finish_reason is None:
        scheduler.step()
    assert beam.token_ids == ours(tiny_engine, prompt, params)
    assert cache.stats().blocks_in_use == 0
    cache.blocks.check_invariants()
