"""The TensorRT-LLM dialogue backend against a fake ``tensorrt_llm`` that records every call."""
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from cabinllm.runtime.backends.select import SessionRequest
from cabinllm.runtime.backends.select import open_session as select_open_session
from cabinllm.runtime.backends.trtllm import TrtllmSession, beam_kv_blocks, beam_kv_blocks_up_to, kv_settings
from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.errors import AudioError, ConfigError, ImageError
from cabinllm.runtime.formats.engine_folder import TRT_ENGINE_DIR
from cabinllm.runtime.generation.beam import NEVER, BeamParams
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.blocks import cdiv
from cabinllm.runtime.kv.cache import DEFAULT_KV_BYTES, KvCacheConfig
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.tools import Tool
from cabinllm.runtime.speech.audio import Clip
from cli_words import raises_in_cli_words
from speech_helpers import needs_espeak, spoken

SYSTEM = "You are the in-car assistant."
REPLY = "set cabin temperature"  # the fake engine's reply, in words both the tiny and the default tokenizer spell back
OTHERS = ("play some jazz", "navigate to the nearest charging station")  # the other beams and sequences
ERRANDS = ("Navigate home, but first stop at the pharmacy on Main Street and then at the dry cleaner next to the "
           "station; avoid toll roads and tell me the arrival time. Also set the seat heating to level two, keep "
           "the cabin at 21 degrees and read me the latest traffic news for the A9 motorway.")


MAX_INPUT_LEN, MAX_SEQ_LEN = 4096, 4352  # the fake engine's build_config, as trtllm-build writes it


def response(request_id: int, tokens: list[list[int]], final: bool, index: int = 0):
    """An executor Response: its request's id and a Result of tokens (one list per beam), final or not."""
    result = types.SimpleNamespace(output_token_ids=tokens, is_final=final, sequence_index=index)
    return types.SimpleNamespace(request_id=request_id, result=result, has_error=lambda: False)


