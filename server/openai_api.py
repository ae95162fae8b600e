"""OpenAI's chat completion API as this server speaks it: request checks, response shapes, error shape.

Requests are checked here field by field, so a bad one gets one 400 that names the field and what it
must be. Fields of the API this server does not act on are accepted and ignored when their value is
of the right kind (``frequency_penalty``, ``user``, ...); ``n`` must be 1.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from cabinllm.runtime.generation.sampling import MAX_SEED

ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4  # as OpenAI's API


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Retry-After where the client should retry later."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


@dataclass
class ChatRequest:
    """A checked chat completion request."""

    messages: list[dict]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


def parse_chat_request(body: bytes) -> ChatRequest:
    """Check a request body; ApiError 400 naming the first problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {err.start}); send UTF-8 JSON") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON ({err.msg} at line {err.lineno} column "
                            f"{err.colno}); send a JSON object") from err
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object with 'model' and 'messages'")
    request = ChatRequest(messages=_messages(data.get("messages")))
    request.model = _typed(data, "model", str)
    request.stream = bool(_typed(data, "stream", bool, False))
    options = _typed(data, "stream_options", dict, {}) or {}
    request.include_usage = bool(_typed(options, "include_usage", bool, False, "stream_options."))
    n = _typed(data, "n", int, 1)
    if n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {n}", param="n")
    limits = [(name, _typed(data, name, int)) for name in ("max_completion_tokens", "max_tokens")]
    for name, value in limits:
        if value is not None and value < 1:
            raise ApiError(400, f"{name} must be an integer >= 1, got {value}", param=name)
    request.max_tokens = next((value for _, value in limits if value is not None), None)
    request.temperature = _number(data, "temperature", 0.0, 2.0, 1.0)
    request.top_p = _number(data, "top_p", 0.0, 1.0, 1.0)
    if request.top_p == 0:
        raise ApiError(400, "top_p must be > 0 and <= 1, got 0", param="top_p")
    request.seed = _typed(data, "seed", int)
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise ApiError(400, f"seed must be an integer from 0 to {MAX_SEED}, got {request.seed}", param="seed")
    request.stop = _stop(data.get("stop"))
    for name in ("frequency_penalty", "presence_penalty"):
        _number(data, name, -2.0, 2.0, 0.0)
    _typed(data, "user", str)
    return request


def _messages(value: object) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with role and content", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        content = _content(message.get("content"), f"{where}.content", allow_empty=role == "assistant")
        messages.append({"role": role, "content": content})
    return messages


def _content(value: object, where: str, allow_empty: bool) -> str:
    """Message text: a string, or a list of {type: text, text} parts joined (a reply may be empty)."""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where} parts must be {{\"type\": \"text\", \"text\": ...}}; this server takes "
                                    "text only", param=where)
            parts.append(part["text"])
        value = "".join(parts)
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a string, got {type(value).__name__}", param=where)
    if not value.strip() and not allow_empty:
        raise ApiError(400, f"{where} is empty; send some text", param=where)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{where} holds an invalid character (a lone surrogate at {err.start}); send valid "
                            "UTF-8 text", param=where) from err
    return value


def _typed(data: dict, name: str, kind: type, default: object = None, prefix: str = ""):
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(400, f"{prefix}{name} must be {_KIND_NAMES[kind]}, got {json.dumps(value)[:40]}",
                       param=prefix + name)
    return value


_KIND_NAMES = {str: "a string", bool: "true or false", int: "an integer", dict: "an object"}


def _number(data: dict, name: str, low: float, high: float, default: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}, got {json.dumps(value)[:40]}",
                       param=name)
    return float(value)


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                       param="stop")
    return stops


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The usage block, cached tokens as OpenAI reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(request_id: str, model: str, text: str, finish_reason: str, usage_block: dict) -> dict:
    """A whole ``chat.completion`` object."""
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage_block}


def chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None,
          usage_block: dict | None = None) -> str:
    """One server-sent event of a streamed ``chat.completion.chunk`` (no choice when it carries usage)."""
    choices = [] if usage_block else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    body = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices}
    if usage_block:
        body["usage"] = usage_block
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
