"""The TensorRT-LLM dialogue backend against a fake ``tensorrt_llm`` that records every call."""
import copy
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from cabinllm.runtime.backends.select import SessionRequest
from cabinllm.runtime.backends.select import open_session as select_open_session
from cabinllm.runtime.backends.trtllm import TrtllmSession
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.errors import ConfigError
from cabinllm.runtime.formats.engine_folder import TRT_ENGINE_DIR
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.model.tools import Tool

SYSTEM = "You are the in-car assistant."
REPLY = "set cabin temperature"  # the fake engine's reply, in words both the tiny and the default tokenizer spell back
ERRANDS = ("Navigate home, but first stop at the pharmacy on Main Street and then at the dry cleaner next to the "
           "station; avoid toll roads and tell me the arrival time. Also set the seat heating to level two, keep "
           "the cabin at 21 degrees and read me the latest traffic news for the A9 motorway.")


MAX_INPUT_LEN, MAX_SEQ_LEN = 4096, 4352  # the fake engine's build_config, as trtllm-build writes it


class FakeExecutor:
    """Stands in for tensorrt_llm.bindings.executor.Executor: one queue of responses for every request.

    ``await_responses`` returns the next response of every unfinished request, whichever ``generate``
    asked for it; ``cancel_request`` ends a request, whose next response is then its final one.
    """

    def __init__(self, reply: list[int]) -> None:
        self.reply, self.next_id = reply, 1
        self.pending: dict[int, list[int]] = {}  # request id -> tokens still to come
        self.cancelled: list[int] = []

    def enqueue_requests(self, requests: list[dict]) -> list[int]:
        ids = []
        for request in requests:
            tokens = self.reply[:request["max_tokens"]]
            if request["end_id"] in tokens:  # generation ends at end_id, which the output keeps
                tokens = tokens[:tokens.index(request["end_id"]) + 1]
            self.pending[self.next_id] = list(tokens)
            ids.append(self.next_id)
            self.next_id += 1
        return ids

    def cancel_request(self, request_id: int) -> None:
        self.cancelled.append(request_id)
        if request_id in self.pending:
            self.pending[request_id] = []

    def await_responses(self) -> list:
        responses = []
        for request_id in list(self.pending):
            tokens = self.pending[request_id]
            new = tokens[:1]
            del tokens[:1]
            final = not tokens
            if final:
                del self.pending[request_id]
            result = types.SimpleNamespace(output_token_ids=[new], is_final=final, sequence_index=0)
            responses.append(types.SimpleNamespace(request_id=request_id, result=result, has_error=lambda: False))
        return responses


class FakeRunner:
    """Stands in for ModelRunnerCpp (tensorrt_llm/runtime/model_runner_cpp.py, 1.x): records from_dir/generate
    arguments and copies what the session depends on:

    - from_dir parses ``<engine_dir>/config.json`` (GptJsonConfig.parse_file, whose parseBuilderConfig reads
      ``build_config``'s max_input_len / max_seq_len) and keeps ``max_input_len = model_config.max_input_len``,
      ``max_seq_len = model_config.max_seq_len`` (max_output_len not given);
    - generate checks the lengths first, as ``_check_inputs`` does ("Maximum input length (...) exceeds the
      engine or specified limit", "Maximum input length (...) + maximum new tokens (...) exceeds ..."),
      raising at the call, before any streaming;
    - ``request_ids = self.executor.enqueue_requests(requests)`` then ``return self._stream(...)``: a generator
      that calls ``self.executor.await_responses()`` until each of its own requests had its final response
      (``while finished_request_ids != set(request_ids)``), yielding ``_fill_output`` of each batch, which looks
      every response up with ``batch_idx = request_ids.index(response.request_id)``: a leftover response of an
      abandoned request raises ValueError there;
    - the executor (``self.executor``; ``self.session`` in 0.12) has ``cancel_request(request_id)``.
    """

    created: list[dict] = []
    calls: list[dict] = []
    reply: list[int] = []

    def __init__(self, max_input_len: int, max_seq_len: int) -> None:
        self.max_input_len, self.max_seq_len = max_input_len, max_seq_len
        self.executor = FakeExecutor(self.reply)

    @classmethod
    def from_dir(cls, engine_dir, **kwargs):
        cls.created.append({"engine_dir": engine_dir, **kwargs})
        config = Path(engine_dir) / "config.json"
        if not config.exists():  # a bare folder (tests/test_cli_chat.py) stands for an engine built with the defaults
            return cls(MAX_INPUT_LEN, MAX_SEQ_LEN)
        build = json.loads(config.read_text())["build_config"]
        return cls(build["max_input_len"], build["max_seq_len"])

    def generate(self, batch_input_ids, *, max_new_tokens=1, end_id=None, streaming=False, **kwargs):
        self.calls.append({"input_ids": batch_input_ids[0].tolist(), "max_new_tokens": max_new_tokens,
                           "end_id": end_id, "streaming": streaming, **kwargs})
        batch = [a.tolist() for a in batch_input_ids]
        max_length = max(len(x) for x in batch)
        if max_length > self.max_input_len:
            raise RuntimeError(f"Maximum input length ({max_length}) exceeds the engine or specified limit "
                               f"({self.max_input_len})")
        if max_length + max_new_tokens > self.max_seq_len:
            raise RuntimeError(f"Maximum input length ({max_length}) + maximum new tokens ({max_new_tokens}) "
                               f"exceeds the engine or specified limit ({self.max_seq_len})")
        assert streaming, "the session streams"
        request_ids = self.executor.enqueue_requests([{"max_tokens": max_new_tokens, "end_id": end_id}
                                                      for _ in batch])
        return self._stream(request_ids=request_ids, batch_input_ids_list=batch)

    def _stream(self, *, request_ids, batch_input_ids_list):
        output_ids = [[list(ids)] for ids in batch_input_ids_list]
        finished = set()
        while finished != set(request_ids):
            responses = self.executor.await_responses()
            for response in responses:
                if response.result.is_final:
                    finished.add(response.request_id)
            yield self._fill_output(responses, output_ids, request_ids)

    @staticmethod
    def _fill_output(responses, output_ids, request_ids):
        for response in responses:
            batch_idx = request_ids.index(response.request_id)  # ValueError for another request's response
            output_ids[batch_idx][response.result.sequence_index] += response.result.output_token_ids[0]
        lengths = [[len(ids) for ids in beams] for beams in output_ids]
        return {"output_ids": torch.tensor(copy.deepcopy(output_ids)), "sequence_lengths": torch.tensor(lengths)}


