"""Our forward pass against Hugging Face transformers' LlamaForCausalLM on the same weights."""
import pytest
from core_helpers import generate
import torch

from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import Sequence
from cabinllm.runtime.kv.cache import KvCacheConfig


@pytest.fixture(scope="module")
def prompt_256(default_engine):
    tok = default_engine.tokenizer
    messages = [{"role": "system", "content": "You are the in-car assistant."}]
    ids: list[int] = []
    turn = 0
    while len(ids) < 256:
        messages.append({"role": "user", "content": f"Question {turn}: how do I pair my phone over Bluetooth, "
                                                    "and can you also lower the fan speed a little?"})
        ids = tok.encode(tok.render(messages))
        turn += 1
    return ids[:256]


def test_logits_match_transformers_on_256_tokens(default_engine, default_hf_model, prompt_256):
    cache = default_engine.new_cache(KvCacheConfig("fp32", 32 << 20, tokens_per_block=16))
    seq = Sequence()
    cache.allocate(seq, prompt_256)
    ours = default_engine.model.forward(prompt_256, 0, cache, seq, all_logits=True)
    with torch.no_grad():
        theirs = default_hf_model(torch.tensor([prompt_256])).logits[0]
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-3, f"max abs logits diff {diff}"


def test_64_greedy_tokens_match_transformers(default_engine, default_hf_model, prompt_256):
    prompt = prompt_256[:100]
    cache = default_engine.new_cache(KvCacheConfig("fp32", 32 << 20))
    params = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=[])
    ours = generate(default_engine, cache, prompt, params)
    with torch.no_grad():
        out = default_hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == out[0, len(prompt):].tolist()
