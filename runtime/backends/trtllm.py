"""The TensorRT-LLM backend of a dialogue: the ``Session`` protocol (cabinllm.runtime.dialogue.interface) on a
built TensorRT engine.

It runs the engine folder's ``trt_engine/`` through ``tensorrt_llm.runtime.ModelRunnerCpp``
(imported only here, only when used). The KV cache config becomes ModelRunnerCpp's KV
arguments: the budget ``max_tokens_in_paged_kv_cache``; block reuse across turns is asked for
only where the KV mode allows it: an INT8-KV engine has no paged context FMHA, so TensorRT-LLM
cannot reuse blocks and each turn prefills the whole history. Overflow is planned as on the
reference engine (cabinllm.runtime.dialogue.overflow), on the prompt, before it is sent. The runner stops on
``end_id`` and ``stop_words_list`` (the stop ids) and at ``max_new_tokens`` itself; the reply is still pushed
through the loops' one set of stop rules (cabinllm.runtime.generation.stops), which classify, cut and stream it
as every backend does, and a stop string, which the runner does not see, ends the request early.

Sink-window on this backend, on both TensorRT-LLM lines, is the reference engine's: the prompt keeps the
system prompt, ``sink_token_length`` sink tokens and the most recent tokens, prefilled at compacted
positions. TensorRT-LLM's own StreamingLLM (``max_attention_window_size`` + ``sink_token_length``) is not
used: on 0.12 its position shift needs an engine built with ``--streamingllm enable``, which turns paged
context FMHA off (``tensorrt_llm/builder.py``, ``build``: "Paged Context FMHA is disabled because
StreamingLLM is not supported when enabling paged KV context FMHA") and with it block reuse of fp16-KV
engines; 1.x no longer supports StreamingLLM (``sink_token_length`` is deprecated and ignored, and its
attention kernels fall back or refuse). A window kept by the engine would not keep a prompt under
``max_input_len`` either. So no engine flag is needed and nothing is refused for this policy.

Two things ModelRunnerCpp does that the session must respect (tensorrt_llm/runtime/model_runner_cpp.py):

- ``generate`` raises (``_check_inputs``) when a prompt exceeds the engine's ``max_input_len`` or
  prompt + ``max_new_tokens`` exceed ``max_seq_len``; both come from the engine's
  ``config.json`` (``build_config``, parsed by GptJsonConfig). A turn may therefore hold
  ``min(KV budget, max_input_len + max_new_tokens, max_seq_len)`` tokens, its reply included, and
  every overflow policy plans against that (sink-window by truncating the stream: the engine's own
  attention window would not keep a prompt under ``max_input_len``).
- A streaming ``generate`` reads every response of the executor's queue and looks each one up in
  its own request ids (``_fill_output``: ``request_ids.index(response.request_id)``). A reply left
  unfinished (interrupted) would leave responses that break the next turn, so the session cancels
  the request through the executor and drains the generator to the request's final response,
  without emitting text.

Not yet run on hardware: tested against a fake module that copies those behaviours.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cabinllm.runtime.dialogue.interface import TurnStats
from cabinllm.runtime.dialogue.overflow import OverflowPolicy, Room, TurnPlan, capacity_message, plan_turn
from cabinllm.runtime.errors import CapacityError, CheckpointError, SessionFileError
from cabinllm.runtime.formats.engine_folder import TRT_ENGINE_DIR
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.generation.stops import ReplyStream
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.tools import Tool

# Constrained decoding on TensorRT-LLM, from its source: 0.12 (v0.12.0-jetson, 20a7cec9) has none:
# runtime/model_runner_cpp.py L406-408 refuses a logits_processor ("Logits processor is not supported in C++
# session") and executor.h names no guided decoding. It came in 0.16.0 (docs/source/release-notes.md L88) through
# the LLM API: GuidedDecodingParams (tensorrt_llm/sampling_params.py L13-29 at 1.0.0rc4, 000a01de) with
# guided_decoding_backend xgrammar|llguidance; ModelRunnerCpp, which this backend runs, takes no grammar in 1.x
# either (its generate, L527-790 at 03832911, has only logits_post_processor names).
TRTLLM_NO_GRAMMAR = ("tools need constrained decoding, which TensorRT-LLM's ModelRunnerCpp (this backend) does not "
                     "do (0.12 has no guided decoding; 1.x has it only in its LLM API); chat with --backend reference "
                     "or onnxruntime")


@dataclass
class TrtllmKvSettings:
    """The KV cache arguments handed to ``ModelRunnerCpp.from_dir``."""

    max_tokens_in_paged_kv_cache: int
    kv_cache_enable_block_reuse: bool

    def as_kwargs(self) -> dict:
        """Keyword arguments for ``from_dir``."""
        return {"max_tokens_in_paged_kv_cache": self.max_tokens_in_paged_kv_cache,
                "kv_cache_enable_block_reuse": self.kv_cache_enable_block_reuse}


def kv_settings(config: KvCacheConfig, layout: KVLayout) -> TrtllmKvSettings:
    """Map our KV cache config onto TensorRT-LLM's KV cache knobs. No attention window or sink tokens: every
    overflow policy, sink-window included, is applied to the prompt before it is sent (see the module notes)."""
    reuse = config.enable_block_reuse and config.mode.trtllm_paged_context_fmha
    return TrtllmKvSettings(config.max_tokens(layout), reuse)


@dataclass
class EngineLimits:
    """The sequence limits a built engine enforces (``build_config`` of ``trt_engine/config.json``)."""

    max_input_len: int
    max_seq_len: int

    @classmethod
    def of(cls, runner, engine_dir: str | Path) -> "EngineLimits":
        """The limits ModelRunnerCpp's ``_check_inputs`` compares against: its ``max_input_len`` and
        ``max_seq_len`` (from_dir takes them from the engine's model config, which GptJsonConfig parses from
        ``build_config`` of ``config.json``); that ``build_config`` itself when the runner lacks them."""
        limits = getattr(runner, "max_input_len", None), getattr(runner, "max_seq_len", None)
        if all(isinstance(limit, int) for limit in limits):
            return cls(*limits)
        try:
            build = json.loads((Path(engine_dir) / "config.json").read_text())["build_config"]
            return cls(int(build["max_input_len"]), int(build["max_seq_len"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{Path(engine_dir) / 'config.json'}: no build_config with max_input_len and "
                                  f"max_seq_len ({err!r}); rebuild the TensorRT engine with trtllm-build") from err

    def capacity(self, budget_tokens: int, max_new_tokens: int) -> int:
        """Tokens one turn may hold, its reply included: the KV budget, a prompt of at most max_input_len
        with its reply, and max_seq_len, whichever is least (prompt limit = this - max_new_tokens)."""
        return min(budget_tokens, self.max_input_len + max_new_tokens, self.max_seq_len)


def _abandon(responses, runner) -> None:
    """Finish a streaming ``generate`` whose reply is no longer wanted: cancel its request and read its
    remaining responses (discarded), so that the next ``generate`` meets none of them.

    ModelRunnerCpp does not hand out its request ids; they are the ``request_ids`` argument of its
    ``_stream`` generator, kept in the suspended generator's frame. The executor is ``runner.executor``
    (1.x) or ``runner.session`` (0.12). When neither is found the drain alone still empties the queue,
    only after the engine has generated the rest of the reply.
    """
    frame = getattr(responses, "gi_frame", None)
    request_ids = frame.f_locals.get("request_ids") if frame is not None else None
    executor = getattr(runner, "executor", None) or getattr(runner, "session", None)
    if request_ids and executor is not None and hasattr(executor, "cancel_request"):
        for request_id in request_ids:
            executor.cancel_request(request_id)
    for _ in responses:  # up to the final (cancelled) response of each request
        pass


class TrtllmSession:
    """A multi-turn dialogue on a TensorRT-LLM engine; each turn sends the rendered history."""

    def __init__(self, engine_folder: str | Path, tokenizer: ChatTokenizer, layout: KVLayout, config: KvCacheConfig,
                 params: SamplingParams, system_prompt: str | None = None,
                 overflow: OverflowPolicy | None = None) -> None:
        from tensorrt_llm.runtime import ModelRunnerCpp

        self.tokenizer, self.params, self.config = tokenizer, params, config
        self.overflow = overflow or OverflowPolicy("error")
        self.system_prompt = system_prompt
        self.bytes_per_token = config.bytes_per_token(layout)
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.settings = kv_settings(config, layout)
        engine_dir = Path(engine_folder) / TRT_ENGINE_DIR
        self.runner = ModelRunnerCpp.from_dir(engine_dir=str(engine_dir), **self.settings.as_kwargs())
        self.limits = EngineLimits.of(self.runner, engine_dir)
        budget = self.settings.max_tokens_in_paged_kv_cache
        self.capacity = self.limits.capacity(budget, params.max_new_tokens)
        self.previous_ids: list[int] = []
        self.turns = 0
        self.tools: list[Tool] = []  # constrained decoding is not available here: TRTLLM_NO_GRAMMAR

    def chat(self, message: str | dict, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None, tool_choice: str | None = None) -> TurnStats:
        """Answer one message (text: the user's), streaming the reply text to on_text; no tools here, so
        ``tool_choice`` changes nothing."""
        import torch

        self.turns += 1
        try:
            plan = self._plan(self.messages + [message if isinstance(message, dict) else
                                               {"role": "user", "content": message}])
        except CapacityError as err:
            message = capacity_message(err, self.overflow, self.params.max_new_tokens, self.capacity)
            if self.capacity < self.settings.max_tokens_in_paged_kv_cache:  # the engine's limits bind
                message += (f" (the engine takes prompts of at most {self.capacity - self.params.max_new_tokens} tokens: "
                         f"max_input_len {self.limits.max_input_len}, max_seq_len {self.limits.max_seq_len} less "
                         f"{self.params.max_new_tokens} for the reply)")
            return self._stats("", [], 0, 0, 0.0, 0.0, "capacity", 0, message)
        ids = plan.feed
        stop_ids = self.params.stop_token_ids
        reply = ReplyStream(self.params, self.tokenizer.decode_reply, on_text)
        start, ttft = time.perf_counter(), 0.0
        responses = self.runner.generate(
            batch_input_ids=[torch.tensor(ids, dtype=torch.int32)], max_new_tokens=self.params.max_new_tokens,
            end_id=stop_ids[0], pad_id=stop_ids[0],
            stop_words_list=[[[i] for i in stop_ids[1:]]] if stop_ids[1:] else None,
            temperature=self.params.temperature or 1.0, top_k=1 if self.params.temperature == 0 else self.params.top_k,
            top_p=self.params.top_p, random_seed=self.params.seed, streaming=True, return_dict=True,
            output_sequence_lengths=True)
        ended, drained = "length", False  # ended: why the reply ends where no stop rule ends it
        try:
            for out in responses:
                ttft = ttft or time.perf_counter() - start
                length = int(out["sequence_lengths"][0][0])
                new = [int(t) for t in out["output_ids"][0][0][len(ids) + len(reply.ids):length]]
                if reply.finish_reason and new:  # the runner goes on past a stop rule it does not see (a stop string)
                    break
                for token in new:
                    reply.push(token)
                    if reply.finish_reason:
                        break
                if not reply.finish_reason and should_stop and should_stop():
                    ended = "interrupted"
                    break
            else:
                drained = True
        finally:
            if not drained:  # past a stop string, interrupted, or on_text raised: no responses left for the next turn
                _abandon(responses, self.runner)
        reply.close(ended)
        decode_s = time.perf_counter() - start - ttft
        generated = reply.ids
        reused = self._reused_tokens(ids) if self.settings.kv_cache_enable_block_reuse else 0
        self.previous_ids = ids + generated
        self.messages = plan.messages + [{"role": "assistant", "content": reply.text}]
        tok_s = (len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0
        return self._stats(reply.text, generated, len(ids) - reused, reused, ttft, tok_s, reply.finish_reason,
                           plan.evicted)

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays."""
        self.messages = self.messages[:1] if self.system_prompt else []
        self.previous_ids, self.turns = [], 0

    def save(self, path: str | Path) -> int:
        """Not available: TensorRT-LLM keeps its KV blocks to itself."""
        raise SessionFileError("saving is available on the reference backend only (--backend reference)")

    def describe_kv(self) -> str:
        """The KV settings handed to TensorRT-LLM."""
        return f"TensorRT-LLM KV settings: {self.settings}"

    def _plan(self, messages: list[dict]) -> TurnPlan:
        """The whole rendered history, or what the overflow policy keeps of it."""
        capacity = self.capacity
        # sink-window truncates the stream here too: max_input_len and max_seq_len bound the prompt whatever
        # attention window the engine keeps
        room = Room(capacity, lambda n: n <= capacity, appends_turns=False)
        return plan_turn(self.tokenizer, messages, room, self.overflow, self.config.sink_token_length,
                         self.params.max_new_tokens)

    def _reused_tokens(self, ids: list[int]) -> int:
        """Tokens TensorRT-LLM can reuse with block reuse on: the common prefix with the previous turn's tokens
        in whole blocks of the engine's ``tokens_per_block``, less the last token."""
        common = 0
        for a, b in zip(self.previous_ids, ids):
            if a != b:
                break
            common += 1
        block = self.config.tokens_per_block
        return min(common // block * block, len(ids) - 1)

    def _stats(self, reply: str, ids: list[int], prefill: int, reused: int, ttft: float, tok_s: float,
               finish: str, evicted: int, error: str | None = None) -> TurnStats:
        held = min(len(self.previous_ids), self.settings.max_tokens_in_paged_kv_cache)
        budget = self.settings.max_tokens_in_paged_kv_cache * self.bytes_per_token
        return TurnStats(self.turns, reply, ids, prefill, reused, ttft, tok_s, held * self.bytes_per_token, budget,
                         self.bytes_per_token, self.config.kv_mode, finish, evicted, self.overflow.name, error)
