"""OpenAI's chat completion and transcription APIs as this server speaks them: request and response models, error
shape.

The models mirror OpenAI's (``openai.types.chat``); FastAPI validates each request against
ChatCompletionRequest and ``/openapi.json`` describes it. Every field's check words its own problem, so a bad
request gets one 400 in OpenAI's error shape that names the first bad field and what it must be
(``request_error``). JSON null reads as "not given". ``tools`` / ``tool_choice`` and ``response_format`` constrain
the reply by a grammar; ``n`` choices share one prefill; ``logprobs`` / ``top_logprobs`` report each token's
log-probability. A field of the API this server does not act on and that would change the reply
(``logit_bias``, a non-zero penalty, the old ``functions``, ...) is refused unless it has its neutral value;
``user`` and unknown keys are ignored. A user message's ``input_audio`` parts are clips (``AudioPart``) that a text
engine reads as their transcripts and an audio-language engine hears as media; ``/v1/audio/transcriptions``
refuses by name each form field that would change the transcript and is not acted on (``transcription_refusal``).
"""
from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Callable, Literal, get_args

from pydantic import (BaseModel, BeforeValidator, Field, SerializerFunctionWrapHandler, ValidationInfo, field_validator,
                      model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from cabinllm.runtime.generation.beam import BeamParams
from cabinllm.runtime.generation.sampling import MAX_SEED, SamplingParams, TokenLogprob
from cabinllm.runtime.model.tools import NAME_PATTERN, Tool, ToolCall, schema_problem
from cabinllm.runtime.speech.asr import Segment, Transcript

Role = Literal["system", "user", "assistant", "tool"]
ROLES = get_args(Role)
# cancelled: stopped by the server's shutdown or a gone client; tool_calls: the reply is calls
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
TOOL_CHOICES = ("none", "auto", "required")
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_CHOICES = 128  # OpenAI's own limit of n; the server states a lower one (--max-n)
MAX_TOP_LOGPROBS = 20  # as OpenAI's API
MAX_BEAMS = 16  # of beam_width, the schema's bound; the server states a lower one (--max-sessions)
FIELD_ERROR = "cabin_invalid_field"  # the error type of this module's checks, worded for the client


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        """The JSON body."""
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.kind, param=self.param,
                                               code=self.code)).model_dump()

    def headers(self) -> dict[str, str]:
        """Retry-After where the client should retry later."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


class ErrorDetail(BaseModel):
    """What went wrong, OpenAI's way: ``type`` is the kind of error, ``param`` the field at fault."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


