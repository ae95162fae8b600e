"""The TensorRT-LLM backend of a dialogue: a session over TensorRT-LLM's own executor, not a model runner of our
engine core (TensorRT-LLM schedules, batches and holds the KV itself). It offers the ``Session`` protocol
(cabinllm.runtime.dialogue.interface) on a built TensorRT engine through ``tensorrt_llm.runtime.ModelRunnerCpp``
(imported only here, only when used).

The KV cache config becomes the runner's KV arguments; overflow, stops, several replies (``n``, beams), pictures and
audio clips (a prompt table) follow TensorRT-LLM's source as docs/trtllm-backend.md records it, with its lines and
commits.
Not yet run on hardware: tested against a fake module that copies those behaviours.
"""
from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from cabinllm.runtime.dialogue.interface import TurnStats, error_parts
from cabinllm.runtime.dialogue.overflow import (Compacted, OverflowPolicy, Room, TurnPlan, capacity_error, plan_turn,
                                                shown_images)
from cabinllm.runtime.dialogue.session import with_transcripts
from cabinllm.runtime.errors import (AudioError, CabinError, CapacityError, CheckpointError, ConfigError, Fix, Hint,
                                     ImageError, SessionFileError)
from cabinllm.runtime.formats.engine_folder import TRT_ENGINE_DIR
from cabinllm.runtime.generation.beam import NEVER, BeamParams
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.generation.stops import ReplyStream
from cabinllm.runtime.kv.blocks import MediaSpan, cdiv
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.kv.storage import KVLayout
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.tools import Tool
from cabinllm.runtime.model.interface import MediaRows
from cabinllm.runtime.model.audio import AudioEncoder, PreparedClip
from cabinllm.runtime.model.vision import PreparedImage, Vision
from cabinllm.runtime.speech.asr import AsrConfig, spoken_message
from cabinllm.runtime.speech.audio import AudioLimits, Clip

# Constrained decoding: docs/trtllm-backend.md, "Constrained decoding".
# A ConfigError's message and hints: raise ConfigError(*TRTLLM_NO_GRAMMAR)
TRTLLM_NO_GRAMMAR = ("tools need constrained decoding, which TensorRT-LLM's ModelRunnerCpp (this backend) does not do "
                     "(0.12 has no guided decoding; 1.x has it only in its LLM API)",
                     (Hint(Fix.BACKEND, "reference or onnxruntime"),))
TRTLLM_NO_N = ("n > 1 samples several replies through TensorRT-LLM's num_return_sequences, which this ModelRunnerCpp "
               "(TensorRT-LLM 0.12) does not take", (Hint(Fix.ONE_REPLY), Hint(Fix.BACKEND, "reference")))
# transformers' early_stopping as the executor's SamplingConfig takes it: 1 = True, 0 = False, 2 (any other
# value >= 0) = "never" (docs/trtllm-backend.md)
TRTLLM_EARLY_STOPPING = {True: 1, False: 0, NEVER: 2}


@dataclass
class PromptTable:
    """A prompt's pictures or clips as TensorRT-LLM takes them: the ids with a fake id (``vocab_size`` + row) at each
    token that takes an encoder row, each token's extra id (0 for text, the medium's key for its fake ids) and the
    rows."""

    ids: list[int]
    extra_ids: list[int]
    rows: torch.Tensor | None  # (rows, hidden); None without media


def media_key(digest: bytes) -> int:
    """A picture's or clip's extra id for KV block reuse: from the digest of its decoded pixels or samples, > 0 and
    below 2**63."""
    return int.from_bytes(digest[:8], "big") >> 1 | 1


def prompt_table(ids: list[int], media: list[MediaSpan], rows_of: Callable[[bytes], MediaRows],
                 vocab_size: int) -> PromptTable:
    """The prompt table of ``ids`` whose pictures or clips are ``media`` (``rows_of``: one's encoder rows by
    digest)."""
    ids, extra, tables = list(ids), [0] * len(ids), []
    for span in media:
        picture = rows_of(span.digest)
        key, first = media_key(span.digest), vocab_size + sum(len(t) for t in tables)
        for row, offset in enumerate(picture.offsets.tolist()):
            ids[span.start + offset], extra[span.start + offset] = first + row, key
        tables.append(picture.rows)
    return PromptTable(ids, extra, torch.cat(tables) if tables else None)