class FakeExecutor:
    """Stands in for tensorrt_llm.bindings.executor.Executor (1.x): one queue of responses for every request.

    - ``enqueue_requests``: a request samples ``num_return_sequences`` sequences (``sequences``, in turn), or with
      ``beam_width`` > 1 searches beams (``beams``, best first); each ends at ``end_id``, which the output keeps, or at
      ``max_tokens``.
    - ``await_responses`` returns the next response of every unfinished request, whichever ``generate`` asked for it.
      A sampled sequence's response carries its next token at its ``sequence_index``; ``is_final`` comes with the
      response that leaves every sequence of the request final (llmRequest.cpp ``createResponse`` at 119c6e60:
      ``isFinal = all_of(isSequenceFinal)``). A beam search sends every beam in one response (sequence_index 0):
      streamed, each beam whole so far, since the LlmRequest constructor forces ``returnAllGeneratedTokens`` on a
      streamed beam search (llmRequest.h at 00e9b8a7; ``whole_streamed_beams``), and in another order than the final
      one until the last step ("beam search + streaming can change previous outputs"); unstreamed, one final response
      whose beams hold the prompt and the reply (``calculateNbTokensOut`` without streaming).
    - ``cancel_request`` ends a request; its next response is its final one, with no tokens.
    """

    whole_streamed_beams = True

    def __init__(self, sequences: list[list[int]], beams: list[list[int]]) -> None:
        self.sequences, self.beams, self.next_id = sequences, beams, 1
        self.pending: dict[int, dict] = {}  # request id -> what it still sends
        self.cancelled: list[int] = []

    def enqueue_requests(self, requests: list[dict]) -> list[int]:
        ids = []
        for request in requests:
            beam = request["beam_width"] > 1
            count = request["beam_width"] if beam else request["num_return_sequences"] or 1
            source = self.beams if beam else self.sequences
            outputs = [self._cut(source[i % len(source)], request) for i in range(count)]
            self.pending[self.next_id] = {"prompt": request["input_token_ids"], "beam": beam, "outputs": outputs,
                                          "streaming": request["streaming"], "sent": [0] * count,
                                          "final": [False] * count, "step": 0}
            ids.append(self.next_id)
            self.next_id += 1
        return ids

    @staticmethod
    def _cut(tokens: list[int], request: dict) -> list[int]:
        tokens = tokens[:request["max_tokens"]]
        if request["end_id"] in tokens:  # generation ends at end_id, which the output keeps
            tokens = tokens[:tokens.index(request["end_id"]) + 1]
        return list(tokens)

    def cancel_request(self, request_id: int) -> None:
        self.cancelled.append(request_id)
        if request_id in self.pending:
            self.pending[request_id]["cancelled"] = True

    def await_responses(self) -> list:
        responses = []
        for request_id in list(self.pending):
            responses += self._next(request_id, self.pending[request_id])
            if all(self.pending[request_id]["final"]):
                del self.pending[request_id]
        return responses

    def _next(self, request_id: int, req: dict) -> list:
        outputs, count = req["outputs"], len(req["outputs"])
        if req.get("cancelled"):
            req["final"] = [True] * count
            return [response(request_id, [[] for _ in outputs] if req["beam"] else [[]], True)]
        if not req["streaming"]:
            req["final"] = [True] * count
            if req["beam"]:
                return [response(request_id, [req["prompt"] + o for o in outputs], True)]
            return [response(request_id, [req["prompt"] + o], i == count - 1, i) for i, o in enumerate(outputs)]
        if req["beam"]:
            req["step"] += 1
            step, last = req["step"], req["step"] >= max(len(o) for o in outputs)
            beams = [o[:step] for o in (outputs if last else outputs[::-1])]
            req["final"] = [last] * count
            return [response(request_id, beams if self.whole_streamed_beams else [b[step - 1:step] for b in beams],
                             last)]
        sent = []
        for i, tokens in enumerate(outputs):
            if req["final"][i]:
                continue
            new = tokens[req["sent"][i]:req["sent"][i] + 1]
            req["sent"][i] += 1
            req["final"][i] = req["sent"][i] >= len(tokens)
            sent.append(response(request_id, [new], all(req["final"]), i))
        return sent


class FakeExecutor012(FakeExecutor):
    """0.12's executor: a streamed beam search sends each beam's newest token only (``createResponse``: "For
    streaming we do not allow beam search"; beam search streams from 0.13.0 on, its release notes)."""

    whole_streamed_beams = False


