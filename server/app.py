"""The HTTP face of the engine core: OpenAI's chat completions and audio transcriptions, models, health and
Prometheus metrics.

Each request renders and plans its prompt (cabinllm.server.conversation), queues on the engine core and waits for
its output; the core steps in one engine thread started with the app. Spoken parts (``input_audio``) are heard
first, in the speech thread (cabinllm.server.speech), and read by a text engine as their transcripts; an
audio-language engine hears them as media (with their transcripts, for compaction), as a vision-language engine
sees pictures. A client that disconnects cancels its request, which frees its KV blocks at the next step.
``/openapi.json`` and ``/docs`` describe the API, from the models of cabinllm.server.openai_api.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, File, Form, UploadFile
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cabinllm.runtime.dialogue.overflow import OverflowPolicy, capacity_error
from cabinllm.runtime.engine.loader import Engine
from cabinllm.runtime.errors import AudioError, CapacityError, Fix, GrammarError, ImageError, QueueFull
from cabinllm.runtime.generation.grammar import (MAX_TOOL_CALLS, GrammarState, choice_grammar, json_schema_grammar,
                                                 regex_grammar, reply_grammar)
from cabinllm.runtime.generation.sampling import TokenLogprob
from cabinllm.runtime.engine.core import EngineCore
from cabinllm.runtime.engine.request import Request
from cabinllm.runtime.model.audio import AudioEncoder, PreparedClip
from cabinllm.runtime.model.interface import MediaFeed
from cabinllm.runtime.model.media import EncodedRows
from cabinllm.runtime.model.vision import PreparedImage
from cabinllm.runtime.model.tools import ContentStream, Tool, ToolCall, ToolFormat
from cabinllm.runtime.speech.asr import AsrConfig
from cabinllm.runtime.speech.audio import AudioLimits
from cabinllm.server.conversation import plan_prompt
from cabinllm.server.edge import Edge, ServeLimits, Shutdown
from cabinllm.server.openai_api import (ApiError, AudioPart, ImagePart, ChatCompletion, ChatCompletionRequest, Choice,
                                        ChoiceDelta, ChoiceLogprobs, ErrorResponse, Transcription, TranscriptionFormat,
                                        TranscriptionVerbose, Usage, call_deltas, check_body, choice_logprobs, chunk,
                                        completion, is_json, reply_message, request_error, transcription,
                                        transcription_refusal, usage, usage_chunk)
from cabinllm.server.speech import DEFAULT_ASR_MODEL, SpeechIn, asr_model_name

log = logging.getLogger("cabinllm.server")
RETRY_AFTER_S = 1  # what a client told to come back later waits
CLIENT_GONE = 499  # the status counted for a request whose client left before its first token (nginx's)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"  # the text format every Prometheus version reads
ERROR_ANSWERS: dict[int | str, dict[str, Any]] = {  # "4XX" also keeps FastAPI from listing a 422 never sent
    status: {"model": ErrorResponse, "description": description}
    for status, description in [("4XX", "400: a bad request, naming the field; 401: no or a wrong API key; 404: "
                                        "a model not served here; 408: the body came too slowly; 413: the body is "
                                        "too large; 429: the queue is full, retry after Retry-After seconds"),
                                (500, "the model step failed, or the server failed on this request"),
                                (503, "the server stayed full or is stopping; retry after Retry-After seconds")]}
TRANSCRIPTION_ANSWER = {"description": "the transcript: an object for response_format json and verbose_json, text "
                                       "for text, srt and vtt",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}
STREAM_ANSWER = {"description": "a chat.completion, or with stream true server-sent events of "
                                "chat.completion.chunk objects ending with data: [DONE]",
                 "content": {"text/event-stream": {"schema": {"type": "string"}}}}
# The server's words for each Fix of a CabinError a request meets (a {} takes the hint's detail): request fields for
# what the client chooses; what only the server's operator can change is named as the operator's.
SERVER_WORDS: dict[Fix, str] = {
    Fix.LOWER_MAX_NEW_TOKENS: "lower max_tokens",
    Fix.RAISE_MAX_NEW_TOKENS: "raise max_tokens to {} at least",
    Fix.NEW_CONVERSATION: "start a new conversation",
    Fix.RAISE_KV_BUDGET: "ask the server's operator to raise --kv-budget-mb",
    Fix.OTHER_OVERFLOW: "ask the server's operator to choose --overflow compact-media,sink-window or "
                        "compact-media,drop-turns",
    Fix.SMALLER_PICTURES: 'send fewer or smaller pictures (detail "low")',
    Fix.ONE_REPLY: "ask for n 1 or a beam search (beam_width)",
    Fix.RAISE_MAX_QUEUE: "ask the server's operator for more than --max-queue {}",
    Fix.DEVICE: "ask the server's operator to run it with --device {}",
    Fix.SHORTER_AUDIO: "send clips of {} at most",
    Fix.INSTALL_VOICE: "ask the server's operator to install the speech front end (pip install 'cabinllm[voice]')",
}


@dataclass(frozen=True)
class ServeConfig:
    """What the server answers with beyond the engine core's limits."""

    model_name: str
    overflow: OverflowPolicy
    max_tokens: int = 256  # reply limit of a request that gives none (at most half of what a sequence holds)
    max_n: int = 4  # most choices of one request (each one sequence of --max-sessions)
    max_tool_calls: int = MAX_TOOL_CALLS  # most calls of one reply (parallel_tool_calls false: one)
    asr: AsrConfig = AsrConfig()  # the speech front end that hears input_audio parts and transcriptions
    audio: AudioLimits = field(default_factory=AudioLimits)  # caps on each clip and each message's clips