# ---------------------------------------------------------------- request checks


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type header names JSON (``application/json`` or ``application/*+json``)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def check_body(body: bytes, max_depth: int, max_messages: int) -> None:
    """Refuse, before FastAPI reads it, a body that is not a JSON object in UTF-8, nests arrays and objects deeper
    than ``max_depth`` or holds more than ``max_messages`` messages (ApiError 400), whatever its Content-Type says."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {err.start}); send UTF-8 JSON") from err
    too_deep = ApiError(400, f"the request body nests arrays and objects deeper than {max_depth} levels "
                             "(--max-json-depth); send a flatter body")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON ({err.msg} at line {err.lineno} column "
                            f"{err.colno}); send a JSON object") from err
    except RecursionError:  # deeper than Python's parser goes
        raise too_deep from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object with 'model' and 'messages'")
    if json_depth(data) > max_depth:
        raise too_deep
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > max_messages:
        raise ApiError(400, f"messages holds {len(messages):,} messages, more than the {max_messages:,} this server "
                            "takes (--max-messages); send the recent turns (the server's overflow policy keeps the "
                            "conversation within its KV budget)", param="messages")


def json_depth(value: Any) -> int:
    """Levels of nested arrays and objects in a parsed JSON value (0 for a scalar)."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (dict, list))]:
        depth += 1
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]
    return depth


def request_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The 400 for the first problem of a request body that FastAPI's validation found (its loc starts "body")."""
    error = errors[0]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"][1:]).lstrip(".")
    problem = error["msg"] if error["type"] == FIELD_ERROR else f"is invalid: {error['msg']}"
    return ApiError(400, f"{param} {problem}" if param else problem, param=param or None)


def _refuse(problem: str) -> PydanticCustomError:
    """A validation error worded for the client; request_error puts the field's name in front."""
    return PydanticCustomError(FIELD_ERROR, "{problem}", {"problem": problem})


def _shown(value: Any) -> str:
    """A client's value as its JSON, cut short."""
    return json.dumps(value)[:40]


_KIND_NAMES = {str: "a string", bool: "true or false", int: "an integer"}


def _of_kind(value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (true and false are no integers here), else the client's error."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _refuse(f"must be {_KIND_NAMES[kind]}, got {_shown(value)}")
    return value


def _kind(kind: type) -> BeforeValidator:
    """A field of this JSON kind, refused in the client's words otherwise."""
    return BeforeValidator(lambda value: _of_kind(value, kind))


def _in_range(value: Any, low: float, high: float) -> float:
    """``value`` if it is a finite JSON number from ``low`` to ``high``, else the client's error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise _refuse(f"must be a number from {low:g} to {high:g}, got {_shown(value)}")
    return float(value)


def _number(low: float, high: float) -> BeforeValidator:
    """A field of finite numbers from ``low`` to ``high``, refused in the client's words otherwise."""
    return BeforeValidator(lambda value: _in_range(value, low, high))


def _top_p(value: Any) -> float:
    top_p = _in_range(value, 0.0, 1.0)
    if top_p == 0:
        raise _refuse("must be > 0 and <= 1, got 0")
    return top_p


def _choices_count(value: Any) -> int:
    if not 1 <= _of_kind(value, int) <= MAX_CHOICES:
        raise _refuse(f"must be an integer from 1 to {MAX_CHOICES}, got {value}")
    return value


def _beam_width(value: Any) -> int:
    if not 1 <= _of_kind(value, int) <= MAX_BEAMS:
        raise _refuse(f"must be an integer from 1 to {MAX_BEAMS}, got {value}")
    return value


def _early_stopping(value: Any) -> bool | str:
    if value not in (True, False, "never") or isinstance(value, (int, float)) and not isinstance(value, bool):
        raise _refuse(f"must be true, false or \"never\", got {_shown(value)}")
    return value


def _top_logprobs(value: Any) -> int:
    if not 0 <= _of_kind(value, int) <= MAX_TOP_LOGPROBS:
        raise _refuse(f"must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {value}")
    return value


def _reply_limit(value: Any) -> int:
    if _of_kind(value, int) < 1:
        raise _refuse(f"must be an integer >= 1, got {value}")
    return value


def _seed(value: Any) -> int:
    if not 0 <= _of_kind(value, int) <= MAX_SEED:
        raise _refuse(f"must be an integer from 0 to {MAX_SEED}, got {value}")
    return value


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise _refuse(f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return stops


def _messages(value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise _refuse("must be a non-empty list of {role, content} objects")
    return value


def _role(value: Any) -> str:
    if value not in ROLES:
        raise _refuse(f"must be one of {', '.join(ROLES)}, got {value!r}")
    return value


IMAGE_DETAILS = ("auto", "low", "high")
DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w=.+-]+)*;base64,(.*)", re.DOTALL)


def _image_part(part: dict, index: int) -> ImagePart:
    """An ``image_url`` part's picture: a data: URL decoded from base64 (this server fetches nothing)."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str):
        raise _refuse(f"part {index}: image_url must be {{\"url\": \"data:image/...;base64,...\"}}")
    detail = image.get("detail", "auto") if isinstance(image, dict) else "auto"
    if detail not in IMAGE_DETAILS:
        raise _refuse(f"part {index}: image_url.detail must be one of {', '.join(IMAGE_DETAILS)}, got {_shown(detail)}")
    found = DATA_URL.fullmatch(url)
    if found is None:
        raise _refuse(f"part {index}: image_url.url must be a data: URL (data:image/png;base64,...); this server "
                      "fetches no remote pictures: send the picture's bytes")
    try:
        data = base64.b64decode(found.group(3), validate=True)
    except binascii.Error as err:
        raise _refuse(f"part {index}: image_url.url holds invalid base64 ({err}); encode the picture again") from err
    return ImagePart(f"picture {index}", data, detail)


AudioFormat = Literal["wav", "mp3"]  # OpenAI's enum of input_audio.format; the server reads wav (server.speech)
AUDIO_FORMATS = get_args(AudioFormat)


def _audio_part(part: dict, index: int) -> AudioPart:
    """An ``input_audio`` part's clip: its bytes decoded from base64 and the format it names."""
    audio = part.get("input_audio")
    if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
        raise _refuse(f"part {index}: input_audio must be {{\"data\": \"<base64>\", \"format\": \"wav\"}}")
    if audio.get("format") not in AUDIO_FORMATS:
        raise _refuse(f"part {index}: input_audio.format must be one of {', '.join(AUDIO_FORMATS)}, got "
                      f"{_shown(audio.get('format'))}")
    try:
        data = base64.b64decode(audio["data"], validate=True)
    except binascii.Error as err:
        raise _refuse(f"part {index}: input_audio.data holds invalid base64 ({err}); encode the clip again") from err
    return AudioPart(f"audio {index}", data, audio["format"])


MEDIA_PARTS = {"image_url": _image_part, "input_audio": _audio_part}


def _text(value: Any) -> str | list:
    """Message content: a string, or a list of {type: text, text} parts joined; with ``image_url`` or
    ``input_audio`` parts, the text, ``ImagePart``s and ``AudioPart``s in order."""
    if isinstance(value, list):
        if not all(isinstance(part, dict) and (part.get("type") == "text" and isinstance(part.get("text"), str)
                                               or str(part.get("type")) in MEDIA_PARTS) for part in value):
            raise _refuse("parts must be {\"type\": \"text\", \"text\": ...}, {\"type\": \"image_url\", "
                          "\"image_url\": {\"url\": ...}} or {\"type\": \"input_audio\", \"input_audio\": "
                          "{\"data\": ..., \"format\": \"wav\"}}")
        if any(part["type"] in MEDIA_PARTS for part in value):
            for part in value:
                if part["type"] == "text":
                    _text(part["text"])
            return [MEDIA_PARTS[part["type"]](part, i) if part["type"] in MEDIA_PARTS else part["text"]
                    for i, part in enumerate(value)]
        value = "".join(part["text"] for part in value)
    if not isinstance(value, str):
        raise _refuse(f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _refuse(f"holds an invalid character (a lone surrogate at {err.start}); send valid UTF-8 "
                      "text") from err
    return value


@dataclass(frozen=True)
class ImagePart:
    """A picture of a message, as sent: its bytes and the detail asked for."""

    name: str
    data: bytes
    detail: str


@dataclass(frozen=True)
class AudioPart:
    """A clip of a message, as sent: its bytes and the format the client named."""

    name: str
    data: bytes
    format: str


class _RequestObject(BaseModel):
    """An object of a request: JSON null reads as "not given"; keys this server does not know are ignored."""

    @classmethod
    def _not_an_object(cls, value: Any) -> str:
        """How a value that is no JSON object is refused."""
        return f"must be an object, got {_shown(value)}"

    @model_validator(mode="before")
    @classmethod
    def _given(cls, data: Any) -> dict:
        """The keys given a value; a required field not given reaches its own check as None."""
        if not isinstance(data, dict):
            raise _refuse(cls._not_an_object(data))
        required = [name for name, info in cls.model_fields.items() if info.is_required()]
        return {**dict.fromkeys(required), **{key: value for key, value in data.items() if value is not None}}


class TextContentPart(BaseModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    """A picture as a data: URL (no remote URLs) and the detail asked for."""

    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ImageContentPart(BaseModel):
    """A picture part of a user message (a vision-language engine only)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(BaseModel):
    """A clip as base64 and its format (wav is read; mp3, in OpenAI's enum, is refused by name)."""

    data: str
    format: AudioFormat


class AudioContentPart(BaseModel):
    """A spoken part of a user message: a text engine reads its transcript in its place, an audio-language engine
    hears the clip."""

    type: Literal["input_audio"]
    input_audio: InputAudio


def _function_name(value: Any) -> str:
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise _refuse(f"must be 1 to 64 letters, digits, _ or -, got {_shown(value)}")
    return value


def _schema(value: Any) -> dict:
    problem = schema_problem(value)
    if problem:
        raise _refuse(problem)
    return value


FunctionName = Annotated[str, BeforeValidator(_function_name)]


class FunctionCall(_RequestObject):
    """A function a reply called: its name and its arguments as JSON text."""

    name: FunctionName
    arguments: Annotated[str, _kind(str)]


class ToolCallMessagePart(_RequestObject):
    """One call of an earlier reply, as the reply gave it."""

    id: Annotated[str, _kind(str)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_RequestObject):
    """One turn of the conversation: a reply (role assistant) may be empty or calls; a tool message answers the
    call ``tool_call_id``."""

    role: Annotated[Role, BeforeValidator(_role)]
    content: Annotated[str | list, BeforeValidator(
        _text, json_schema_input_type=str | list[TextContentPart | ImageContentPart | AudioContentPart])] = Field(
        default="", validate_default=True)
    tool_calls: list[ToolCallMessagePart] | None = None
    tool_call_id: Annotated[str, _kind(str)] | None = Field(default=None, validate_default=True)

    @classmethod
    def _not_an_object(cls, value: Any) -> str:
        return "must be an object with role and content"

    @field_validator("content")
    @classmethod
    def _has_text(cls, content: str | list, info: ValidationInfo) -> str | list:
        if isinstance(content, list):
            if info.data.get("role") != "user":
                raise _refuse("may hold image_url and input_audio parts in user messages only")
            return content
        if info.data.get("role") in ("system", "user", "tool") and not content.strip():
            raise _refuse("is empty; send some text")
        return content

    @property
    def images(self) -> list[ImagePart]:
        """The message's pictures, in order."""
        return [part for part in self.content if isinstance(part, ImagePart)] if isinstance(self.content, list) else []

    @property
    def clips(self) -> list[AudioPart]:
        """The message's clips, in order."""
        return [part for part in self.content if isinstance(part, AudioPart)] if isinstance(self.content, list) else []

    @field_validator("tool_calls")
    @classmethod
    def _from_assistant(cls, calls: list | None, info: ValidationInfo) -> list | None:
        if calls and info.data.get("role") != "assistant":
            raise _refuse("is for assistant messages only")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not call_id:
            raise _refuse("is missing; a tool message names the call it answers")
        return call_id

    def to_message(self, digests: Callable[[ImagePart], str] | None = None,
                   heard: Callable[[AudioPart], str] | None = None,
                   clips: Callable[[AudioPart], dict] | None = None) -> dict:
        """The message as the chat template takes it; its pictures as image parts by ``digests`` (hex), its clips as
        the audio parts ``clips`` gives (an audio-language engine's) or else as the text ``heard`` gives (their
        transcripts) in their place."""
        content = self.content
        if isinstance(content, list):
            if clips is not None and self.clips:
                content = [{"type": "image", "digest": digests(part)} if isinstance(part, ImagePart) else
                           clips(part) if isinstance(part, AudioPart) else {"type": "text", "text": part}
                           for part in content]
            elif not self.images:  # text only: one string, as a text model's template takes it
                content = spoken_text([(heard(part), True) if isinstance(part, AudioPart) else (part, False)
                                       for part in content])
            else:
                content = [{"type": "image", "digest": digests(part)} if isinstance(part, ImagePart) else
                           {"type": "text", "text": heard(part) if isinstance(part, AudioPart) else part}
                           for part in content]
        message: dict = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


def spoken_text(pieces: list[tuple[str, bool]]) -> str:
    """Text parts and transcripts (``(text, is_transcript)``) as one text: text parts joined as they are (as without
    audio), a space between a transcript and a part it would run into."""
    text, last_heard = "", False
    for piece, is_heard in pieces:
        runs_together = text and piece and not text[-1].isspace() and not piece[0].isspace()
        text += (" " if runs_together and (is_heard or last_heard) else "") + piece
        last_heard = is_heard
    return text


class FunctionDefinition(_RequestObject):
    """A function the reply may call; ``parameters`` is the JSON Schema of its arguments (an object)."""

    name: FunctionName
    description: Annotated[str, _kind(str)] = ""
    parameters: Annotated[dict, BeforeValidator(_schema, json_schema_input_type=dict)] = Field(
        default_factory=lambda: {"type": "object", "properties": {}})
    strict: Annotated[bool, _kind(bool)] | None = None


class ToolDefinition(_RequestObject):
    """One tool of ``tools``: a function."""

    type: Literal["function"] = "function"
    function: FunctionDefinition

    def to_tool(self) -> Tool:
        """The runtime's tool."""
        return Tool(self.function.name, self.function.description, self.function.parameters)


class NamedFunction(_RequestObject):
    """The function ``tool_choice`` names."""

    name: FunctionName


class NamedToolChoice(_RequestObject):
    """``tool_choice`` naming one function the reply must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


def _choices(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _refuse("must be a non-empty list of non-empty strings")
    return value


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str) and value not in TOOL_CHOICES:
        raise _refuse(f"must be one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}}, got {_shown(value)}")
    return value


def _format_type(value: Any) -> str:
    if value not in ("text", "json_object", "json_schema"):
        raise _refuse(f"must be text, json_object or json_schema, got {_shown(value)}")
    return value


class JsonSchemaFormat(_RequestObject):
    """The schema a structured reply follows."""

    name: FunctionName
    description: Annotated[str, _kind(str)] = ""
    schema_: Annotated[dict, BeforeValidator(_schema, json_schema_input_type=dict)] = Field(
        default_factory=lambda: {"type": "object"}, alias="schema")
    strict: Annotated[bool, _kind(bool)] | None = None


class ResponseFormat(_RequestObject):
    """The form of the reply: free text, any JSON object, or JSON valid against ``json_schema``."""

    type: Annotated[Literal["text", "json_object", "json_schema"], BeforeValidator(_format_type)]
    json_schema: JsonSchemaFormat | None = Field(default=None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _given_for_json_schema(cls, json_schema: JsonSchemaFormat | None, info: ValidationInfo) \
            -> JsonSchemaFormat | None:
        if info.data.get("type") == "json_schema" and json_schema is None:
            raise _refuse("is missing; type json_schema needs {\"name\": ..., \"schema\": {...}}")
        return json_schema

    @property
    def schema(self) -> dict | None:
        """The JSON Schema the reply must follow (None for free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.type == "json_schema" and self.json_schema else None


class StreamOptions(_RequestObject):
    """Options of a streamed reply."""

    include_usage: Annotated[bool, _kind(bool)] = False


StopString = Annotated[str, Field(min_length=1)]
ReplyLimit = Annotated[int, Field(ge=1), BeforeValidator(_reply_limit)]


def _unapplied(neutral: Callable[[Any], bool], what: str) -> BeforeValidator:
    """A field this server does not act on: refused unless ``neutral(value)``, so no request is silently answered
    as if it had not asked for ``what``."""
    def check(value: Any) -> Any:
        if not neutral(value):
            raise _refuse(f"{_shown(value)} asks for {what}, which this server does not do; leave it out")
        return value

    return BeforeValidator(check, json_schema_input_type=Any)


def _penalty(value: Any) -> float:
    """A penalty is a number from -2 to 2 (OpenAI's range); this server applies none, so only 0 is taken."""
    penalty = _in_range(value, -2.0, 2.0)
    if penalty != 0:
        raise _refuse(f"{_shown(value)} asks for a sampling penalty, which this server does not do; leave it out")
    return penalty


Penalty = Annotated[float, Field(ge=-2, le=2), BeforeValidator(_penalty)]


class ChatCompletionRequest(_RequestObject):
    """A chat completion request: the whole conversation, re-sent every turn, and how to sample the reply.

    The fields are checked in the order they are declared; the first problem is the one answered.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1), BeforeValidator(_messages)]
    model: Annotated[str, _kind(str)] | None = None
    stream: Annotated[bool, _kind(bool)] = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), BeforeValidator(_choices_count)] = 1
    max_completion_tokens: ReplyLimit | None = None
    max_tokens: ReplyLimit | None = None
    temperature: Annotated[float, Field(ge=0, le=2), _number(0.0, 2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1), BeforeValidator(_top_p)] = 1.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED), BeforeValidator(_seed)] | None = None
    stop: Annotated[list[str], BeforeValidator(_stop, json_schema_input_type=StopString | Annotated[
        list[StopString], Field(max_length=MAX_STOP_STRINGS)])] = Field(default_factory=list)
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logprobs: Annotated[bool, _kind(bool)] = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_top_logprobs)] = Field(
        default=0, validate_default=True)
    logit_bias: Annotated[dict, _unapplied(lambda v: v == {}, "biased logits")] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                           BeforeValidator(_tool_choice)] | None = None
    parallel_tool_calls: Annotated[bool, _kind(bool)] = True
    functions: Annotated[list, _unapplied(lambda v: v == [], "the old function calls (send tools)")] | None = None
    function_call: Annotated[str | dict, _unapplied(lambda v: v == "none",
                                                    "the old function calls (send tool_choice)")] | None = None
    response_format: ResponseFormat | None = None
    guided_regex: Annotated[str, _kind(str)] | None = None  # vLLM's extension names
    guided_choice: Annotated[list[str], BeforeValidator(_choices)] | None = None
    # beam search, named as vLLM's and TensorRT-LLM's extensions name it (transformers' generate rules)
    beam_width: Annotated[int, Field(ge=1, le=MAX_BEAMS), BeforeValidator(_beam_width)] = 1
    length_penalty: Annotated[float, Field(ge=-10, le=10), _number(-10.0, 10.0)] = 1.0
    early_stopping: Annotated[bool | Literal["never"], BeforeValidator(_early_stopping)] = False
    user: Annotated[str, _kind(str)] | None = None

    @field_validator("beam_width")
    @classmethod
    def _beams_alone(cls, width: int, info: ValidationInfo) -> int:
        """A beam search's reply is whole and unsampled: no stream, one choice, no grammar, no log-probabilities."""
        data = info.data
        clashes = [("stream", data.get("stream")), ("n", (data.get("n") or 1) > 1), ("logprobs", data.get("logprobs")),
                   ("temperature", data.get("temperature", 1.0) != 1.0), ("top_p", data.get("top_p", 1.0) != 1.0),
                   ("seed", data.get("seed") is not None),
                   ("tools", bool(data.get("tools")) and data.get("tool_choice") != "none"),
                   ("response_format", data.get("response_format") is not None
                    and data["response_format"].type != "text"),
                   ("guided_regex", data.get("guided_regex") is not None),
                   ("guided_choice", data.get("guided_choice") is not None)]
        clash = next((name for name, on in clashes if on), None)
        if width > 1 and clash:
            raise _refuse(f"{width} cannot be combined with {clash}: a beam search's reply is one whole, unsampled "
                          "text; leave one of them out")
        return width
    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int, info: ValidationInfo) -> int:
        if top and not info.data.get("logprobs"):
            raise _refuse("needs logprobs: true")
        return top

    @field_validator("guided_regex", "guided_choice")
    @classmethod
    def _alone(cls, value: Any, info: ValidationInfo) -> Any:
        """A regex or a choice is the whole reply: no tools, no response format, not both."""
        data = info.data
        asked = [name for name, on in (("tools", data.get("tools") and data.get("tool_choice") != "none"),
                                       ("response_format", data.get("response_format") is not None
                                        and data["response_format"].type != "text"),
                                       ("guided_regex", data.get("guided_regex") is not None)) if on]
        if value is not None and asked:
            raise _refuse(f"cannot be combined with {asked[0]}; ask for one form of reply")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        names = [tool.function.name for tool in tools]
        if choice is not None and choice != "none" and not tools:
            raise _refuse("needs tools: send the functions the reply may call")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _refuse(f"names {choice.function.name!r}, which is not one of the tools ({', '.join(names)})")
        return choice

    @property
    def tool_mode(self) -> str:
        """How the reply may call tools: "none", "auto", "required" or the one function's name."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    def to_sampling_params(self, max_tokens: int, stop_token_ids: list[int], index: int = 0) -> SamplingParams:
        """How the engine core samples choice ``index``: seed ``seed + index`` (choices differ, reproducibly)."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=seed,
                              stop_token_ids=stop_token_ids, stop_strings=self.stop)

    def to_beam_params(self, max_tokens: int, stop_token_ids: list[int]) -> BeamParams | None:
        """The beam search the request asks for (None: it samples)."""
        if self.beam_width == 1:
            return None
        return BeamParams(self.beam_width, max_tokens, self.length_penalty, self.early_stopping, tuple(stop_token_ids))

    @property
    def reply_limit(self) -> int | None:
        """The reply's token limit the client asked for (``max_completion_tokens`` before ``max_tokens``)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk of token usage."""
        return self.stream_options is not None and self.stream_options.include_usage


# ---------------------------------------------------------------- responses


class _Sparse(BaseModel):
    """A response object whose fields left None are left out, as OpenAI's stream leaves them out."""

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class PromptTokensDetails(BaseModel):
    """Where the prompt's tokens came from."""

    cached_tokens: int  # served from the prefix cache, not computed again


class Usage(BaseModel):
    """Tokens of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class FunctionCallOut(BaseModel):
    """The function a reply calls and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """One call of the reply."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatCompletionMessage(BaseModel):
    """The reply: text, or calls of tools (content null then)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    """A likely token at a place of the reply: its text, log-probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    """A token of the reply with the likeliest tokens at its place."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """The log-probabilities of a choice's tokens (of the distribution each was sampled from)."""

    content: list[TokenLogprobOut]
    refusal: None = None


def choice_logprobs(logprobs: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> ChoiceLogprobs:
    """OpenAI's shape of tokens' log-probabilities; ``token_bytes`` gives each token's bytes."""
    def top(token: int, logprob: float) -> dict:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return ChoiceLogprobs(content=[TokenLogprobOut(**top(t.token, t.logprob), top_logprobs=[
        TopLogprob(**top(i, lp)) for i, lp in t.top]) for t in logprobs])


class Choice(BaseModel):
    """A choice of a completion."""

    index: int = 0
    message: ChatCompletionMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    """A whole ``chat.completion`` object."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class FunctionCallDelta(_Sparse):
    """What a chunk adds to a call: its name first, then its arguments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    """What a chunk adds to the call ``index``: its id, type and name first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChoiceDelta(_Sparse):
    """What a chunk adds to the reply: the role first, then pieces of content or calls; empty in the last chunk."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    """The choice a chunk adds to."""

    index: int = 0
    delta: ChoiceDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Sparse):
    """One ``chat.completion.chunk`` of a stream; the last, when usage was asked for, has no choice."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """The usage block, cached tokens as OpenAI reports them."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def completion(request_id: str, model: str, choices: list[Choice], usage_block: Usage) -> ChatCompletion:
    """A whole ``chat.completion`` object."""
    return ChatCompletion(id=request_id, created=int(time.time()), model=model, usage=usage_block, choices=choices)


def reply_message(text: str, calls: list[ToolCall] | None) -> ChatCompletionMessage:
    """The reply as text, or as its calls."""
    if not calls:
        return ChatCompletionMessage(content=text)
    return ChatCompletionMessage(content=None, tool_calls=[
        ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments)) for call in calls])


def call_deltas(calls: list[ToolCall]) -> list[ChoiceDelta]:
    """The chunks' deltas of a reply's calls, as OpenAI streams them: per call its id and name, then its
    arguments."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append(ChoiceDelta(tool_calls=[ToolCallDelta(index=index, id=call.id, type="function",
                                                            function=FunctionCallDelta(name=call.name,
                                                                                       arguments=""))]))
        deltas.append(ChoiceDelta(tool_calls=[ToolCallDelta(index=index,
                                                            function=FunctionCallDelta(arguments=call.arguments))]))
    return deltas


def chunk(request_id: str, model: str, delta: ChoiceDelta, finish_reason: FinishReason | None = None, index: int = 0,
          logprobs: ChoiceLogprobs | None = None) -> str:
    """One server-sent event of a streamed ``chat.completion.chunk`` of choice ``index``."""
    return _event(ChatCompletionChunk(id=request_id, created=int(time.time()), model=model, choices=[
        ChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)]))


def usage_chunk(request_id: str, model: str, usage_block: Usage) -> str:
    """The server-sent event of a stream's usage: a chunk with no choice."""
    return _event(ChatCompletionChunk(id=request_id, created=int(time.time()), model=model, choices=[],
                                      usage=usage_block))


def _event(body: ChatCompletionChunk) -> str:
    return f"data: {body.model_dump_json()}\n\n"



# ---------------------------------------------------------------- transcriptions (/v1/audio/transcriptions)


TranscriptionFormat = Literal["json", "text", "verbose_json", "srt", "vtt"]


def transcription_refusal(language: str | None, prompt: str | None, temperature: float,
                          timestamp_granularities: list[str] | None, include: list[str] | None, stream: bool,
                          chunking_strategy: str | None) -> ApiError | None:
    """The 400 for the first form field this server does not act on that would change the transcript (None: all
    neutral): the front end hears English, unprompted, greedy with Whisper's temperature fallback (OpenAI's 0),
    in segments, split where its VAD hears silence, in one answer."""
    refused = [("language", language not in (None, "", "en"), f"{_shown(language)}: this server's speech model "
                "hears English only; send en or leave it out"),
               ("prompt", bool(prompt), "asks for a prompted transcript, which this server does not do; leave it out"),
               ("temperature", temperature != 0, f"{temperature:g} asks for sampled decoding, which this server does "
                "not do; send 0 (greedy, falling back to higher temperatures where decoding fails, as OpenAI's 0) "
                "or leave it out"),
               ("timestamp_granularities[]", any(g != "segment" for g in timestamp_granularities or []),
                f"{_shown(timestamp_granularities)} asks for timings this server does not give; it times "
                "segments only"),
               ("include[]", bool(include), f"{_shown(include)} asks for log-probabilities, which this server does "
                "not give; leave it out"),
               ("stream", stream, "true asks for a streamed transcript, which this server does not do; leave it out"),
               ("chunking_strategy", chunking_strategy not in (None, "", "auto"),
                f"{_shown(chunking_strategy)} asks for chunking this server does not do; it splits where its VAD "
                "hears silence (auto): leave it out")]
    name, _, problem = next((field for field in refused if field[1]), (None, False, ""))
    return ApiError(400, f"{name} {problem}", param=name) if name else None


class TranscriptionUsage(BaseModel):
    """What a transcription cost: seconds of audio."""

    type: Literal["duration"] = "duration"
    seconds: float


class Transcription(BaseModel):
    """A transcript (``response_format`` json)."""

    text: str
    usage: TranscriptionUsage


class TranscriptionSegment(BaseModel):
    """A stretch of speech: seconds from the clip's start, and its words."""

    id: int
    start: float
    end: float
    text: str


class TranscriptionVerbose(BaseModel):
    """A transcript with its segments (``response_format`` verbose_json)."""

    task: Literal["transcribe"] = "transcribe"
    language: str = "english"
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: TranscriptionUsage


def transcription(heard: Transcript, response_format: str) -> Transcription | TranscriptionVerbose | str:
    """The transcript as ``response_format`` asks: an object for the JSON formats, text for the others."""
    usage_block = TranscriptionUsage(seconds=round(heard.audio_s, 3))
    if response_format == "json":
        return Transcription(text=heard.text, usage=usage_block)
    if response_format == "verbose_json":
        return TranscriptionVerbose(duration=round(heard.audio_s, 3), text=heard.text, usage=usage_block, segments=[
            TranscriptionSegment(id=i, start=s.start, end=s.end, text=s.text) for i, s in enumerate(heard.segments)])
    if response_format == "text":
        return heard.text + "\n"
    return subtitles(heard.segments, response_format)


def subtitles(segments: list[Segment], kind: str) -> str:
    """Segments as SubRip (``srt``) or WebVTT (``vtt``) cues."""
    def stamp(seconds: float) -> str:
        ms = round(seconds * 1000)
        clock = f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}"
        return f"{clock},{ms % 1000:03d}" if kind == "srt" else f"{clock}.{ms % 1000:03d}"

    cues = [f"{stamp(s.start)} --> {stamp(s.end)}\n{s.text}\n" for s in segments]
    if kind == "srt":
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)