def takes_extra_ids(runner_class) -> bool:
    """Whether ModelRunnerCpp's ``generate`` names ``input_token_extra_ids`` (the per-token extra ids of KV reuse)."""
    return "input_token_extra_ids" in inspect.signature(runner_class.generate).parameters


@dataclass
class TrtllmKvSettings:
    """The KV cache arguments handed to ``ModelRunnerCpp.from_dir``."""

    max_tokens_in_paged_kv_cache: int
    kv_cache_enable_block_reuse: bool
    max_attention_window_size: list[int] | None = None  # per layer, for a model with sliding-window layers

    def as_kwargs(self) -> dict:
        """Keyword arguments for ``from_dir``."""
        kwargs = {"max_tokens_in_paged_kv_cache": self.max_tokens_in_paged_kv_cache,
                  "kv_cache_enable_block_reuse": self.kv_cache_enable_block_reuse}
        if self.max_attention_window_size is not None:
            kwargs["max_attention_window_size"] = self.max_attention_window_size
        return kwargs


def kv_settings(config: KvCacheConfig, layout: KVLayout, max_seq_len: int) -> TrtllmKvSettings:
    """Map our KV cache config onto TensorRT-LLM's KV cache knobs. No sink tokens: every overflow policy,
    sink-window included, is applied to the prompt before it is sent. A model with sliding-window layers (Gemma 3)
    gets its windows per layer, the global layers the engine's ``max_seq_len`` (docs/trtllm-backend.md, "Sliding
    windows")."""
    reuse = config.enable_block_reuse and config.mode.trtllm_paged_context_fmha
    windows = [w or max_seq_len for w in layout.windows] if layout.windows else None
    return TrtllmKvSettings(config.max_tokens(layout), reuse, windows)


def beam_kv_blocks(prompt_tokens: int, new_tokens: int, beams: int, tokens_per_block: int) -> int:
    """KV blocks TensorRT-LLM reserves for one request to completion (``getRemainingBlocksToCompletion``): the
    prompt's whole blocks once, shared by the beams, and per beam its last partial block and the reply's blocks."""
    shared = prompt_tokens // tokens_per_block
    return shared + beams * (cdiv(prompt_tokens + new_tokens, tokens_per_block) - shared)


def beam_kv_blocks_up_to(prompt_tokens: int, new_tokens: int, beams: int, tokens_per_block: int) -> int:
    """The most blocks any prompt of at most ``prompt_tokens`` tokens reserves (``beam_kv_blocks`` is not monotone:
    a prompt one token short of a whole block holds that block once per beam, a whole one shares it)."""
    worst = beam_kv_blocks(prompt_tokens, new_tokens, beams, tokens_per_block)
    below = prompt_tokens // tokens_per_block * tokens_per_block - 1  # the last prompt with a partial block less
    if below >= 0:
        worst = max(worst, beam_kv_blocks(below, new_tokens, beams, tokens_per_block))
    return worst


def engine_max_beam_width(engine_dir: str | Path) -> int:
    """The beams the engine was built for: ``build_config.max_beam_width`` of its ``config.json`` (1, trtllm-build's
    default, where the field or the file is missing)."""
    return _build_value(engine_dir, "max_beam_width", 1)


def engine_max_seq_len(engine_dir: str | Path) -> int:
    """``build_config.max_seq_len`` of the engine's ``config.json``; CheckpointError where it is missing."""
    return _build_value(engine_dir, "max_seq_len", None)


def _build_value(engine_dir: str | Path, key: str, default: int | None) -> int:
    """A ``build_config`` value of the engine's ``config.json``, ``default`` where it or the file is missing (None:
    CheckpointError)."""
    path = Path(engine_dir) / "config.json"
    try:
        build = json.loads(path.read_text()).get("build_config") or {}
        if key not in build and default is None:
            raise KeyError(key)
        return int(build.get(key, default))
    except OSError as err:
        if default is None:
            raise CheckpointError(f"{path}: cannot read it ({err.strerror}); rebuild the TensorRT engine with "
                                  "trtllm-build") from err
        return default
    except (KeyError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: unreadable build_config ({err!r}); rebuild the TensorRT engine with "
                              "trtllm-build") from err