def json_body_route(limits: ServeLimits) -> type[APIRoute]:
    """A route class whose body is checked as bytes first (within ``limits``' depth and message count), so a body
    that is no UTF-8 JSON object gets the precise 400, and read as JSON whatever its Content-Type (``curl -d`` sends
    a form type)."""

    class JsonBodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[HttpRequest], Coroutine[Any, Any, Response]]:
            """FastAPI's handler behind check_body."""
            handle = super().get_route_handler()

            async def checked(request: HttpRequest) -> Response:
                body = await request.body()
                check_body(body, limits.max_json_depth, limits.max_messages)
                if is_json(request.headers.get("content-type")):
                    return await handle(request)
                return await handle(_as_json(request, body))

            return checked

    return JsonBodyRoute


def _as_json(request: HttpRequest, body: bytes) -> HttpRequest:
    """The same request with ``Content-Type: application/json``: its body once, then the client's own messages
    (a disconnect stays visible)."""
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-type"]
    scope = {**request.scope, "headers": headers + [(b"content-type", b"application/json")]}
    replayed = False

    async def receive() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return HttpRequest(scope, receive)


class EngineMetrics(Collector):
    """The engine core's and the KV cache's gauges and counters, read from the core at each scrape."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        """One family a row, named as Prometheus shows it."""
        stats, cache = self.core.stats()
        rows = [
            ("cabin_kv_bytes_budget", "gauge", "KV cache budget in bytes", self.core.cache.config.max_bytes),
            ("cabin_kv_bytes_reserved", "gauge", "bytes of the preallocated KV block pool", cache.bytes_reserved),
            ("cabin_kv_bytes_used", "gauge", "bytes of KV blocks held by sequences", cache.bytes_used),
            ("cabin_kv_bytes_used_peak", "gauge", "most bytes of KV blocks held at once", stats.kv_bytes_used_peak),
            ("cabin_kv_blocks_total", "gauge", "KV blocks in the pool", cache.blocks_total),
            ("cabin_kv_blocks_free", "gauge", "KV blocks holding nothing", cache.blocks_free),
            ("cabin_kv_blocks_cached", "gauge", "KV blocks kept for prefix reuse, evictable", cache.blocks_cached),
            ("cabin_kv_blocks_in_use", "gauge", "KV blocks held by sequences", cache.blocks_in_use),
            ("cabin_prefix_hit_blocks_total", "counter", "KV blocks served from the prefix cache", cache.reuse_hits),
            ("cabin_prompt_tokens_total", "counter", "prompt tokens of admitted requests", stats.prompt_tokens),
            ("cabin_cached_tokens_total", "counter", "prompt tokens served from the prefix cache",
             stats.cached_tokens),
            ("cabin_generated_tokens_total", "counter", "tokens sampled", stats.generated_tokens),
            ("cabin_requests_finished_total", "counter", "requests finished or cancelled", stats.requests_done),
            ("cabin_engine_steps_total", "counter", "model steps run", stats.steps),
            ("cabin_generated_tokens_per_second", "gauge", "tokens sampled per second of model steps",
             stats.generated_tokens / stats.busy_s if stats.busy_s else 0.0),
            ("cabin_queue_length", "gauge", "requests waiting for a session or KV blocks", stats.waiting),
            ("cabin_active_sequences", "gauge", "sequences prefilling or decoding", stats.running),
        ]
        for name, kind, description, value in rows:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, description, value=value)
        yield from self.core.scheduler.ttft.collect()
        yield from self.core.scheduler.token_gap.collect()


def create_app(engine: Engine, core: EngineCore, config: ServeConfig, limits: ServeLimits = ServeLimits(),
               api_key: str | None = None) -> FastAPI:
    """The FastAPI app behind ``Edge`` (``api_key``: None serves everyone); starts the core's thread on startup
    and stops it on shutdown. ``app.state.shutdown`` is the server's graceful stop (cabinllm.server.edge)."""
    shutdown = Shutdown()
    registry = CollectorRegistry()  # the app's own, so several apps in one process do not clash
    registry.register(EngineMetrics(core))
    speech = SpeechIn(config.asr, config.audio, limits.max_request_audio_s, core.config.max_queue, registry)
    requests = Counter("cabin_http_requests", "HTTP requests answered, by status", ["status"], registry=registry)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=core.run, args=(shutdown.stop,), name="cabin-serve-engine",
                                  daemon=True)
        thread.start()
        yield
        shutdown.stop.set()
        thread.join()
        speech.close()
        _, cache = core.stats()
        log.info("stopped: %d of %d KV blocks in use", cache.blocks_in_use, cache.blocks_total)

    app = FastAPI(title="cabin-serve", lifespan=lifespan)
    app.state.shutdown, app.state.speech = shutdown, speech
    app.add_middleware(Edge, limits=limits, api_key=api_key, requests=requests)

    @app.exception_handler(ApiError)
    async def api_error(_request: HttpRequest, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: HttpRequest, error: RequestValidationError) -> JSONResponse:
        return await api_error(request, request_error(error.errors()))

    @app.get("/health")
    async def health() -> dict:
        stats, _ = core.stats()
        return {"status": "ok", "model": config.model_name, "running": stats.running, "waiting": stats.waiting}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "cabinllm"}]}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus' text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=PROMETHEUS_TEXT)

    chat_routes = APIRouter(route_class=json_body_route(limits))

    @chat_routes.post("/v1/chat/completions", response_model=ChatCompletion,
                      responses={200: STREAM_ANSWER, **ERROR_ANSWERS})
    async def chat_completions(chat: ChatCompletionRequest, http: HttpRequest) -> ChatCompletion | Response:
        if shutdown.draining.is_set():
            raise _stopping()
        if chat.model is not None and chat.model != config.model_name:
            raise ApiError(404, f"model {chat.model!r} is not served here; GET /v1/models lists "
                                f"{config.model_name!r}", param="model", code="model_not_found")
        heard = await _hear(speech, chat, engine.audio)
        choices, outputs = _submit(engine, core, config, chat, asyncio.get_running_loop(), heard)
        request = choices[0]  # the group's leader: admitted, expired or stopped with every choice
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        first = await _first_output(choices, outputs, http)
        if first is None:  # the client left while the request waited: nobody reads an answer
            return Response(status_code=CLIENT_GONE)
        if first.finished and request.finish_reason == "expired":
            raise ApiError(503, f"the server stayed full for {core.config.queue_timeout_s:g} s (every session "
                                f"or the KV budget in use); retry in {RETRY_AFTER_S} s", kind="server_error",
                           code="server_busy", retry_after_s=RETRY_AFTER_S)
        if first.finished and request.finish_reason == "error":
            raise _internal_error(request)
        if first.finished and request.finish_reason == "cancelled":
            raise _stopping()
        reply = Reply(chat, engine)
        if chat.stream:
            return StreamingResponse(_stream(choices, outputs, first, request_id, config.model_name, chat, reply,
                                             shutdown, engine), media_type="text/event-stream")
        open_choices = len(choices) - first.finished
        while open_choices:
            if await http.is_disconnected():
                for choice in choices:
                    choice.cancel()
            open_choices -= (await outputs.get()).finished
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise _internal_error(failed)
        if request.finish_reason == "cancelled" and shutdown.stop.is_set():
            raise _stopping()
        logprobs = _logprobs(engine) if chat.logprobs else None
        return completion(request_id, config.model_name,
                          [_choice(index, choice, reply, logprobs) for index, choice in enumerate(choices)],
                          _usage(choices))

    app.include_router(chat_routes)

    @app.post("/v1/audio/transcriptions", response_model=Transcription | TranscriptionVerbose,
              responses={200: TRANSCRIPTION_ANSWER, **ERROR_ANSWERS})
    async def transcriptions(
            file: Annotated[UploadFile, File(description="the clip: a 16-bit PCM WAV file")],
            model: Annotated[str, Form(description="the speech model's id: whisper-tiny.en, or the name of the "
                                                   "server's --asr-model folder", examples=[DEFAULT_ASR_MODEL])],
            response_format: Annotated[TranscriptionFormat, Form()] = "json",
            language: Annotated[str | None, Form(description="en, or left out: the model hears English")] = None,
            prompt: Annotated[str | None, Form(description="not taken: leave it out")] = None,
            temperature: Annotated[float, Form(description="0 only (greedy, with Whisper's fallback)")] = 0.0,
            timestamp_granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
            include: Annotated[list[str] | None, Form(alias="include[]")] = None,
            stream: Annotated[bool, Form()] = False,
            chunking_strategy: Annotated[str | None, Form()] = None) -> Response:
        """OpenAI's transcription endpoint (multipart form) over the speech front end."""
        if shutdown.draining.is_set():
            raise _stopping()
        if model != asr_model_name(config.asr):
            raise ApiError(404, f"model {model!r} does not transcribe here; send model "
                                f"{asr_model_name(config.asr)!r}, the server's speech model", param="model",
                           code="model_not_found")
        refusal = transcription_refusal(language, prompt, temperature, timestamp_granularities, include, stream,
                                        chunking_strategy)
        if refusal is not None:
            raise refusal
        try:
            heard, = await speech.hear([AudioPart(file.filename or "file", await file.read(), "wav")])
        except AudioError as err:
            raise ApiError(400, err.words(SERVER_WORDS), param="file") from err
        except QueueFull as err:
            raise _too_many(err) from err
        answer = transcription(heard, response_format)
        if isinstance(answer, str):
            return PlainTextResponse(answer)
        return JSONResponse(answer.model_dump())

    return app