class FakeRunner:
    """Stands in for ModelRunnerCpp (tensorrt_llm/runtime/model_runner_cpp.py at 03832911, 1.x): records
    from_dir/generate arguments and copies what the session depends on:

    - from_dir parses ``<engine_dir>/config.json`` (GptJsonConfig.parse_file, whose parseBuilderConfig reads
      ``build_config``'s max_input_len / max_seq_len / max_beam_width) and keeps ``max_input_len``, ``max_seq_len``
      (max_output_len not given) and ``max_beam_width``: the engine's when none is given, else the one given,
      asserted to be at most the engine's (L370-373);
    - generate checks the lengths and beams first, as ``_check_inputs`` does ("Maximum input length (...) exceeds
      the engine or specified limit", "Maximum input length (...) + maximum new tokens (...) exceeds ...", "Num beams
      (...) exceeds the engine or specified limit (...)", L446-477), raising at the call, before any streaming; of
      its keyword arguments it takes those of ``accepted_parameters`` (L630-650), ``num_beams`` as the beam width;
    - ``request_ids = self.executor.enqueue_requests(requests)`` (L792) then ``return self._stream(...)``: a
      generator that calls ``self.executor.await_responses()`` until each of its own requests had its final response
      (``while finished_request_ids != set(request_ids)``), yielding ``_fill_output`` of each batch, which looks
      every response up with ``batch_idx = request_ids.index(response.request_id)``: a leftover response of an
      abandoned request raises ValueError there; unstreamed, ``_initialize_and_fill_output`` waits for every final
      response and fills once;
    - the outputs have ``num_return_sequences or num_beams`` rows (``_get_num_sequences``, L909-913), each the prompt
      and its tokens: a beam search's response fills every row from ``output_token_ids``, a sampled one the row of its
      ``sequence_index``; with ``return_all_generated_tokens`` a row becomes prompt + the response's tokens, else the
      tokens are appended (L1039-1058); ``sequence_lengths`` are the rows' lengths, and the rows are padded with
      end_id to max_seq_len;
    - the executor (``self.executor``; ``self.session`` in 0.12) has ``cancel_request(request_id)``;
    - a ``prompt_table`` goes through ``_prepare_ptuning_executor`` (its copy below) into each
      request's prompt tuning config, and the request's tokens are embedded as ``PromptTuningEmbedding`` does
      (tensorrt_llm/layers/embedding.py): an id above ``vocab_size - 1`` (``pretrained_config.vocab_size`` of
      ``config.json``; these tests' text-only configs name none: no id is above it) takes row ``id - vocab_size`` of its
      table (``embedded``, one entry per token, None for text).
    """

    created: list[dict] = []
    calls: list[dict] = []
    reply: list[int] = []
    sequences: list[list[int]] = []  # what sampling gives: sequence i is sequences[i % len]
    beams: list[list[int]] = []  # what a beam search finds, best first
    accepted = {"num_beams", "top_k", "top_p", "temperature", "length_penalty", "early_stopping", "random_seed",
                "num_return_sequences"}  # the accepted_parameters the session may pass
    executor_class = FakeExecutor
    dtype = torch.float16  # the engine's (ModelRunnerMixin.dtype)
    embedded: list[list] = []  # per request, what PromptTuningEmbedding gives each token (None: a text token)

    def __init__(self, max_input_len: int, max_seq_len: int, max_beam_width: int = 1,
                 vocab_size: int = sys.maxsize) -> None:
        self.max_input_len, self.max_seq_len, self.max_beam_width = max_input_len, max_seq_len, max_beam_width
        self.vocab_size = vocab_size
        self.queue = self.executor = self.executor_class(self.sequences, self.beams)

    @classmethod
    def from_dir(cls, engine_dir, **kwargs):
        cls.created.append({"engine_dir": engine_dir, **kwargs})
        config = Path(engine_dir) / "config.json"
        # a bare folder (tests/test_cli_chat.py) stands for an engine built with the defaults
        data = json.loads(config.read_text()) if config.exists() else {
            "build_config": {"max_input_len": MAX_INPUT_LEN, "max_seq_len": MAX_SEQ_LEN}}
        build = data["build_config"]
        width, engine_width = kwargs.get("max_beam_width"), build.get("max_beam_width", 1)
        assert width is None or width <= engine_width
        return cls(build["max_input_len"], build["max_seq_len"], width or engine_width,
                   data.get("pretrained_config", {}).get("vocab_size", sys.maxsize))

    def _get_num_sequences(self, sampling) -> int:
        num_sequences = sampling.num_return_sequences or sampling.beam_width
        assert sampling.beam_width == 1 or num_sequences <= sampling.beam_width
        return num_sequences

    def generate(self, batch_input_ids, *, max_new_tokens=1, end_id=None, streaming=False,
                 return_all_generated_tokens=False, prompt_table=None, prompt_tasks=None, input_token_extra_ids=None,
                 **kwargs):
        self.calls.append({"input_ids": batch_input_ids[0].tolist(), "max_new_tokens": max_new_tokens,
                           "end_id": end_id, "streaming": streaming,
                           "return_all_generated_tokens": return_all_generated_tokens, "prompt_table": prompt_table,
                           "prompt_tasks": prompt_tasks, "input_token_extra_ids": input_token_extra_ids, **kwargs})
        configs = self._prepare_ptuning_executor(batch_input_ids, prompt_table, prompt_tasks, input_token_extra_ids)
        self.embedded.extend(self._embed(ids.tolist(), config) for ids, config in zip(batch_input_ids, configs))
        params = {k: v for k, v in kwargs.items() if k in self.accepted}
        sampling = types.SimpleNamespace(beam_width=params.get("num_beams", 1),
                                         num_return_sequences=params.get("num_return_sequences"))
        batch = [a.tolist() for a in batch_input_ids]
        max_length = max(len(x) for x in batch)
        if max_length > self.max_input_len:
            raise RuntimeError(f"Maximum input length ({max_length}) exceeds the engine or specified limit "
                               f"({self.max_input_len})")
        if max_length + max_new_tokens > self.max_seq_len:
            raise RuntimeError(f"Maximum input length ({max_length}) + maximum new tokens ({max_new_tokens}) "
                               f"exceeds the engine or specified limit ({self.max_seq_len})")
        if sampling.beam_width > self.max_beam_width:
            raise RuntimeError(f"Num beams ({sampling.beam_width}) exceeds the engine or specified limit "
                               f"({self.max_beam_width})")
        request_ids = self.queue.enqueue_requests([
            {"input_token_ids": ids, "max_tokens": max_new_tokens, "end_id": end_id, "streaming": streaming,
             "beam_width": sampling.beam_width, "num_return_sequences": sampling.num_return_sequences}
            for ids in batch])
        fill = {"end_id": end_id, "beam_search": sampling.beam_width > 1, "rows": self._rows(sampling)}
        if not streaming:
            return self._initialize_and_fill_output(request_ids=request_ids, batch_input_ids_list=batch, **fill)
        return self._stream(request_ids=request_ids, batch_input_ids_list=batch,
                            return_all_generated_tokens=return_all_generated_tokens, **fill)

    def _rows(self, sampling) -> int:
        return self._get_num_sequences(sampling)

    def _prepare_ptuning_executor(self, batch_input_ids_list, prompt_table, prompt_tasks, input_token_extra_ids):
        """ModelRunnerCpp's (at 03832911): the table cast to the engine's dtype (``_prepare_embedding_table``), one
        task per request, ``prompt_table[task]`` and the request's extra ids in its PromptTuningConfig."""
        if input_token_extra_ids:
            assert len(batch_input_ids_list) == len(input_token_extra_ids)
        configs = len(batch_input_ids_list) * [None]
        if prompt_table is not None:
            data = prompt_table.to(dtype=self.dtype)
            tasks = [int(t) for t in prompt_tasks.split(",")] if prompt_tasks is not None else None
            assert tasks is None or len(tasks) == len(batch_input_ids_list)
            configs = [{"embedding_table": data[tasks[i] if tasks else 0],
                        "input_token_extra_ids": input_token_extra_ids[i] if input_token_extra_ids else None}
                       for i in range(len(batch_input_ids_list))]
        return configs

    def _embed(self, ids: list[int], config: dict | None) -> list:
        """PromptTuningEmbedding: ids above vocab_size - 1 take their table's row id - vocab_size."""
        fake = [t for t in ids if t > self.vocab_size - 1]
        assert not fake or config is not None, "fake ids without a prompt table"
        return [config["embedding_table"][t - self.vocab_size] if t > self.vocab_size - 1 else None for t in ids]

    def _initialize_and_fill_output(self, *, request_ids, batch_input_ids_list, rows, **fill):
        output_ids = [[[] for _ in range(rows)] for _ in request_ids]
        responses, finished = [], set()
        while finished != set(request_ids):
            for r in self.queue.await_responses():
                responses.append(r)
                if r.result.is_final:
                    finished.add(r.request_id)
        return self._fill_output(responses, output_ids, request_ids, [], False, **fill)

    def _stream(self, *, request_ids, batch_input_ids_list, rows, return_all_generated_tokens, **fill):
        output_ids = [[list(ids) for _ in range(rows)] for ids in batch_input_ids_list]
        finished = set()
        while finished != set(request_ids):
            responses = self.queue.await_responses()
            for r in responses:
                if r.result.is_final:
                    finished.add(r.request_id)
            yield self._fill_output(responses, output_ids, request_ids, batch_input_ids_list,
                                    return_all_generated_tokens, **fill)

    def _fill_output(self, responses, output_ids, request_ids, batch_input_ids_list, return_all_generated_tokens, *,
                     end_id, beam_search):
        def fill_output_ids(tokens, batch_idx, seq_idx):
            if return_all_generated_tokens:
                output_ids[batch_idx][seq_idx] = batch_input_ids_list[batch_idx] + tokens
            else:
                output_ids[batch_idx][seq_idx] += tokens

        for r in responses:
            batch_idx = request_ids.index(r.request_id)  # ValueError for another request's response
            if beam_search:
                for beam, tokens in enumerate(r.result.output_token_ids):
                    fill_output_ids(tokens, batch_idx, beam)
            else:
                fill_output_ids(r.result.output_token_ids[0], batch_idx, r.result.sequence_index)
        lengths = [[len(ids) for ids in rows] for rows in output_ids]
        padded = [[ids + [end_id] * (self.max_seq_len - len(ids)) for ids in rows] for rows in output_ids]
        return {"output_ids": torch.tensor(padded), "sequence_lengths": torch.tensor(lengths)}