def write_engine_config(tmp_path, max_input_len=MAX_INPUT_LEN, max_seq_len=MAX_SEQ_LEN):
    """The part of trt_engine/config.json that GptJsonConfig reads the sequence limits from."""
    engine_dir = tmp_path / TRT_ENGINE_DIR
    engine_dir.mkdir(exist_ok=True)
    (engine_dir / "config.json").write_text(json.dumps(
        {"version": "0.12.0", "pretrained_config": {},
         "build_config": {"max_input_len": max_input_len, "max_seq_len": max_seq_len, "max_batch_size": 1}}))


@pytest.fixture
def fake_trtllm(monkeypatch, engine, tmp_path):
    module, runtime = types.ModuleType("tensorrt_llm"), types.ModuleType("tensorrt_llm.runtime")
    runtime.ModelRunnerCpp = FakeRunner
    module.runtime = runtime
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime", runtime)
    FakeRunner.created, FakeRunner.calls = [], []
    FakeRunner.reply = engine.tokenizer.encode(REPLY) + [engine.stop_token_ids()[0]]
    write_engine_config(tmp_path)
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


def test_int8_engine_gets_budget_and_no_block_reuse_nor_engine_window(engine, fake_trtllm, tmp_path):
    session = open_session(engine, tmp_path, "int8", "sink-window")
    kwargs = fake_trtllm.created[0]
    max_tokens = (8 << 20) // int8_bytes_per_token(engine)  # 728 on the default model (11,520 B/token)
    # sink-window is applied to the prompt: TensorRT-LLM's StreamingLLM window is never asked for (1.x dropped
    # it; on 0.12 it needs --streamingllm enable, which turns paged context FMHA off)
    assert kwargs == {"engine_dir": str(tmp_path / TRT_ENGINE_DIR), "max_tokens_in_paged_kv_cache": max_tokens,
                      "kv_cache_enable_block_reuse": False}
    first, second = session.chat("It is warm in here."), session.chat("Thanks!")
    assert first.reply == REPLY and first.finish_reason == "stop"
    assert second.reused_tokens == 0 and second.prefill_tokens == len(fake_trtllm.calls[1]["input_ids"])
    history = fake_trtllm.calls[0]["input_ids"] + fake_trtllm.reply
    assert fake_trtllm.calls[1]["input_ids"][: len(history)] == history  # the whole history is sent again
    call = fake_trtllm.calls[0]
    assert call["end_id"] == engine.stop_token_ids()[0] and call["top_k"] == 1 and call["streaming"] is True