@dataclass(frozen=True)
class Output:
    """A piece of one choice's reply text, as the core hands it over."""

    index: int
    text: str
    finished: bool


@dataclass(frozen=True)
class Heard:
    """A request's clips as the engine takes them: the transcripts a text engine reads in their place (``said``), or
    an audio-language engine's clips prepared, each with its transcript ("" where none was heard)."""

    said: dict[AudioPart, str] = field(default_factory=dict)
    clips: dict[AudioPart, tuple[PreparedClip, str]] = field(default_factory=dict)

    def audio_part(self, sent: AudioPart) -> dict:
        """A kept clip as the template takes it: its digest, and its transcript where one was heard (what media
        compaction replaces the answered clip by)."""
        clip, words = self.clips[sent]
        return {"type": "audio", "digest": clip.digest.hex(), **({"transcript": words} if words else {})}


async def _hear(speech: SpeechIn, chat: ChatCompletionRequest, encoder: AudioEncoder | None) -> Heard:
    """The request's spoken parts, worked on in the speech thread: their transcripts, or with an audio-language
    engine's ``encoder`` the clips prepared; ApiError 400 naming the clip where one cannot be taken, or (text engine)
    the message where nothing was heard."""
    sent = [(index, part) for index, message in enumerate(chat.messages) for part in message.clips]
    if not sent:
        return Heard()
    named = [replace(part, name=f"messages[{index}] {part.name}") for index, part in sent]
    try:
        for index, message in enumerate(chat.messages):
            speech.check_count(len(message.clips), f"messages[{index}]")
        if encoder is not None:
            return Heard(clips={part: kept for (_, part), kept in zip(sent, await speech.keep(named, encoder))})
        heard = await speech.hear(named)
    except AudioError as err:
        raise ApiError(400, err.words(SERVER_WORDS), param="messages") from err
    except QueueFull as err:
        raise _too_many(err) from err
    said = {part: transcript.text for (_, part), transcript in zip(sent, heard)}
    for index, message in enumerate(chat.messages):
        if message.clips and not message.images and not message.to_message(heard=said.__getitem__)["content"].strip():
            raise ApiError(400, f"messages[{index}].content: no speech was heard in its audio; send a clip with "
                                "speech, or text", param=f"messages[{index}].content")
    return Heard(said)