class FakeRunner012(FakeRunner):
    """ModelRunnerCpp of 0.12 (copies from the 0.11-0.13 line): its executor is ``self.session``, its
    ``accepted_parameters`` have no ``num_return_sequences`` and it has no ``_get_num_sequences``: the outputs have
    the runner's ``max_beam_width`` rows and every response fills them from ``output_token_ids`` by beam."""

    accepted = FakeRunner.accepted - {"num_return_sequences"}
    executor_class = FakeExecutor012
    _get_num_sequences = None

    def generate(self, batch_input_ids, *, prompt_table=None, prompt_tasks=None, **kwargs):
        """An older generate: a prompt table and its tasks, no ``input_token_extra_ids``."""
        assert "input_token_extra_ids" not in kwargs
        return super().generate(batch_input_ids, prompt_table=prompt_table, prompt_tasks=prompt_tasks, **kwargs)

    def __init__(self, max_input_len: int, max_seq_len: int, max_beam_width: int = 1,
                 vocab_size: int = sys.maxsize) -> None:
        super().__init__(max_input_len, max_seq_len, max_beam_width, vocab_size)
        self.session = self.__dict__.pop("executor")

    def _rows(self, sampling) -> int:
        return self.max_beam_width

    def _fill_output(self, responses, output_ids, request_ids, batch_input_ids_list, return_all_generated_tokens, *,
                     end_id, beam_search):
        return super()._fill_output(responses, output_ids, request_ids, batch_input_ids_list,
                                    return_all_generated_tokens, end_id=end_id, beam_search=True)