@pytest.mark.parametrize("policy", ["sink-window", "drop-turns", "error"])
def test_every_policy_keeps_block_reuse_of_an_fp16_engine(engine, fake_trtllm, tmp_path, policy):
    open_session(engine, tmp_path, "fp16", policy)
    assert fake_trtllm.created[0] == {"engine_dir": str(tmp_path / TRT_ENGINE_DIR), "kv_cache_enable_block_reuse": True,
                                      "max_tokens_in_paged_kv_cache": (8 << 20) // (2 * int8_bytes_per_token(engine))}


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


def test_fake_runner_breaks_on_an_abandoned_request_as_model_runner_cpp_does(engine, fake_trtllm, tmp_path):
    """The fake copies ModelRunnerCpp: another request's leftover responses fail ``request_ids.index``."""
    runner = fake_trtllm.from_dir(str(tmp_path / TRT_ENGINE_DIR))
    prompt = [torch.tensor(engine.tokenizer.encode("Hello"), dtype=torch.int32)]
    first = runner.generate(prompt, max_new_tokens=32, end_id=fake_trtllm.reply[-1], streaming=True)
    next(first)  # one token read, the rest left in the executor's queue
    with pytest.raises(ValueError):
        list(runner.generate(prompt, max_new_tokens=32, end_id=fake_trtllm.reply[-1], streaming=True))


@pytest.mark.parametrize("policy", ["sink-window", "drop-turns", "error"])
def test_interrupted_reply_is_cancelled_and_the_next_turn_works(engine, fake_trtllm, tmp_path, policy):
    session = open_session(engine, tmp_path, "int8", policy)
    shown = []
    first = session.chat("It is warm in here.", on_text=shown.append, should_stop=lambda: bool(shown))
    second = session.chat("Thanks!")  # raised ValueError in _fill_output (request_ids.index) before the fix
    assert second.reply == REPLY and second.finish_reason == "stop"
    assert first.finish_reason == "interrupted"
    assert first.reply == "".join(shown) and REPLY.startswith(first.reply) and first.reply != REPLY
    executor = session.runner.executor
    assert executor.cancelled == [1] and not executor.pending  # cancelled, and its final response read
    history = fake_trtllm.calls[1]["input_ids"]
    assert first.reply in engine.tokenizer.decode(history) and REPLY not in engine.tokenizer.decode(history)


def limited_session(engine, tmp_path, policy, which):
    """A session on an engine whose max_input_len (or max_seq_len - max_new_tokens) holds the first turn's
    prompt and about 40 tokens more, far less than the KV budget."""
    tok = engine.tokenizer
    first = len(tok.encode_prompt(tok.render([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": ERRANDS}])))
    limit = first + 40
    if which == "max_input_len":
        write_engine_config(tmp_path, max_input_len=limit, max_seq_len=4096)
    else:
        write_engine_config(tmp_path, max_input_len=4096, max_seq_len=limit + 32)  # 32: max_new_tokens
    session = open_session(engine, tmp_path, "int8", policy)
    assert session.settings.max_tokens_in_paged_kv_cache > limit + 32  # the engine's limit binds, not the budget
    return session, limit


@pytest.mark.parametrize("which", ["max_input_len", "max_seq_len"])
@pytest.mark.parametrize("policy", ["sink-window", "drop-turns", "error"])
def test_every_policy_keeps_prompts_within_the_engine_limits(engine, fake_trtllm, tmp_path, policy, which):
    session, limit = limited_session(engine, tmp_path, policy, which)
    turns = [session.chat(text) for text in  # the fake raises as ModelRunnerCpp does past either limit
             (ERRANDS, "Thanks!", "What is the weather like in Munich tomorrow?", "And on Sunday?",
              "Please open the sunroof a little.", "Close it again.")]
    assert all(len(call["input_ids"]) <= limit for call in fake_trtllm.calls)
    assert session.capacity == limit + 32  # min(budget, max_input_len + reply, max_seq_len), reply included
    if policy == "error":
        assert turns[0].reply == REPLY and any(t.finish_reason == "capacity" for t in turns)
        refused = next(t for t in turns if t.finish_reason == "capacity")
        assert f"holds {limit + 32}" in refused.error and f"at most {limit} tokens" in refused.error
    else:
        assert all(t.reply == REPLY and t.finish_reason == "stop" for t in turns)
        assert any(t.evicted_tokens > 0 for t in turns)
        if policy == "sink-window":  # truncated: the system prompt and the newest tokens, with the message
            tok, last = engine.tokenizer, fake_trtllm.calls[-1]["input_ids"]
            stream = tok.encode_prompt(tok.render(session.messages[:-1]))  # the whole history and the message
            assert len(last) < len(stream) and last[:10] == stream[:10] and last[-20:] == stream[-20:]


class RunnerWithoutLimits(FakeRunner):
    """A runner that does not expose max_input_len / max_seq_len: the session reads the engine's config.json."""

    @classmethod
    def from_dir(cls, engine_dir, **kwargs):
        runner = super().from_dir(engine_dir, **kwargs)
        runner.__dict__.pop("max_input_len"), runner.__dict__.pop("max_seq_len")
        return runner


def test_limits_come_from_the_engine_build_config_when_the_runner_lacks_them(engine, fake_trtllm, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(sys.modules["tensorrt_llm.runtime"], "ModelRunnerCpp", RunnerWithoutLimits)
    write_engine_config(tmp_path, max_input_len=100, max_seq_len=120)
    session = open_session(engine, tmp_path, "int8", "error")
    assert (session.limits.max_input_len, session.limits.max_seq_len) == (100, 120)
    assert session.capacity == min(session.settings.max_tokens_in_paged_kv_cache, 100 + 32, 120)


def test_tools_on_the_tensorrt_llm_backend_are_refused_naming_the_backends_that_take_them(tmp_path):
    request = SessionRequest(tmp_path, 8 << 20, backend="tensorrt-llm",
                             tools=(Tool("set_sunroof", "", {"type": "object"}),))
    with pytest.raises(ConfigError, match="ModelRunnerCpp .* does not do .* --backend reference or onnxruntime"):
        select_open_session(request)
