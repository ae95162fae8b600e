"""The TensorRT-LLM backend of a dialogue: the ``Session`` protocol (runtime.dialogue) on a built TensorRT engine.

It runs the engine folder's ``trt_engine/`` through ``tensorrt_llm.runtime.ModelRunnerCpp``
(imported only here, only when used). The KV cache config becomes ModelRunnerCpp's KV
arguments: the budget ``max_tokens_in_paged_kv_cache``, the sink-window policy
``max_attention_window_size`` + ``sink_token_length``; block reuse across turns is asked for
only where the KV mode allows it: an INT8-KV engine has no paged context FMHA, so TensorRT-LLM
cannot reuse blocks and each turn prefills the whole history. Overflow is planned as on the
reference engine (runtime.overflow). Not yet run on hardware: tested against a fake module
that checks the calls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from runtime.dialogue import SessionFileError, TurnStats
from runtime.engine_folder import TRT_ENGINE_DIR
from runtime.kv_cache import KvCacheConfig
from runtime.kv_storage import KVLayout
from runtime.overflow import (CapacityError, OverflowPolicy, Room, TurnPlan, capacity_hint, plan_overflow,
                              system_tokens)
from runtime.sampling import SamplingParams
from runtime.streaming import TextStream
from runtime.tokenizer import ChatTokenizer


@dataclass
class TrtllmKvSettings:
    """The KV cache arguments handed to ``ModelRunnerCpp.from_dir``."""

    max_tokens_in_paged_kv_cache: int
    kv_cache_enable_block_reuse: bool
    max_attention_window_size: list[int] | None
    sink_token_length: int | None

    def as_kwargs(self) -> dict:
        """Keyword arguments for ``from_dir`` (window and sink only when set)."""
        kwargs = {"max_tokens_in_paged_kv_cache": self.max_tokens_in_paged_kv_cache,
                  "kv_cache_enable_block_reuse": self.kv_cache_enable_block_reuse}
        if self.max_attention_window_size is not None:
            kwargs["max_attention_window_size"] = self.max_attention_window_size
            kwargs["sink_token_length"] = self.sink_token_length
        return kwargs


def kv_settings(config: KvCacheConfig, layout: KVLayout, overflow: OverflowPolicy, sink_tokens: int) -> TrtllmKvSettings:
    """Map our KV cache config and overflow policy onto TensorRT-LLM's KV cache knobs."""
    max_tokens = config.max_tokens(layout)
    window = [max_tokens] if overflow.name == "sink-window" else None
    return TrtllmKvSettings(max_tokens, config.enable_block_reuse and config.mode.trtllm_paged_context_fmha, window,
                            sink_tokens if window else None)


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
        sink = system_tokens(tokenizer, self.messages) + config.sink_token_length
        self.settings = kv_settings(config, layout, self.overflow, sink)
        self.runner = ModelRunnerCpp.from_dir(engine_dir=str(Path(engine_folder) / TRT_ENGINE_DIR),
                                              **self.settings.as_kwargs())
        self.previous_ids: list[int] = []
        self.turns = 0

    def chat(self, user_text: str, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> TurnStats:
        """Answer one user message, streaming the reply text to on_text."""
        import torch

        self.turns += 1
        try:
            plan = self._plan(self.messages + [{"role": "user", "content": user_text}])
        except CapacityError as err:
            hint = capacity_hint(self.overflow, self.params.max_new_tokens, self.settings.max_tokens_in_paged_kv_cache)
            return self._stats("", [], 0, 0, 0.0, 0.0, "capacity", 0, f"{err}; {hint}")
        ids = plan.feed
        stop_ids = self.params.stop_token_ids
        stream = TextStream(self.tokenizer.decode_reply)
        generated: list[int] = []
        start, ttft = time.perf_counter(), 0.0
        for out in self.runner.generate(
                batch_input_ids=[torch.tensor(ids, dtype=torch.int32)], max_new_tokens=self.params.max_new_tokens,
                end_id=stop_ids[0], pad_id=stop_ids[0],
                stop_words_list=[[[i] for i in stop_ids[1:]]] if stop_ids[1:] else None,
                temperature=self.params.temperature or 1.0, top_k=1 if self.params.temperature == 0 else self.params.top_k,
                top_p=self.params.top_p, random_seed=self.params.seed, streaming=True, return_dict=True,
                output_sequence_lengths=True):
            ttft = ttft or time.perf_counter() - start
            length = int(out["sequence_lengths"][0][0])
            generated = [int(t) for t in out["output_ids"][0][0][len(ids):length]]
            for token in generated[len(stream.ids):]:
                piece = "" if token in stop_ids else stream.push(token)
                if on_text and piece:
                    on_text(piece)
            if should_stop and should_stop():
                break
        decode_s = time.perf_counter() - start - ttft
        reply = stream.text
        finish = "stop" if generated and generated[-1] in stop_ids else "length"
        reused = self._reused_tokens(ids) if self.settings.kv_cache_enable_block_reuse else 0
        self.previous_ids = ids + generated
        self.messages = plan.messages + [{"role": "assistant", "content": reply}]
        tok_s = (len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0
        return self._stats(reply, generated, len(ids) - reused, reused, ttft, tok_s, finish, plan.evicted)

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
        prompt = self.tokenizer.render(messages)
        ids = self.tokenizer.encode_prompt(prompt)
        capacity = self.settings.max_tokens_in_paged_kv_cache
        room = Room(capacity, lambda n: n <= capacity, appends_turns=False, windows_attention=True)
        if room.fits(len(ids) + self.params.max_new_tokens):
            return TurnPlan(ids, messages, prompt)
        return plan_overflow(self.overflow, self.config.sink_token_length, messages, prompt, ids, room,
                             self.tokenizer, self.params.max_new_tokens)

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