def write_engine_config(tmp_path, max_input_len=MAX_INPUT_LEN, max_seq_len=MAX_SEQ_LEN, max_beam_width=1):
    """The part of trt_engine/config.json that GptJsonConfig reads the sequence and beam limits from."""
    engine_dir = tmp_path / TRT_ENGINE_DIR
    engine_dir.mkdir(exist_ok=True)
    (engine_dir / "config.json").write_text(json.dumps(
        {"version": "0.12.0", "pretrained_config": {},
         "build_config": {"max_input_len": max_input_len, "max_seq_len": max_seq_len, "max_batch_size": 1,
                          "max_beam_width": max_beam_width}}))


def install_fake(monkeypatch, runner_class: type, tokenizer) -> type:
    """``runner_class`` as ``tensorrt_llm.runtime.ModelRunnerCpp``, its records empty, replying REPLY in
    ``tokenizer``'s tokens."""
    module, runtime = types.ModuleType("tensorrt_llm"), types.ModuleType("tensorrt_llm.runtime")
    runtime.ModelRunnerCpp = runner_class
    module.runtime = runtime
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime", runtime)
    FakeRunner.created, FakeRunner.calls, FakeRunner.embedded = [], [], []
    FakeRunner.reply = tokenizer.encode(REPLY) + [tokenizer.stop_token_ids[0]]
    FakeRunner.sequences, FakeRunner.beams = [FakeRunner.reply], [FakeRunner.reply]
    return runner_class