def _messages_with_media(engine: Engine, chat: ChatCompletionRequest, images: dict[str, PreparedImage],
                         heard: Heard) -> list[dict]:
    """The request's messages as the template takes them: each picture decoded, checked and prepared into ``images``
    (by digest), each clip as what was ``heard`` in it or as its audio part where the engine keeps it; ApiError 400
    naming the picture where one cannot be taken."""
    sent = [message.images for message in chat.messages]
    said, kept = heard.said.__getitem__, heard.audio_part if heard.clips else None
    if not any(sent):
        return [message.to_message(heard=said, clips=kept) for message in chat.messages]
    vision = engine.vision
    if vision is None:
        raise ApiError(400, "this engine takes no pictures: image_url parts need an engine built from a "
                            "vision-language model (LLaVA, Idefics3 / SmolVLM, Qwen2-VL)", param="messages")
    def digest(index: int) -> Callable[[ImagePart], str]:
        def prepared(part: ImagePart) -> str:
            image = vision.prepare(part.data, f"messages[{index}] {part.name}", part.detail)
            images[image.digest.hex()] = image
            return image.digest.hex()
        return prepared

    try:
        for index, parts in enumerate(sent):
            vision.check_count(len(parts), f"messages[{index}]")
        return [message.to_message(digest(i), said, kept) for i, message in enumerate(chat.messages)]
    except ImageError as err:
        raise ApiError(400, err.words(SERVER_WORDS), param="messages") from err


