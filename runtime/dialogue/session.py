"""A multi-turn dialogue on one model runner and one paged KV cache.

Each turn is one request to the engine core (cabinllm.runtime.engine.core), drained before ``chat`` returns; it
continues the session's sequence, so it prefills only what is new since the last turn: the history's KV stays in
the cache. A shared prefix (the system prompt) is found again through the cache's
block hashes, so a second session starting the same way reuses its blocks. When a
turn does not fit the budget, the session's overflow policy (cabinllm.runtime.dialogue.overflow) decides
what to keep: first the pictures of answered turns become text markers (their blocks freed, the prefix before the
first of them still cached), then the policy; a picture no message shows any more is let go. Sessions are saved
to and restored from session files (cabinllm.runtime.dialogue.session_file).
Pictures sent with a message (a vision-language engine) are decoded, checked against the engine's caps and expanded
into their tokens before anything runs; their rows come from the engine's encoder (or its feature cache) only for
the tokens not reused from the cache. Clips the user speaks are heard by the speech front end on a text engine: the
message is their transcript (cabinllm.runtime.speech.asr.spoken_message). An audio-language engine (Qwen2-Audio)
takes them as pictures are taken: each clip is a medium of the message (an audio part keyed by ``Clip.digest``, with
the speech front end's transcript where it is installed: what compaction replaces the clip by), its tokens the
processor's expansion. A session given ``tools`` shows them to the model and constrains each reply by ``tool_choice``
(cabinllm.runtime.generation.grammar) to one call or none; a reply that calls comes back as
``TurnStats.tool_calls`` and the next message answers it (role ``tool``).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Callable

from cabinllm.runtime.dialogue.interface import TurnStats, error_parts
from cabinllm.runtime.dialogue.overflow import (Compacted, Held, OverflowPolicy, Room, TurnPlan, capacity_error,
                                                plan_turn, shown_images)
from cabinllm.runtime.dialogue.session_file import check_fits, read_session_file, within_memory, write_session_file
from cabinllm.runtime.engine.core import EngineCore
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.engine.scheduler import SchedulerConfig
from cabinllm.runtime.errors import (AudioError, CabinError, CapacityError, ConfigError, Fix, GrammarError, Hint,
                                     ImageError, OutOfBlocks, SessionFileError)
from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.grammar import reply_grammar
from cabinllm.runtime.generation.sampling import MAX_SEED, SamplingParams
from cabinllm.runtime.kv.blocks import MediaSpan, Sequence, cdiv
from cabinllm.runtime.kv.cache import KvCacheConfig, PagedKVCache
from cabinllm.runtime.model.audio import TRANSCRIPTS_KEPT, PreparedClip
from cabinllm.runtime.model.interface import MediaFeed
from cabinllm.runtime.model.media import EncodedRows
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.tools import ContentStream, Tool, ToolCall, ToolFormat
from cabinllm.runtime.model.vision import PreparedImage
from cabinllm.runtime.speech.asr import AsrConfig, front_end, spoken_message
from cabinllm.runtime.speech.audio import AudioLimits, Clip


def with_transcripts(message: dict, clips: list[Clip], heard: OrderedDict[bytes, str], config: AsrConfig) -> dict:
    """The message with each audio part's transcript (``"transcript"``: the speech front end's words for its clip)
    where the front end is installed and hears words; as it is without one (compaction then names the clip).
    ``heard``: transcripts by clip digest (an engine's), taken from there and kept there, the oldest let go."""
    new = {clip.digest: clip for clip in clips if clip.digest not in heard}
    if new:
        try:
            asr = front_end(config)
        except AudioError:
            return message
        heard.update({digest: asr.transcribe(clip).text for digest, clip in new.items()})
    for clip in clips:
        heard.move_to_end(clip.digest)
    while len(heard) > TRANSCRIPTS_KEPT:
        heard.popitem(last=False)
    said = {clip.digest.hex(): heard[clip.digest] for clip in clips}
    return {**message, "content": [{**part, "transcript": said[part["digest"]]}
                                   if part.get("type") == "audio" and said.get(part["digest"]) else part
                                   for part in message["content"]]}


class DialogueSession:
    """System, user and assistant messages plus the sequence that holds their KV."""

    def __init__(self, engine: Engine, cache: PagedKVCache, params: SamplingParams | None = None,
                 system_prompt: str | None = None, overflow: OverflowPolicy | None = None,
                 tools: list[Tool] | None = None, tool_choice: str = "auto", asr: AsrConfig | None = None,
                 audio_limits: AudioLimits | None = None) -> None:
        """``tools`` the replies may call as ``tool_choice`` allows ("auto", "required", "none" or a tool's name);
        ``asr``: the speech front end that hears the user's clips, ``audio_limits`` their caps."""
        self.engine, self.cache = engine, cache
        self.asr, self.audio_limits = asr or AsrConfig(), audio_limits or AudioLimits()
        self.tools, self.tool_choice = list(tools or []), tool_choice
        self.params = params or SamplingParams(stop_token_ids=engine.stop_token_ids())
        self.overflow = overflow or OverflowPolicy("error")
        self.system_prompt = system_prompt
        self.seq = Sequence()         # the tokens whose K/V are in the cache
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.pending: list[int] = []  # the last sampled token, fed with the next turn
        self.transcript = ""          # the conversation text the KV and pending token stand for
        self.turns = 0
        self.images: dict[str, PreparedImage] = {}  # the conversation's pictures by digest (hex)
        self.clips: dict[str, PreparedClip] = {}  # its audio clips by digest (hex), on an audio-language engine

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The engine's tokenizer, rendering this session's tools (and pictures, on a vision-language engine; clips,
        on an audio-language one)."""
        tok = self.engine.tokenizer.with_tools(self.tools)
        vision, audio = self.engine.vision, self.engine.audio
        tok = tok.with_images(self.images, vision.placeholder) if vision else tok
        return tok.with_audio(self.clips, audio.placeholder) if audio else tok

    @property
    def fed(self) -> list[int]:
        """The tokens whose K/V the cache holds for this conversation."""
        return self.seq.token_ids

    def chat(self, message: str | dict, on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None, tool_choice: str | None = None, n: int = 1,
             beam: BeamParams | None = None, images: list[tuple[str, bytes]] | None = None,
             audio: list[Clip] | None = None) -> TurnStats:
        """Answer one message (text: the user's; or a message dict, e.g. a tool's result); ``tool_choice`` for this
        reply only (None: the session's). ``n`` > 1: that many sampled replies from one prefill (seeds ``seed``,
        ``seed + 1``, ...); ``beam``: a beam search; the conversation goes on with the first reply (the best beam),
        the others are ``alternatives`` (neither streams). ``images``: (name, bytes) of pictures the user's message
        shows, before its text. ``audio``: clips the user spoke: heard by the speech front end on a text engine
        (``_with_audio``, what was heard in ``TurnStats.heard``), media of the message on an audio-language engine.
        A turn that cannot fit ends with finish_reason 'capacity'; a picture or clip that cannot be taken raises
        ImageError or AudioError before anything changes."""
        self._check_forks(n, beam)
        message = message if isinstance(message, dict) else {"role": "user", "content": message}
        heard: list[dict] = []
        if audio and self.engine.audio is None:
            message, heard, audio = *self._with_audio(message, audio), None
        stats = self._answer(message, on_text, should_stop, tool_choice, n, beam, images, audio)
        stats.heard = heard
        return stats

    def _answer(self, message: dict, on_text: Callable[[str], None] | None, should_stop: Callable[[], bool] | None,
                tool_choice: str | None, n: int, beam: BeamParams | None, images: list[tuple[str, bytes]] | None,
                audio: list[Clip] | None) -> TurnStats:
        """The turn of ``chat`` once its message is text (with pictures, or an audio-language engine's clips)."""
        if images:
            message = self._with_images(message, images)
        if audio:
            message = self._with_clips(message, audio)
        self.turns += 1
        messages = self.messages + [message]
        choice = tool_choice or self.tool_choice
        grammar = reply_grammar(self.tokenizer.tool_format, self.tools, choice, parallel=False)
        tool_format = self.tokenizer.tool_format if self.tools and choice != "none" else None  # of calls it may write
        try:
            t0 = time.perf_counter()  # the first token's time counts the turn's planning (and any compaction)
            plan = self._plan(messages)
            if plan.rebuild:
                self._release()
            held = len(self.seq)
            request = self._request(plan, n, beam, grammar, tool_format, on_text)
            self._core(request).generate(request, should_stop)
        except CapacityError as err:
            refused = capacity_error(err, self.overflow, self.params.max_new_tokens, self._room().capacity,
                                     self._pictures_of(message))
            return self._stats("", [], 0, 0, 0.0, 0.0, "capacity", 0, refused)
        except GrammarError as err:  # the reply's grammar could not start (or fit its limit): the next turn rebuilds
            self._release()
            return self._stats("", [], 0, 0, 0.0, 0.0, "error", 0, err)
        except (ImageError, AudioError):  # a medium's rows were not at hand: the sequence is gone; the next rebuilds
            self._release()
            self.turns -= 1
            raise
        except BaseException:  # a failed step took the sequence's unwritten K/V with it: the next turn rebuilds
            self._release()
            raise
        if request.finish_reason == "error":  # the cache holds part of a reply the messages will not: rebuild
            self._release()
            return self._stats("", [], 0, 0, 0.0, 0.0, "error", 0, request.error)
        content = tool_format.content(request.text) if tool_format else request.text
        calls = tool_format.read_calls(request.text) if tool_format else None
        confidence = self._name_probabilities(request, calls) if calls else []
        reply = {"role": "assistant", "content": "" if calls else content}
        if calls:
            reply["tool_calls"] = [call.to_openai() for call in calls]
        self.messages = plan.messages + [reply]
        self.images = shown_images(self.messages, self.images)
        self.pending = request.token_ids[-1:]
        self.transcript = plan.prompt + self.engine.tokenizer.decode(request.token_ids)
        finish = "tool_calls" if calls and request.finish_reason == "stop" else request.finish_reason
        decode = self.engine.tokenizer.decode_reply
        others = request.beams[1:] if beam else [follower.token_ids for follower in request.followers]
        ttft = (request.first_token_at or t0) - t0
        return self._stats(reply["content"], request.token_ids, len(plan.feed) - request.cached_tokens,
                           held + request.cached_tokens, ttft, request.decode_tok_s, finish, plan.evicted,
                           tool_calls=reply.get("tool_calls"), alternatives=[decode(ids) for ids in others],
                           call_confidence=confidence, compacted=plan.compacted)

    def _request(self, plan: TurnPlan, n: int, beam: BeamParams | None, grammar: str | None,
                 tool_format: ToolFormat | None, on_text: Callable[[str], None] | None) -> Request:
        """The turn's request to the core: the plan's feed continuing the session's sequence, ``n`` choices (seeds
        ``seed``, ``seed + 1``, ...) or a beam search; ``tool_format``: of the calls the reply may write (their
        markup never reaches ``on_text``)."""
        params = replace(self.params, max_new_tokens=beam.max_new_tokens) if beam else self.params
        seed = params.seed

        def choice(i: int) -> Request:
            return Request(plan.feed, replace(params, seed=None if seed is None else (seed + i) % (MAX_SEED + 1)),
                           grammar=self.engine.vocabulary.start(grammar, tool_format) if grammar else None,
                           logprobs=0 if grammar and self.tools else None)  # a call's confidence needs them

        request = choice(0)
        request.seq, request.beam, request.media = self.seq, beam, self._media(plan)
        request.followers = [choice(i) for i in range(1, n)]
        if on_text and n == 1 and beam is None:
            shown = ContentStream(tool_format)

            def show(_request: Request, text: str, finished: bool) -> None:
                piece = shown.piece(text) + (shown.rest(_request.text) if finished else "")
                if piece:
                    on_text(piece)
            request.on_output = show
        return request

    def _core(self, request: Request) -> EngineCore:
        """An engine core over the session's cache for one turn: as wide as its choices or beams, its feed
        prefilled in one step."""
        return EngineCore(self.engine.model, self.cache, self.engine.tokenizer.decode_reply,
                          SchedulerConfig(max_sessions=request.sessions, max_queue=1,
                                          prefill_chunk=max(1, len(request.prompt_ids))))

    def _with_images(self, message: dict, images: list[tuple[str, bytes]]) -> dict:
        """The message with its pictures as image parts (decoded, checked and kept by digest); ImageError naming
        the picture and the cap where one cannot be taken."""
        vision = self.engine.vision
        if vision is None:
            raise ImageError(f"{self.engine.folder} takes text only; pictures need an engine built from a "
                             "vision-language model (LLaVA, Idefics3 / SmolVLM, Qwen2-VL; its cabin-export graphs: "
                             "the npu profile, not for Qwen2-VL)")
        return vision.image_message(message, images, self.images)

    def _with_clips(self, message: dict, clips: list[Clip]) -> dict:
        """The message with its clips as audio parts (prepared and kept by digest) on an audio-language engine, each
        with its transcript where the speech front end hears one; AudioError naming the clip and the cap where one
        cannot be taken."""
        encoder = self.engine.audio
        return with_transcripts(encoder.audio_message(message, clips, self.clips), clips, encoder.transcripts,
                                self.asr)

    def _with_audio(self, message: dict, audio: list[Clip]) -> tuple[dict, list[dict]]:
        """The message as its clips' transcripts, then its text, and what was heard (a text engine hears through the
        speech front end); AudioError where a clip cannot be taken."""
        return spoken_message(message, audio, self.asr, self.audio_limits)

    def _pictures_of(self, message: dict) -> list[tuple[str, int]]:
        """(name, tokens) of the pictures a message shows."""
        parts = message["content"] if isinstance(message.get("content"), list) else []
        return [(self.images[p["digest"]].name, self.images[p["digest"]].image_tokens) for p in parts
                if p.get("type") == "image"]

    def _media(self, plan: TurnPlan) -> MediaFeed | None:
        """The pictures (or clips) of a turn's feed, their rows encoded only when the forward pass reads them."""
        if not plan.media:
            return None
        if self.engine.audio is not None:
            return MediaFeed(plan.media, EncodedRows(self.engine.audio, self.clips))
        return MediaFeed(plan.media, EncodedRows(self.engine.vision, self.images))

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and release its KV blocks."""
        self._release()
        self.messages = self.messages[:1] if self.system_prompt else []
        self.turns = 0

    def describe_kv(self) -> str:
        """KV memory of the session in one line."""
        s = self.cache.stats()
        return (f"KV {s.mode}: {len(self.seq)} tokens held, {s.bytes_used / 2**20:.2f} of "
                f"{s.bytes_reserved / 2**20:.2f} MiB in use ({s.bytes_per_token} B/token); blocks free "
                f"{s.blocks_free}, cached {s.blocks_cached}, in use {s.blocks_in_use}; prefix reuse hits "
                f"{s.reuse_hits} blocks")

    # -- persistence ---------------------------------------------------------------
    def save(self, path: str | Path) -> int:
        """Write messages, the KV of every token in its stored form and fingerprints to path atomically;
        returns the tokens of KV saved."""
        storage = self.cache.storage
        if not self.cache.mode.per_token:
            raise SessionFileError(f"saving a session needs per-token KV storage; {self.cache.mode.name} stores "
                                   "whole blocks", (Hint(Fix.PER_TOKEN_KV_MODE),))
        tensors = storage.session_rows(self.seq) if self.seq else {}
        write_session_file(path, {
            "model_fingerprint": self.engine.fingerprint,
            "scales_fingerprint": storage.scales_fingerprint(),
            "kv_cache": self.cache.config.to_dict(),
            "system_prompt": self.system_prompt,
            "messages": self.messages,
            "fed": self.fed,
            "pending": self.pending,
            "transcript": self.transcript,
            "turns": self.turns,
            "overflow": vars(self.overflow),
            "params": vars(self.params),
            "tools": [tool.to_openai() for tool in self.tools],
            "tool_choice": self.tool_choice,
            "images": {digest: image.to_json() for digest, image in self.images.items()},
            "clips": {digest: clip.to_json() for digest, clip in self.clips.items()},
            "image_names": {digest: image.name for digest, image in self.images.items()},
            "media": [[span.start, span.length, span.digest.hex(), span.grid] for span in self.seq.media],
        }, tensors)
        return len(self.seq)

    @classmethod
    def restore(cls, path: str | Path, engine: Engine, cache: PagedKVCache | None = None, asr: AsrConfig | None = None,
                audio_limits: AudioLimits | None = None) -> "DialogueSession":
        """Continue a saved session on an engine of the same model and scales, without re-prefill
        (in a new cache like the saved one if none is given; ``asr``, ``audio_limits``: as the constructor's)."""
        header, tensors = read_session_file(path)
        if header["model_fingerprint"] != engine.fingerprint:
            raise SessionFileError(f"{path}: saved with model {header['model_fingerprint']}, this engine runs "
                                   f"{engine.fingerprint}; restore it with the engine it was saved from")
        config = KvCacheConfig(**header["kv_cache"])
        try:
            cache = cache or engine.new_cache(within_memory(config))
        except ConfigError as err:
            raise SessionFileError(f"{path}: {err.message}", err.hints) from err
        scales = cache.storage.scales_fingerprint()
        if cache.mode.name != config.kv_mode or scales != header["scales_fingerprint"]:
            raise SessionFileError(f"{path}: saved with {config.kv_mode} KV and scales "
                                   f"{header['scales_fingerprint']}, the cache uses {cache.mode.name} and {scales}")
        check_fits(path, header, tensors, cache.storage.token_tensors(), engine.config.vocab_size,
                   engine.config.max_position_embeddings)
        tools = [Tool.from_openai(tool) for tool in header.get("tools", [])]
        session = cls(engine, cache, SamplingParams(**header["params"]), header["system_prompt"],
                      OverflowPolicy(**header["overflow"]), tools, header.get("tool_choice", "auto"), asr, audio_limits)
        fed = header["fed"]
        names = header["image_names"]  # as the pictures were sent, for the markers that may replace them
        images = {d: PreparedImage.from_json(d, image) for d, image in header["images"].items()}
        session.images = {d: replace(image, name=names[d]) if d in names else image for d, image in images.items()}
        session.clips = {d: PreparedClip.from_json(d, clip) for d, clip in header["clips"].items()}
        media = [MediaSpan(start, length, bytes.fromhex(digest), tuple(grid) if grid else None)
                 for start, length, digest, grid in header.get("media", [])]
        if fed:
            try:
                reused = cache.allocate(session.seq, fed, media)
            except OutOfBlocks as err:
                raise SessionFileError(f"{path}: the session holds {len(fed)} tokens of KV, more than this cache "
                                       f"holds ({err})", (Hint(Fix.RAISE_KV_BUDGET),)) from err
            cache.storage.restore_rows(session.seq, tensors, reused)
        session.messages, session.pending = header["messages"], header["pending"]
        session.transcript, session.turns = header["transcript"], header["turns"]
        return session

    # -- forks ---------------------------------------------------------------------
    def _check_forks(self, n: int, beam: BeamParams | None) -> None:
        """ConfigError where n or a beam search cannot be run as asked."""
        if n < 1 or (n > 1 and beam is not None):
            raise ConfigError(f"n must be >= 1, and 1 with a beam search, got n={n}")
        if (n > 1 or beam is not None) and not self.engine.model.batched:
            raise ConfigError("several replies per turn need a model that steps several sequences at once (the "
                              "reference engine); this backend's runs one")
        if beam is not None and self.tools:
            raise ConfigError("a beam search follows no grammar: leave tools out of a session that searches beams")

    # -- planning ------------------------------------------------------------------
    def _plan(self, messages: list[dict]) -> TurnPlan:
        """Decide what to feed: append the new tokens, or rebuild the sequence under the policy."""
        held = Held(self.fed, self.seq.media, self.pending, self.transcript, self._fits_append)
        return plan_turn(self.tokenizer, messages, self._room(), self.overflow, self.cache.config.sink_token_length,
                         self.params.max_new_tokens, held)

    def _room(self) -> Room:
        """What this conversation could hold once its own blocks are released."""
        context = self.engine.config.max_position_embeddings
        capacity = self.cache.capacity(self.seq)
        tpb = self.cache.tokens_per_block
        return Room(min(capacity, context), lambda n: n <= context and cdiv(n, tpb) * tpb <= capacity,
                    appends_turns=True)

    def _fits_append(self, new: int) -> bool:
        """Whether ``new`` tokens plus a full reply fit after the tokens held now."""
        total = new + self.params.max_new_tokens
        return len(self.seq) + total <= self.engine.config.max_position_embeddings and self.cache.fits(self.seq, total)

    def _name_probabilities(self, request: Request, calls: list[ToolCall]) -> list[float]:
        """The probability the reply gave each call's function name, from its tokens' log-probabilities."""
        token_bytes = self.engine.vocabulary.token_bytes
        return self.tokenizer.tool_format.name_probabilities(
            [token_bytes(lp.token) for lp in request.token_logprobs], [lp.logprob for lp in request.token_logprobs],
            [call.name for call in calls])

    def _release(self) -> None:
        if self.seq:
            self.cache.free(self.seq)
        self.pending, self.transcript = [], ""

    def _stats(self, reply: str, ids: list[int], prefill: int, reused: int, ttft: float, tok_s: float,
               finish: str, evicted: int, error: str | CabinError | None = None,
               tool_calls: list[dict] | None = None, alternatives: list[str] | None = None,
               call_confidence: list[float] | None = None, compacted: list[Compacted] | None = None) -> TurnStats:
        s = self.cache.stats()
        message, hints = error_parts(error)
        return TurnStats(self.turns, reply, ids, prefill, reused, ttft, tok_s, s.bytes_used, s.bytes_reserved,
                         s.bytes_per_token, s.mode, finish, evicted, self.overflow.name, message, tool_calls or [],
                         alternatives or [], hints, call_confidence or [], compacted or [])