@pytest.fixture
def fake_trtllm(monkeypatch, engine, tmp_path):
    write_engine_config(tmp_path)
    return install_fake(monkeypatch, FakeRunner, engine.tokenizer)


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
                      "kv_cache_enable_block_reuse": False, "max_beam_width": 1}  # the engine's beams
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
                                      "max_tokens_in_paged_kv_cache": (8 << 20) // (2 * int8_bytes_per_token(engine)),
                                      "max_beam_width": 1}


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
    request = SessionRequest(tmp_path, KvCacheConfig(max_bytes=8 << 20), backend="tensorrt-llm",
                             tools=(Tool("set_sunroof", "", {"type": "object"}),))
    with raises_in_cli_words(ConfigError, match="ModelRunnerCpp .* does not do .* --backend reference or onnxruntime"):
        select_open_session(request)


def replies(engine, *texts: str) -> list[list[int]]:
    """The fake engine's sequences or beams: each text's tokens and the end id."""
    return [engine.tokenizer.encode(text) + [engine.stop_token_ids()[0]] for text in texts]


def beams(engine, width: int, max_new_tokens: int = 32, **kwargs) -> BeamParams:
    return BeamParams(width, max_new_tokens, stop_token_ids=tuple(engine.stop_token_ids()), **kwargs)


def test_from_dir_gets_the_engine_s_beam_width(engine, fake_trtllm, tmp_path):
    write_engine_config(tmp_path, max_beam_width=4)
    session = open_session(engine, tmp_path, "fp16", "error")
    assert fake_trtllm.created[0]["max_beam_width"] == 4 and session.limits.max_beam_width == 4


def test_a_beam_search_replies_with_beam_0_and_gives_the_others_as_alternatives(engine, fake_trtllm, tmp_path):
    write_engine_config(tmp_path, max_beam_width=4)
    fake_trtllm.beams[:] = replies(engine, REPLY, *OTHERS)  # streamed in another order until the last step
    session, shown = open_session(engine, tmp_path, "fp16", "error"), []
    turn = session.chat("It is warm in here.", on_text=shown.append,
                        beam=beams(engine, 3, length_penalty=0.5, early_stopping=NEVER))
    assert turn.reply == REPLY and turn.alternatives == list(OTHERS) and turn.finish_reason == "stop"
    assert turn.token_ids == fake_trtllm.beams[0] and not shown  # a beam search does not stream its text
    call = fake_trtllm.calls[0]
    assert (call["num_beams"], call["length_penalty"], call["early_stopping"]) == (3, 0.5, 2)
    assert call["streaming"] is True and call["return_all_generated_tokens"] is True  # whole beams, replaced
    assert not {"temperature", "top_k", "top_p", "random_seed", "num_return_sequences"} & set(call)  # no sampling
    assert session.messages[-1] == {"role": "assistant", "content": REPLY}
    assert session.chat("Thanks!").reply == REPLY and not session.runner.executor.pending  # nothing left behind


def test_fake_runner_appends_whole_streamed_beams_without_return_all_generated_tokens(engine, fake_trtllm, tmp_path):
    """The fake copies 1.x: the executor sends streamed beams whole, which ``_fill_output`` appends unless told."""
    write_engine_config(tmp_path, max_beam_width=2)
    fake_trtllm.beams[:] = replies(engine, REPLY, OTHERS[0])
    runner, prompt = fake_trtllm.from_dir(str(tmp_path / TRT_ENGINE_DIR)), engine.tokenizer.encode("Hello")

    def best(**kwargs) -> list[int]:
        *_, out = runner.generate([torch.tensor(prompt, dtype=torch.int32)], max_new_tokens=32, num_beams=2,
                                  end_id=fake_trtllm.reply[-1], streaming=True, **kwargs)
        return out["output_ids"][0][0][:int(out["sequence_lengths"][0][0])].tolist()

    assert best(return_all_generated_tokens=True) == prompt + fake_trtllm.beams[0]
    assert best() != prompt + fake_trtllm.beams[0]