def _submit(engine: Engine, core: EngineCore, config: ServeConfig, chat: ChatCompletionRequest,
            loop: asyncio.AbstractEventLoop, heard: Heard) -> tuple[list[Request], asyncio.Queue]:
    """Plan the prompt (its spoken parts as ``heard``) and queue its ``n`` choices (one prefill); their outputs
    arrive on the returned queue."""
    capacity = core.capacity_tokens()
    max_tokens = chat.reply_limit or min(config.max_tokens, capacity // 2)  # a small budget keeps room for the prompt
    if max_tokens >= capacity:
        raise ApiError(400, f"max_tokens {max_tokens} leaves no room for the prompt: one conversation holds "
                            f"{capacity} tokens here; ask for fewer", param="max_tokens")
    most = min(config.max_n, core.config.max_sessions)
    if chat.n > most:
        raise ApiError(400, f"n must be at most {most} here (--max-n {config.max_n}, --max-sessions "
                            f"{core.config.max_sessions}), got {chat.n}; ask for fewer choices", param="n")
    images: dict[str, PreparedImage] = {}
    messages = _messages_with_media(engine, chat, images, heard)
    clips = {clip.digest.hex(): clip for clip, _ in heard.clips.values()}
    tools = [tool.to_tool() for tool in chat.tools or []]
    grammars = [_grammar(engine, chat, tools, config.max_tool_calls)  # each choice follows its grammar alone
                for _ in range(chat.n)]
    tokenizer = engine.tokenizer.with_tools(tools)
    tokenizer = tokenizer.with_images(images, engine.vision.placeholder) if images else tokenizer
    tokenizer = tokenizer.with_audio(clips, engine.audio.placeholder) if clips else tokenizer
    try:
        plan = plan_prompt(tokenizer, messages, max_tokens, capacity,
                           core.cache.tokens_per_block, config.overflow, core.cache.config.sink_token_length)
    except CapacityError as err:
        pictures = [(image.name, image.image_tokens) for image in images.values()]
        raise ApiError(400, capacity_error(err, config.overflow, max_tokens, capacity, pictures).words(SERVER_WORDS),
                       param="messages", code="context_length_exceeded") from err
    except ValueError as err:  # the chat template refused the messages
        raise ApiError(400, str(err), param="messages") from err
    outputs: asyncio.Queue = asyncio.Queue()

    def on_output(index: int) -> Callable[[Request, str, bool], None]:
        def put(_request: Request, text: str, finished: bool) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, Output(index, text, finished))
            except RuntimeError:  # the event loop is gone: nobody waits for this output any more
                pass
        return put

    choices = []
    stops = engine.stop_token_ids()
    rows = EncodedRows(engine.audio, clips) if clips else EncodedRows(engine.vision, images) if images else None
    for index, grammar in enumerate(grammars):
        choices.append(Request(plan.feed, chat.to_sampling_params(max_tokens, stops, index), on_output(index),
                               grammar=grammar, logprobs=chat.top_logprobs if chat.logprobs else None,
                               beam=chat.to_beam_params(max_tokens, stops),
                               media=MediaFeed(plan.media, rows) if plan.media else None))
    choices[0].followers = choices[1:]
    problem = core.never_fits(choices[0])
    if problem:
        field = "beam_width" if chat.beam_width > 1 else "n"
        raise ApiError(400, f"{problem}; ask for a smaller {field} or max_tokens", param=field)
    try:
        core.add_request(choices[0])
    except GrammarError as err:  # the shortest reply the grammar allows does not fit the reply's limit
        field = "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"{field} {max_tokens} is too small: {err.words(SERVER_WORDS)}", param=field) from err
    except QueueFull as err:
        raise _too_many(err) from err
    return choices, outputs