@dataclass
class EngineLimits:
    """The sequence and beam limits a built engine enforces (``build_config`` of ``trt_engine/config.json``)."""

    max_input_len: int
    max_seq_len: int
    max_beam_width: int = 1

    @classmethod
    def of(cls, runner, engine_dir: str | Path) -> "EngineLimits":
        """The limits ModelRunnerCpp's ``_check_inputs`` compares against: its ``max_input_len``, ``max_seq_len``
        and ``max_beam_width`` (from_dir takes them from the engine's model config, which GptJsonConfig parses from
        ``build_config`` of ``config.json``); that ``build_config`` itself when the runner lacks them."""
        beams = getattr(runner, "max_beam_width", None)
        beams = beams if isinstance(beams, int) else engine_max_beam_width(engine_dir)
        limits = getattr(runner, "max_input_len", None), getattr(runner, "max_seq_len", None)
        if all(isinstance(limit, int) for limit in limits):
            return cls(*limits, beams)
        try:
            build = json.loads((Path(engine_dir) / "config.json").read_text())["build_config"]
            return cls(int(build["max_input_len"]), int(build["max_seq_len"]), beams)
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
                 overflow: OverflowPolicy | None = None, vision: Vision | None = None,
                 vocab_size: int = 0, audio: AudioEncoder | None = None, asr: AsrConfig | None = None,
                 audio_limits: AudioLimits | None = None) -> None:
        """``vision``: a vision-language engine's pictures (its ``vision/``), ``audio``: an audio-language engine's
        clips (its ``audio/``), whose rows the engine's ``vocab_size`` fake ids point at; ``asr``: the speech front
        end that hears the user's clips (a text engine's message, an audio engine's transcripts), ``audio_limits``
        their caps."""
        from tensorrt_llm.runtime import ModelRunnerCpp

        self.tokenizer, self.params, self.config = tokenizer, params, config
        self.asr, self.audio_limits = asr or AsrConfig(), audio_limits or AudioLimits()
        self.vision, self.audio, self.vocab_size = vision, audio, vocab_size
        self.images: dict[str, PreparedImage] = {}  # the conversation's pictures by digest (hex)
        self.clips: dict[str, PreparedClip] = {}  # its audio clips by digest (hex)
        self.extra_ids = takes_extra_ids(ModelRunnerCpp)
        self.overflow = overflow or OverflowPolicy("error")
        self.system_prompt = system_prompt
        self.bytes_per_token = config.bytes_per_token(layout)
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.engine_dir = Path(engine_folder) / TRT_ENGINE_DIR
        self.settings = kv_settings(config, layout, engine_max_seq_len(self.engine_dir) if layout.windows else 0)
        if (vision is not None or audio is not None) and not self.extra_ids:  # fake ids alone mix media blocks up
            self.settings = replace(self.settings, kv_cache_enable_block_reuse=False)
        self.table_rows = _build_value(self.engine_dir, "max_prompt_embedding_table_size", 0)
        self.runner = ModelRunnerCpp.from_dir(engine_dir=str(self.engine_dir),
                                              max_beam_width=engine_max_beam_width(self.engine_dir),
                                              **self.settings.as_kwargs())
        self.limits = EngineLimits.of(self.runner, self.engine_dir)
        # 1.x: num_return_sequences and streamed beams; 0.12 has neither (docs/trtllm-backend.md)
        self.forks = callable(getattr(self.runner, "_get_num_sequences", None))
        budget = self.settings.max_tokens_in_paged_kv_cache
        self.capacity = self.limits.capacity(budget, params.max_new_tokens)
        self.previous_keys: list[tuple[int, int]] = []  # (id, extra id) of the tokens the engine's blocks may hold
        self.turns = 0
        self.tools: list[Tool] = []  # constrained decoding is not available here: TRTLLM_NO_GRAMMAR

    def chat(self, message: str | dict, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None, tool_choice: str | None = None, n: int = 1,
             beam: BeamParams | None = None, images: list[tuple[str, bytes]] | None = None,
             audio: list[Clip] | None = None) -> TurnStats:
        """Answer one message (text: the user's), streaming the reply text to on_text; no tools here, so
        ``tool_choice`` changes nothing. ``n`` > 1 samples that many replies (num_return_sequences), ``beam`` runs
        TensorRT-LLM's beam search: the conversation goes on with the first reply (the best beam), the others are
        ``alternatives`` (neither streams its text). ``images``: (name, bytes) of pictures the message shows, sent as
        a prompt table (docs/trtllm-backend.md); ``audio``: clips the user spoke, heard by the speech front end on a
        text engine (``_with_audio``, what was heard in ``TurnStats.heard``), sent as pictures are on an
        audio-language engine; ImageError or AudioError before anything changes where they cannot be taken."""
        self._check_forks(n, beam)
        message = message if isinstance(message, dict) else {"role": "user", "content": message}
        heard: list[dict] = []
        if audio and self.audio is None:
            message, heard, audio = *self._with_audio(message, audio), None
        stats = self._answer(message, on_text, should_stop, n, beam, images, audio)
        stats.heard = heard
        return stats

    def _answer(self, message: dict, on_text: Callable[[str], None] | None, should_stop: Callable[[], bool] | None,
                n: int, beam: BeamParams | None, images: list[tuple[str, bytes]] | None,
                audio: list[Clip] | None) -> TurnStats:
        """The turn of ``chat`` once its message is text (with pictures, or an audio-language engine's clips)."""
        held, clips = dict(self.images), dict(self.clips)
        if images:
            message = self._with_images(message, images, held)
        if audio:
            message = self._with_clips(message, audio, clips)
        max_new_tokens = beam.max_new_tokens if beam else self.params.max_new_tokens
        try:
            plan = self._plan(self.messages + [message], beam, held, clips)
        except CapacityError as err:
            self.turns += 1
            return self._stats("", [], 0, 0, 0.0, 0.0, "capacity", 0, self._capacity_error(err, beam))
        table = self._prompt_table(plan, held, clips)
        self.images, self.clips, ids = held, clips, table.ids
        self.turns += 1
        params = replace(self.params, max_new_tokens=max_new_tokens)
        replies = [ReplyStream(params, self.tokenizer.decode_reply, on_text if n == 1 and beam is None else None)
                   for _ in range(n)]
        streaming = beam is None or self.forks  # 0.12 does not stream a beam search
        start, ttft = time.perf_counter(), 0.0
        result = self.runner.generate(batch_input_ids=[torch.tensor(ids, dtype=torch.int32)],
                                      max_new_tokens=max_new_tokens, streaming=streaming,
                                      **self._generate_kwargs(n, beam), **self._table_kwargs(table))
        responses = result if streaming else iter([result])
        ended, drained, beams = "length", not streaming, None  # ended: why replies end where no stop rule ends them
        try:
            for out in responses:
                ttft = ttft or time.perf_counter() - start
                outputs, lengths = out["output_ids"][0], out["sequence_lengths"][0]
                if beam is not None:  # whole beams, reordered as the search goes: only the last response counts
                    beams = [[int(t) for t in outputs[b][len(ids):int(lengths[b])]] for b in range(beam.beam_width)]
                elif self._push(replies, outputs, lengths, len(ids)):  # the runner goes on past a stop string
                    break
                if streaming and should_stop and should_stop() and not all(r.finish_reason for r in replies):
                    ended = "interrupted"
                    break
            else:
                drained = True
        finally:
            if not drained:  # past a stop string, interrupted, or on_text raised: no responses left for the next turn
                _abandon(responses, self.runner)
        if beam is not None:
            replies = self._beam_replies(beams or [[]], params, ended)
        else:
            for reply in replies:
                reply.close(ended)
        decode_s = time.perf_counter() - start - ttft
        reply = replies[0]
        generated = reply.ids
        keys = list(zip(ids, table.extra_ids))
        reused = self._reused_tokens(keys) if self.settings.kv_cache_enable_block_reuse else 0
        # a beam search's prompt blocks are the ones known to be kept for reuse (BlockManager::storeContextBlocks)
        self.previous_keys = keys if beam is not None else keys + [(t, 0) for t in generated]
        self.messages = plan.messages + [{"role": "assistant", "content": reply.text}]
        self.images = shown_images(self.messages, self.images)
        tok_s = (len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0
        return self._stats(reply.text, generated, len(ids) - reused, reused, ttft, tok_s, reply.finish_reason,
                           plan.evicted, alternatives=[other.text for other in replies[1:]], compacted=plan.compacted)

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays."""
        self.messages = self.messages[:1] if self.system_prompt else []
        self.previous_keys, self.turns, self.images, self.clips = [], 0, {}, {}

    def save(self, path: str | Path) -> int:
        """Not available: TensorRT-LLM keeps its KV blocks to itself."""
        raise SessionFileError("saving is available on the reference backend only ({})",
                               (Hint(Fix.BACKEND_NAME, "reference"),))

    def describe_kv(self) -> str:
        """The KV settings handed to TensorRT-LLM."""
        return f"TensorRT-LLM KV settings: {self.settings}"

    def _check_forks(self, n: int, beam: BeamParams | None) -> None:
        """ConfigError where n or a beam search cannot run on this engine and runner."""
        if n < 1 or (n > 1 and beam is not None):
            raise ConfigError(f"n must be >= 1, and 1 with a beam search, got n={n}")
        if n > 1 and not self.forks:
            raise ConfigError(*TRTLLM_NO_N)
        if beam is None:
            return
        if beam.beam_width > self.limits.max_beam_width:
            raise ConfigError(f"a beam search of {beam.beam_width} beams needs an engine built for them; "
                              f"{self.engine_dir} was built with max_beam_width {self.limits.max_beam_width} "
                              "(build_config of its config.json): {}",
                              (Hint(Fix.BUILD_BEAM_WIDTH, str(beam.beam_width)), Hint(Fix.BACKEND, "reference")))
        if beam.length_penalty < 0:
            raise ConfigError(f"TensorRT-LLM takes length_penalty >= 0 (its SamplingConfig refuses "
                              f"{beam.length_penalty}); ask for one >= 0", (Hint(Fix.BACKEND, "reference"),))

    def _with_audio(self, message: dict, audio: list[Clip]) -> tuple[dict, list[dict]]:
        """The message as its clips' transcripts, then its text, and what was heard (the speech front end runs on the
        CPU beside the engine); AudioError where a clip cannot be taken."""
        return spoken_message(message, audio, self.asr, self.audio_limits)

    def _with_images(self, message: dict, images: list[tuple[str, bytes]], held: dict[str, PreparedImage]) -> dict:
        """The message with its pictures as image parts, prepared into ``held``; ImageError where this engine and
        runner cannot take them."""
        if self.vision is None:
            raise ImageError(f"{self.engine_dir.parent} takes text only; pictures need an engine built from a "
                             "vision-language model (LLaVA, Idefics3 / SmolVLM)")
        if self.vision.family.mrope:
            raise ImageError("Qwen2-VL's pictures need M-RoPE positions (TensorRT-LLM's mrope_params), which this "
                             "backend does not pass", (Hint(Fix.BACKEND, "reference"),))
        if not self.table_rows:
            raise ImageError(f"{self.engine_dir} was built without a prompt table for pictures "
                             "(build_config.max_prompt_embedding_table_size 0)", (Hint(Fix.BUILD_VISION),))
        return self.vision.image_message(message, images, held)

    def _with_clips(self, message: dict, clips: list[Clip], held: dict[str, PreparedClip]) -> dict:
        """The message with its clips as audio parts, prepared into ``held``; AudioError where this engine cannot
        take them."""
        if not self.table_rows:
            raise AudioError(f"{self.engine_dir} was built without a prompt table for audio "
                             "(build_config.max_prompt_embedding_table_size 0)", (Hint(Fix.BUILD_VISION),))
        return with_transcripts(self.audio.audio_message(message, clips, held), clips, self.audio.transcripts,
                                self.asr)

    def _prompt_table(self, plan: TurnPlan, held: dict[str, PreparedImage],
                      clips: dict[str, PreparedClip]) -> PromptTable:
        """The plan's feed with its pictures' and clips' rows as a prompt table; ImageError (AudioError where the
        conversation holds clips) where they need more rows than the engine's table holds."""
        if not plan.media:
            return PromptTable(plan.feed, [0] * len(plan.feed), None)
        needed = sum(len((held.get(span.digest.hex()) or clips[span.digest.hex()]).offsets) for span in plan.media)
        if needed > self.table_rows:
            error, fix = (AudioError, Fix.SHORTER_AUDIO) if clips else (ImageError, Fix.SMALLER_PICTURES)
            raise error(f"the conversation's {len(plan.media)} pictures or clips need {needed} rows of the prompt "
                        f"table, over the {self.table_rows} the engine was built for "
                        "(build_config.max_prompt_embedding_table_size); build the engine with a larger table",
                        (Hint(Fix.NEW_CONVERSATION), Hint(fix)))

        def rows_of(digest: bytes) -> MediaRows:
            key = digest.hex()
            return self.vision.encode(held[key]) if key in held else self.audio.encode(clips[key])

        return prompt_table(plan.feed, plan.media, rows_of, self.vocab_size)

    def _table_kwargs(self, table: PromptTable) -> dict:
        """``generate``'s prompt-table arguments: MultimodalModelRunner's shape [batch, rows, hidden] and one task,
        with the tokens' extra ids where the runner takes them."""
        if table.rows is None:
            return {}
        kwargs = {"prompt_table": table.rows[None], "prompt_tasks": "0"}
        if self.extra_ids:
            kwargs["input_token_extra_ids"] = [table.extra_ids]
        return kwargs

    def _generate_kwargs(self, n: int, beam: BeamParams | None) -> dict:
        """``generate``'s stop, output and decoding arguments: TensorRT-LLM's beam search (no sampling), or sampling
        (top_k 1 where the temperature is 0) of ``n`` sequences."""
        stop_ids = self.params.stop_token_ids
        kwargs = {"end_id": stop_ids[0], "pad_id": stop_ids[0],
                  "stop_words_list": [[[i] for i in stop_ids[1:]]] if stop_ids[1:] else None,
                  "return_dict": True, "output_sequence_lengths": True}
        if beam is not None:
            kwargs.update(num_beams=beam.beam_width, length_penalty=float(beam.length_penalty),
                          early_stopping=TRTLLM_EARLY_STOPPING[beam.early_stopping])
            if self.forks:  # streamed beams come whole at every step: replace them, do not append
                kwargs["return_all_generated_tokens"] = True
            return kwargs
        p = self.params
        kwargs.update(temperature=p.temperature or 1.0, top_k=1 if p.temperature == 0 else p.top_k, top_p=p.top_p,
                      random_seed=p.seed)
        if n > 1:
            kwargs["num_return_sequences"] = n
        return kwargs

    @staticmethod
    def _push(replies: list[ReplyStream], outputs, lengths, prompt: int) -> bool:
        """Push each sequence's new tokens through its reply's stop rules; True when every reply had ended before
        and the runner still goes on (past a stop string, which it does not see)."""
        ended = all(reply.finish_reason for reply in replies)
        for index, reply in enumerate(replies):
            new = [int(t) for t in outputs[index][prompt + len(reply.ids):int(lengths[index])]]
            if ended and new:
                return True
            for token in new:
                if reply.finish_reason:
                    break
                reply.push(token)
        return False

    def _beam_replies(self, beams: list[list[int]], params: SamplingParams, ended: str) -> list[ReplyStream]:
        """The beams as replies, best first, through the stop rules; a beam that ended before the length limit
        ended on a stop token. An interrupted search gives its leading beam only."""
        replies = []
        for tokens in beams[:1] if ended == "interrupted" else beams:
            reply = ReplyStream(params, self.tokenizer.decode_reply)
            for token in tokens:
                reply.push(token)
                if reply.finish_reason:
                    break
            reply.close(ended if ended == "interrupted" or len(tokens) >= params.max_new_tokens else "stop")
            replies.append(reply)
        return replies

    def _plan(self, messages: list[dict], beam: BeamParams | None = None,
              images: dict[str, PreparedImage] | None = None,
              clips: dict[str, PreparedClip] | None = None) -> TurnPlan:
        """The whole rendered history (with ``images`` and ``clips``, the pictures and clips its messages hold), or
        what the overflow policy keeps of it."""
        # sink-window truncates the stream here too: max_input_len and max_seq_len bound the prompt whatever
        # attention window the engine keeps
        if beam is None:
            capacity = self.capacity
            room = Room(capacity, lambda n: n <= capacity, appends_turns=False)
        else:
            room = Room(self._beam_prompt_limit(beam) + beam.max_new_tokens,
                        lambda n: self._beam_fits(n - beam.max_new_tokens, beam), appends_turns=False)
        tokenizer = self.tokenizer.with_images(images, self.vision.placeholder) if images else self.tokenizer
        tokenizer = tokenizer.with_audio(clips, self.audio.placeholder) if clips else tokenizer
        return plan_turn(tokenizer, messages, room, self.overflow, self.config.sink_token_length,
                         beam.max_new_tokens if beam else self.params.max_new_tokens)

    def _beam_fits(self, prompt: int, beam: BeamParams,
                   blocks: Callable[[int, int, int, int], int] = beam_kv_blocks) -> bool:
        """Whether a beam search over a prompt of this many tokens fits the engine's limits and the KV budget
        (``blocks``: what it reserves, ``beam_kv_blocks``, or ``beam_kv_blocks_up_to`` for every shorter prompt too)."""
        budget_blocks = self.settings.max_tokens_in_paged_kv_cache // self.config.tokens_per_block
        return (0 <= prompt <= self.limits.max_input_len and prompt + beam.max_new_tokens <= self.limits.max_seq_len
                and blocks(prompt, beam.max_new_tokens, beam.beam_width, self.config.tokens_per_block) <= budget_blocks)

    def _beam_prompt_limit(self, beam: BeamParams) -> int:
        """The longest prompt such that every prompt up to it fits a beam search (-1: none does)."""
        low, high = -1, self.limits.max_input_len
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self._beam_fits(middle, beam, beam_kv_blocks_up_to) else (low, middle - 1)
        return low

    def _capacity_error(self, err: CapacityError, beam: BeamParams | None) -> CapacityError:
        """A refused turn's error, with what binds where it is the engine or the beams rather than the budget."""
        if beam is not None:
            limit = self._beam_prompt_limit(beam)
            refused = capacity_error(err, self.overflow, beam.max_new_tokens, limit + beam.max_new_tokens)
            why = (f"a search of {beam.beam_width} beams takes prompts of at most {max(limit, 0)} tokens: "
                   f"TensorRT-LLM reserves the prompt's whole KV blocks once and each beam's last block and "
                   f"{beam.max_new_tokens}-token reply on its own")
        else:
            refused = capacity_error(err, self.overflow, self.params.max_new_tokens, self.capacity)
            if self.capacity >= self.settings.max_tokens_in_paged_kv_cache:  # the budget binds, not the engine
                return refused
            why = (f"the engine takes prompts of at most {self.capacity - self.params.max_new_tokens} tokens: "
                   f"max_input_len {self.limits.max_input_len}, max_seq_len {self.limits.max_seq_len} less "
                   f"{self.params.max_new_tokens} for the reply")
        where = "; {}" if refused.hints else ""
        return CapacityError(f"{refused.message}{where} ({why})", refused.hints)

    def _reused_tokens(self, keys: list[tuple[int, int]]) -> int:
        """Tokens TensorRT-LLM can reuse with block reuse on: the common prefix of (id, extra id) with the previous
        turn's tokens in whole blocks of the engine's ``tokens_per_block``, less the last token."""
        common = 0
        for a, b in zip(self.previous_keys, keys):
            if a != b:
                break
            common += 1
        block = self.config.tokens_per_block
        return min(common // block * block, len(keys) - 1)

    def _stats(self, reply: str, ids: list[int], prefill: int, reused: int, ttft: float, tok_s: float,
               finish: str, evicted: int, error: str | CabinError | None = None,
               alternatives: list[str] | None = None, compacted: list[Compacted] | None = None) -> TurnStats:
        held = min(len(self.previous_keys), self.settings.max_tokens_in_paged_kv_cache)
        budget = self.settings.max_tokens_in_paged_kv_cache * self.bytes_per_token
        message, hints = error_parts(error)
        return TurnStats(self.turns, reply, ids, prefill, reused, ttft, tok_s, held * self.bytes_per_token, budget,
                         self.bytes_per_token, self.config.kv_mode, finish, evicted, self.overflow.name, message,
                         alternatives=alternatives or [], hints=hints, compacted=compacted or [])