def test_an_interrupted_beam_search_is_cancelled_and_the_next_turn_works(engine, fake_trtllm, tmp_path):
    write_engine_config(tmp_path, max_beam_width=2)
    fake_trtllm.beams[:] = replies(engine, REPLY, OTHERS[0])
    session, steps = open_session(engine, tmp_path, "int8", "error"), []
    turn = session.chat("It is warm in here.", should_stop=lambda: steps.append(1) or len(steps) > 1,
                        beam=beams(engine, 2))
    assert turn.finish_reason == "interrupted" and turn.alternatives == [] and len(turn.token_ids) == 2
    assert session.runner.executor.cancelled == [1] and not session.runner.executor.pending
    assert session.chat("Thanks!").reply == REPLY


def test_more_beams_than_the_engine_s_are_refused_naming_the_rebuild(engine, fake_trtllm, tmp_path):
    session = open_session(engine, tmp_path, "int8", "error")  # an engine built with max_beam_width 1
    with raises_in_cli_words(ConfigError, match=r"max_beam_width 1 .*: rebuild it with cabin-build --max-beam-width 4"):
        session.chat("It is warm in here.", beam=beams(engine, 4))
    with pytest.raises(ConfigError, match="length_penalty >= 0"):
        session.chat("It is warm in here.", beam=beams(engine, 1, length_penalty=-1.0))
    assert not fake_trtllm.calls and session.turns == 0
    prompt = [torch.tensor(engine.tokenizer.encode("Hello"), dtype=torch.int32)]
    with pytest.raises(RuntimeError, match=r"Num beams \(4\) exceeds the engine or specified limit \(1\)"):
        session.runner.generate(prompt, max_new_tokens=8, end_id=fake_trtllm.reply[-1], streaming=True, num_beams=4)


def test_n_replies_are_tensorrt_llm_s_return_sequences(engine, fake_trtllm, tmp_path):
    fake_trtllm.sequences[:] = replies(engine, REPLY, *OTHERS)
    session = open_session(engine, tmp_path, "int8", "error")
    turn = session.chat("It is warm in here.", n=3)
    assert turn.reply == REPLY and turn.alternatives == list(OTHERS) and turn.finish_reason == "stop"
    assert fake_trtllm.calls[0]["num_return_sequences"] == 3 and "num_beams" not in fake_trtllm.calls[0]
    assert session.messages[-1]["content"] == REPLY and session.chat("Thanks!").reply == REPLY
    with pytest.raises(ConfigError, match="n must be >= 1, and 1 with a beam search"):
        session.chat("Thanks!", n=2, beam=beams(engine, 1))


def test_on_0_12_beams_are_searched_unstreamed_and_n_is_refused(engine, fake_trtllm, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["tensorrt_llm.runtime"], "ModelRunnerCpp", FakeRunner012)
    write_engine_config(tmp_path, max_beam_width=4)
    fake_trtllm.beams[:] = replies(engine, REPLY, OTHERS[0])
    session = open_session(engine, tmp_path, "int8", "error")
    turn = session.chat("It is warm in here.", beam=beams(engine, 2), should_stop=lambda: True)
    assert turn.reply == REPLY and turn.alternatives == [OTHERS[0]] and turn.finish_reason == "stop"
    assert fake_trtllm.calls[0]["streaming"] is False and not fake_trtllm.calls[0]["return_all_generated_tokens"]
    with raises_in_cli_words(ConfigError, match=r"num_return_sequences.*--backend reference"):
        session.chat("Thanks!", n=2)
    assert session.chat("Thanks!").reply == REPLY  # one reply still streams