def _too_many(err: QueueFull) -> ApiError:
    """The 429 of a full queue, the engine's or the speech thread's."""
    return ApiError(429, f"too many requests: {err.words(SERVER_WORDS)}; retry in {RETRY_AFTER_S} s",
                    kind="rate_limit_error", code="rate_limit_exceeded", retry_after_s=RETRY_AFTER_S)


async def _first_output(choices: list[Request], outputs: asyncio.Queue, http: HttpRequest) -> Output | None:
    """The first output of any choice, or None (every choice cancelled) when the client disconnects first: a
    request left in the queue must not keep its place, nor be prefilled."""
    output = asyncio.ensure_future(outputs.get())
    gone = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait({output, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not output.done():
            output.cancel()
            for choice in choices:
                choice.cancel()
    return output.result() if output.done() and not output.cancelled() else None


async def _disconnect(http: HttpRequest) -> None:
    """Returns when the client disconnects (its body was read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _grammar(engine: Engine, chat: ChatCompletionRequest, tools: list[Tool], max_calls: int) -> GrammarState | None:
    """The grammar the reply follows (``tools``, at most ``max_calls`` calls, ``response_format``, ``guided_regex`` or
    ``guided_choice``); a 400 naming the part it cannot use."""
    if chat.guided_regex is not None:
        return _start(engine, "guided_regex", regex_grammar(chat.guided_regex))
    if chat.guided_choice is not None:
        return _start(engine, "guided_choice", choice_grammar(chat.guided_choice))
    for i, tool in enumerate(tools):
        _start(engine, f"tools[{i}].function.parameters", json_schema_grammar(tool.parameters))
    schema = chat.response_format.schema if chat.response_format else None
    if schema is not None:
        _start(engine, "response_format.json_schema.schema", json_schema_grammar(schema))
    tool_format = engine.tokenizer.tool_format
    grammar = reply_grammar(tool_format, tools, chat.tool_mode, chat.parallel_tool_calls, schema, max_calls)
    return _start(engine, "tools", grammar, tool_format if tools and chat.tool_mode != "none" else None) \
        if grammar else None


def _start(engine: Engine, param: str, grammar: str, tool_format: ToolFormat | None = None) -> GrammarState:
    """A reply's grammar state (``tool_format``: of the calls it writes); the 400 naming ``param`` where the grammar
    cannot be used."""
    try:
        return engine.vocabulary.start(grammar, tool_format)
    except GrammarError as err:
        raise ApiError(400, f"{param} {err.words(SERVER_WORDS)}", param=param) from err


class Reply:
    """How a request's reply reads back: text, or calls of its tools in the model's tool format."""

    def __init__(self, chat: ChatCompletionRequest, engine: Engine) -> None:
        self.tool_format = engine.tokenizer.tool_format if chat.tool_mode != "none" else None

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls the reply completed (None: none)."""
        return self.tool_format.read_calls(text) if self.tool_format else None

    def content(self, text: str) -> str:
        """The reply's content: its text but call markup."""
        return self.tool_format.content(text) if self.tool_format else text

    def finish_reason(self, request: Request, calls: list[ToolCall] | None) -> str:
        """OpenAI's reason: tool_calls for a reply that ended by calling."""
        return "tool_calls" if calls and request.finish_reason == "stop" else request.finish_reason


class ChoiceStream:
    """One choice's part of a stream: text that may begin a call is held back until it is clear; calls are sent
    whole once the reply ends; each content chunk, and the first of the calls, carries the log-probabilities of the
    tokens sampled since the last."""

    def __init__(self, index: int, request: Request, reply: Reply,
                 logprobs: Callable[[list[TokenLogprob]], ChoiceLogprobs] | None) -> None:
        self.index, self.request, self.reply, self.logprobs = index, request, reply, logprobs
        self.content, self.logprobs_sent, self.calls = ContentStream(reply.tool_format), 0, None

    def pieces(self, piece: str) -> list[tuple[ChoiceDelta, ChoiceLogprobs | None]]:
        """The content deltas of a new piece of text."""
        piece = self.content.piece(piece)
        return [(ChoiceDelta(content=piece), self._new_logprobs())] if piece else []

    def ending(self) -> list[tuple[ChoiceDelta, ChoiceLogprobs | None]]:
        """The deltas after the last piece: the calls, or text held back for nothing."""
        text = self.request.text
        self.calls = self.reply.calls(text)
        if self.calls:  # the first delta carries the log-probabilities of the calls' tokens
            return [(delta, None if i else self._new_logprobs()) for i, delta in enumerate(call_deltas(self.calls))]
        rest = self.content.rest(text)
        return [(ChoiceDelta(content=rest), self._new_logprobs())] if rest else []

    def _new_logprobs(self) -> ChoiceLogprobs | None:
        if self.logprobs is None:
            return None
        sent, self.logprobs_sent = self.logprobs_sent, len(self.request.token_logprobs)
        return self.logprobs(self.request.token_logprobs[sent:self.logprobs_sent])


async def _stream(choices: list[Request], outputs: asyncio.Queue, first: Output, request_id: str, model: str,
                  chat: ChatCompletionRequest, reply: Reply, shutdown: Shutdown, engine: Engine) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, each chunk one choice's (``index``); the choices are cancelled
    if the client goes away. A stream the server's stop ends gets an error event instead of the end."""
    logprobs = _logprobs(engine) if choices[0].logprobs is not None else None
    streams = [ChoiceStream(index, choice, reply, logprobs) for index, choice in enumerate(choices)]
    try:
        for stream in streams:
            yield chunk(request_id, model, ChoiceDelta(role="assistant", content=""), index=stream.index)
        output, open_choices = first, len(choices)
        while True:
            stream = streams[output.index]
            for delta, logprobs in stream.pieces(output.text):
                yield chunk(request_id, model, delta, index=stream.index, logprobs=logprobs)
            if output.finished:
                request = stream.request
                if request.finish_reason == "error" or (request.finish_reason == "cancelled"
                                                        and shutdown.stop.is_set()):
                    error = _internal_error(request) if request.finish_reason == "error" else _stopping()
                    yield f"data: {json.dumps(error.body())}\n\n"
                    return
                for delta, logprobs in stream.ending():
                    yield chunk(request_id, model, delta, index=stream.index, logprobs=logprobs)
                yield chunk(request_id, model, ChoiceDelta(), reply.finish_reason(request, stream.calls),
                            index=stream.index)
                open_choices -= 1
                if not open_choices:
                    break
            output = await outputs.get()
        if chat.include_usage:
            yield usage_chunk(request_id, model, _usage(choices))
        yield "data: [DONE]\n\n"
    except Exception as err:  # a fault of ours mid-stream: the client gets an error event, the log one line
        log.error("stream %s failed: %s: %s", request_id, type(err).__name__, err)
        error = ApiError(500, f"the server failed on this stream ({request_id}); it goes on serving, retry the "
                              "request", kind="server_error", code="internal_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        for choice in choices:
            if choice.finish_reason is None:
                choice.cancel()


def _stopping() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on its next start", kind="server_error",
                    code="server_stopping", retry_after_s=RETRY_AFTER_S)


def _internal_error(request: Request) -> ApiError:
    return ApiError(500, f"the model step failed ({request.error}); the server goes on, retry the request",
                    kind="server_error", code="internal_error")


def _usage(choices: list[Request]) -> Usage:
    """The prompt once (one prefill), the tokens of every choice."""
    return usage(len(choices[0].prompt_ids), sum(len(c.token_ids) for c in choices), choices[0].cached_tokens)


def _logprobs(engine: Engine) -> Callable[[list[TokenLogprob]], ChoiceLogprobs]:
    """How a reply's tokens' log-probabilities read in OpenAI's shape on this engine, its stop token left out (it
    is no text)."""
    stops = set(engine.stop_token_ids())
    try:
        token_bytes = engine.vocabulary.token_bytes  # exact, a piece of a character included
    except GrammarError:  # a tokenizer llguidance cannot read: each token's own text
        token_bytes = lambda token: engine.tokenizer.decode([token]).encode("utf-8")  # noqa: E731
    return lambda logprobs: choice_logprobs([lp for lp in logprobs if lp.token not in stops], token_bytes)


def _choice(index: int, request: Request, reply: Reply,
            logprobs: Callable[[list[TokenLogprob]], ChoiceLogprobs] | None) -> Choice:
    """One choice of a whole completion."""
    calls = reply.calls(request.text)
    return Choice(index=index, message=reply_message(reply.content(request.text), calls),
                  finish_reason=reply.finish_reason(request, calls),
                  logprobs=logprobs(request.token_logprobs) if logprobs else None)

