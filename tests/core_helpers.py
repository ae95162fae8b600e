"""One request run alone through the engine core, and a bare prefill: what tests compare the core's batches with."""
import torch

from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.grammar import GrammarState
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import PagedKVCache
from cabinllm.runtime.model.interface import ModelRunner


def generate(engine: Engine, cache: PagedKVCache, prompt: list[int], params: SamplingParams,
             grammar: GrammarState | None = None) -> Request:
    """One sampled reply to ``prompt`` on a new sequence, the core holding nothing else."""
    return engine.new_core(cache).generate(Request(prompt, params, grammar=grammar))


def beam_search(engine: Engine, cache: PagedKVCache, prompt: list[int], params: BeamParams) -> list[list[int]]:
    """The finished beams of one beam search from ``prompt``, best first."""
    sampling = SamplingParams(params.max_new_tokens, stop_token_ids=list(params.stop_token_ids))
    return engine.new_core(cache).generate(Request(prompt, sampling, beam=params)).beams


def prefill(model: ModelRunner, cache: PagedKVCache, seq: Sequence, ids: list[int]) -> tuple[torch.Tensor, int, int]:
    """Allocate ``ids`` as a new sequence and run what the cache does not hold: the last token's logits, the tokens
    reused and the tokens computed."""
    start = cache.allocate(seq, ids)
    return model.forward(ids[start:], start, cache, seq), start, len(ids) - start