def test_beam_kv_blocks_share_the_prompt_s_whole_blocks_only():
    assert beam_kv_blocks(768, 256, 4, 64) == 12 + 4 * 4
    assert beam_kv_blocks(767, 256, 4, 64) == 11 + 4 * 5  # its last, partial block is every beam's own
    assert beam_kv_blocks_up_to(768, 256, 4, 64) == 31
    assert beam_kv_blocks_up_to(768, 256, 1, 64) == cdiv(768 + 256, 64)  # one beam: the sequence's blocks


def test_a_beam_turn_whose_beams_do_not_fit_the_budget_is_refused(engine, fake_trtllm, tmp_path):
    layout, blocks = engine.model.kv_layout, 8
    config = KvCacheConfig("int8", blocks * 64 * int8_bytes_per_token(engine), 64)
    params = SamplingParams(max_new_tokens=32, stop_token_ids=engine.stop_token_ids())
    write_engine_config(tmp_path, max_beam_width=4)
    session = TrtllmSession(tmp_path, engine.tokenizer, layout, config, params, SYSTEM, OverflowPolicy("error"))
    turn = session.chat(ERRANDS, beam=beams(engine, 4, 100))  # 4 beams' 2 blocks each fill the 8 blocks
    assert turn.finish_reason == "capacity" and not fake_trtllm.calls
    assert "a search of 4 beams takes prompts of at most 28 tokens" in turn.error
    assert session.chat(ERRANDS).finish_reason == "stop"  # one reply fits


def test_sliding_window_layers_get_their_window_per_layer():
    """Gemma-3-1B's pattern as TensorRT-LLM issue #13123 passes it: five local layers of 512, one global of the
    engine's max_seq_len (5,500 there), repeated; the pool's tokens are the global layers' (the windows held
    beside)."""
    layout = KVLayout(26, 1, 256, tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26)))
    config = KvCacheConfig("fp16", DEFAULT_KV_BYTES, 32)
    settings = kv_settings(config, layout, 5500).as_kwargs()
    assert settings["max_attention_window_size"][:12] == [512] * 5 + [5500] + [512] * 5 + [5500]
    assert settings["max_tokens_in_paged_kv_cache"] == config.max_tokens(layout)
    assert config.bytes_per_token(layout) == 4 * 2 * 256 * 2  # four global layers' K and V in fp16
    assert "max_attention_window_size" not in kv_settings(config, KVLayout(26, 1, 256), 5500).as_kwargs()


def test_a_text_engine_refuses_pictures_and_the_session_goes_on(fake_trtllm, engine, tmp_path):
    session = open_session(engine, tmp_path, "fp16", "error")
    with pytest.raises(ImageError, match="takes text only; pictures need an engine built from a vision-language"):
        session.chat("what does the camera show?", images=[("cam.png", b"\x89PNG")])
    assert session.chat("hello").reply == REPLY and not fake_trtllm.calls[0]["prompt_table"]


@needs_espeak
def test_a_spoken_message_is_sent_as_its_transcript_and_a_silent_one_changes_nothing(fake_trtllm, engine, tmp_path):
    session = open_session(engine, tmp_path, "fp16", "error")
    with pytest.raises(AudioError, match="quiet.wav: no words heard"):
        session.chat("", audio=[Clip.from_pcm(np.zeros(16_000), "quiet.wav")])
    assert session.turns == 0 and not fake_trtllm.calls
    stats = session.chat("", audio=[spoken("turn the temperature up to twenty two degrees", tmp_path)])
    heard = stats.heard[0]["text"]
    assert "22 degrees" in heard and session.messages[-2] == {"role": "user", "content": heard}
    assert stats.reply == REPLY
    open_session(engine, tmp_path, "fp16", "error").chat(heard)  # typed: the same prompt
    assert fake_trtllm.calls[1]["input_ids"] == fake_trtllm.calls[0]["input_ids"]
