"""The TensorRT-LLM dialogue backend against a fake ``tensorrt_llm`` that records every call."""
import sys
import types

import pytest
import torch

from runtime.engine_folder import TRT_ENGINE_DIR
from runtime.kv_cache import KvCacheConfig
from runtime.overflow import OverflowPolicy
from runtime.sampling import SamplingParams
from runtime.trtllm_session import TrtllmSession

SYSTEM = "You are the in-car assistant."
REPLY = "set cabin temperature"  # the fake engine's reply, in words both the tiny and the default tokenizer spell back
ERRANDS = ("Navigate home, but first stop at the pharmacy on Main Street and then at the dry cleaner next to the "
           "station; avoid toll roads and tell me the arrival time. Also set the seat heating to level two, keep "
           "the cabin at 21 degrees and read me the latest traffic news for the A9 motorway.")


class FakeRunner:
    """Stands in for ModelRunnerCpp: records from_dir/generate arguments, streams a fixed reply."""

    created: list[dict] = []
    calls: list[dict] = []
    reply: list[int] = []

    @classmethod
    def from_dir(cls, engine_dir, **kwargs):
        cls.created.append({"engine_dir": engine_dir, **kwargs})
        return cls()

    def generate(self, batch_input_ids, **kwargs):
        self.calls.append({"input_ids": batch_input_ids[0].tolist(), **kwargs})
        prompt = batch_input_ids[0].tolist()
        for step in range(1, len(self.reply) + 1):
            ids = prompt + self.reply[:step]
            yield {"output_ids": torch.tensor([[ids]]), "sequence_lengths": torch.tensor([[len(ids)]])}


@pytest.fixture
def fake_trtllm(monkeypatch, engine):
    module, runtime = types.ModuleType("tensorrt_llm"), types.ModuleType("tensorrt_llm.runtime")
    runtime.ModelRunnerCpp = FakeRunner
    module.runtime = runtime
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime", runtime)
    FakeRunner.created, FakeRunner.calls = [], []
    FakeRunner.reply = engine.tokenizer.encode(REPLY) + [engine.stop_token_ids()[0]]
    return FakeRunner


def open_session(engine, tmp_path, kv_mode, policy, tokens_per_block=64):
    params = SamplingParams(max_new_tokens=32, stop_token_ids=engine.stop_token_ids())
    return TrtllmSession(tmp_path, engine.tokenizer, engine.model.kv_layout,
                         KvCacheConfig(kv_mode, 8 << 20, tokens_per_block), params, SYSTEM, OverflowPolicy(policy))


def int8_bytes_per_token(engine):
    """One byte for each K and each V element of a token, in every layer."""
    layout = engine.model.kv_layout
    return 2 * layout.num_layers * layout.num_kv_heads * layout.head_size


def errands_message(engine, reply):
    """ERRANDS, with " Thanks." added until the first turn (its prompt and the reply) ends in the second half of a
    64-token block: 32-token blocks then reuse one block more of it than 64-token blocks."""
    tok, message = engine.tokenizer, ERRANDS
    while True:
        turn = tok.encode_prompt(tok.render([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": message}])) + reply
        if len(turn) % 64 >= 32:
            return message
        message += " Thanks."


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_int8_engine_gets_budget_window_and_no_block_reuse(engine, fake_trtllm, tmp_path):
    session = open_session(engine, tmp_path, "int8", "sink-window")
    kwargs = fake_trtllm.created[0]
    system_tokens = len(engine.tokenizer.encode(
        engine.tokenizer.render([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)))
    max_tokens = (8 << 20) // int8_bytes_per_token(engine)  # 728 on the default model (11,520 B/token)
    assert kwargs == {"engine_dir": str(tmp_path / TRT_ENGINE_DIR), "max_tokens_in_paged_kv_cache": max_tokens,
                      "kv_cache_enable_block_reuse": False, "max_attention_window_size": [max_tokens],
                      "sink_token_length": system_tokens + 4}
    first, second = session.chat("It is warm in here."), session.chat("Thanks!")
    assert first.reply == REPLY and first.finish_reason == "stop"
    assert second.reused_tokens == 0 and second.prefill_tokens == len(fake_trtllm.calls[1]["input_ids"])
    history = fake_trtllm.calls[0]["input_ids"] + fake_trtllm.reply
    assert fake_trtllm.calls[1]["input_ids"][: len(history)] == history  # the whole history is sent again
    call = fake_trtllm.calls[0]
    assert call["end_id"] == engine.stop_token_ids()[0] and call["top_k"] == 1 and call["streaming"] is True


@pytest.mark.parametrize("tokens_per_block", [64, 32])  # Orin's and Thor's block size
def test_fp16_engine_asks_for_block_reuse_and_reports_it(engine, fake_trtllm, tmp_path, tokens_per_block):
    session = open_session(engine, tmp_path, "fp16", "drop-turns", tokens_per_block)
    kwargs = fake_trtllm.created[0]
    assert kwargs["kv_cache_enable_block_reuse"] is True and "max_attention_window_size" not in kwargs
    session.chat(errands_message(engine, fake_trtllm.reply))
    second = session.chat("Avoid the motorway, please, and tell me when we pass a bakery.")
    assert second.reused_tokens > 0 and second.reused_tokens % tokens_per_block == 0
    assert second.reused_tokens + second.prefill_tokens == len(fake_trtllm.calls[1]["input_ids"])
    shared = common_prefix(fake_trtllm.calls[0]["input_ids"] + fake_trtllm.reply, fake_trtllm.calls[1]["input_ids"])
    assert second.reused_tokens == shared // tokens_per_block * tokens_per_block  # every whole block of the prefix
    if tokens_per_block == 32:
        assert second.reused_tokens % 64 == 32  # one 32-token block more than 64-token blocks would give
