"""Tools a reply may call: their definitions, how a model family writes a call (``ToolFormat``), and the
messages of a conversation with calls in the form a chat template renders.

A chat template that renders ``tools`` itself gets them and the messages as OpenAI sends them (Qwen2.5 writes
calls as ``<tool_call>`` JSON, the ``hermes`` format; Llama 3.1 as bare JSON with ``parameters``,
``llama3-json``). A template without tools (the default SmolLM2) gets the ``hermes`` format in our words:
``data/tool_prompt.txt`` (Qwen2.5's tool prompt) appended to the system message, each call written into the
assistant's content, each result sent as a user message in ``<tool_response>`` tags, as Qwen2.5 renders it.
"""
from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jsonschema

from cabinllm.runtime.errors import GrammarError

TOOL_PROMPT = (Path(__file__).parent / "data" / "tool_prompt.txt").read_text(encoding="utf-8").strip()
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class Tool:
    """A function the reply may call: its name, what it does and the JSON Schema of its arguments."""

    name: str
    description: str
    parameters: dict

    @classmethod
    def from_openai(cls, definition: object, where: str = "tool") -> "Tool":
        """A tool from OpenAI's ``{"type": "function", "function": {...}}``; GrammarError naming the part at fault
        (``where`` is how the caller calls the definition, e.g. ``tools[2]``)."""
        if not isinstance(definition, dict) or definition.get("type", "function") != "function" \
                or not isinstance(definition.get("function"), dict):
            raise GrammarError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        function = definition["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise GrammarError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got "
                               f"{json.dumps(name)[:40]}")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise GrammarError(f"{where}.function.description must be a string")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        problem = schema_problem(parameters)
        if problem:
            raise GrammarError(f"{where}.function.parameters {problem}")
        return cls(name, description, parameters)

    def to_openai(self) -> dict:
        """OpenAI's form, as chat templates take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """One call a reply made: its id, the function's name and the arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """OpenAI's form of a call in a message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes calls: each call's text around its JSON, and what lies between calls."""

    name: str
    before: str  # the call's text up to the function's name
    between: str  # from the name to the arguments
    after: str  # after the arguments
    separator: str  # between two calls
    parallel: bool  # whether the family writes several calls in one reply

    def call_text(self, name: str, arguments: str) -> str:
        """The text of one call (``arguments`` is JSON text)."""
        return f"{self.before}{json.dumps(name)}{self.between}{arguments}{self.after}"

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """The calls a reply's text completed, as (name, arguments JSON text); None when it completed none. A reply
        cut inside a call (by its token limit, a stop string, the budget) keeps the calls before it."""
        return [(name, arguments) for name, arguments, _ in self._scan(text)] or None

    @property
    def opener(self) -> str:
        """What every reply with calls starts with."""
        return self.before

    def read_calls(self, text: str) -> list[ToolCall] | None:
        """The calls a reply completed, each with a fresh id; None when it completed none."""
        calls = self.parse(text)
        return [ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments) for name, arguments in calls] \
            if calls else None

    def content(self, text: str) -> str:
        """What of a reply's text is content, not call markup: all of it, unless it begins a call (or is cut inside
        the opener), which is no content even where the call was cut; JSON that holds no call stays content."""
        if self.begins_call(text) is False or (not self._scan(text) and _is_json(text)):
            return text
        return ""

    def begins_call(self, text: str) -> bool | None:
        """Whether a reply beginning with ``text`` is calls (None: cannot tell yet, it may still become the
        opener)."""
        if text.startswith(self.opener):
            return True
        return None if self.opener.startswith(text) else False

    def repeats_a_call(self, text: str) -> int | None:
        """Where a reply's calls end before the first call identical (name and arguments) to one before it, or None
        where no call repeats."""
        seen, end = [], 0
        for name, arguments, after in self._scan(text):
            call = (name, json.loads(arguments))
            if call in seen:
                return end
            seen.append(call)
            end = after
        return None

    def _scan(self, text: str) -> list[tuple[str, str, int]]:
        """The whole calls at the start of ``text``: (name, arguments JSON text, where the call's text ends)."""
        calls: list[tuple[str, str, int]] = []
        at = 0
        while text.startswith(self.before, at) and (not calls or self.parallel):
            try:
                name, at = _JSON.raw_decode(text, at + len(self.before))
                if not isinstance(name, str) or not text.startswith(self.between, at):
                    break
                arguments, at = _JSON.raw_decode(text, at + len(self.between))
            except json.JSONDecodeError:
                break
            if not text.startswith(self.after, at):
                break
            at += len(self.after)
            calls.append((name, json.dumps(arguments, ensure_ascii=False), at))
            if not text.startswith(self.separator, at):
                break
            at += len(self.separator)
        return calls


    def name_probabilities(self, pieces: Sequence[bytes], logprobs: Sequence[float],
                           names: Sequence[str]) -> list[float]:
        """The probability the reply gave each call's function name (``names``, in the order of its calls): the
        product of the probabilities of the tokens that write the name's JSON string, quotes included, given the
        text before it. ``pieces`` are the reply's tokens as bytes and ``logprobs`` their log-probabilities (as
        OpenAI's ``logprobs.content`` lists them: ``bytes`` and ``logprob``). It is the probability of the
        tokens written: another tokenization of the same name, which a model rarely weighs, is not added."""
        starts, offset = [], 0
        for piece in pieces:
            starts.append(offset)
            offset += len(piece)
        text, found, out = b"".join(pieces), 0, []
        for name in names:
            quoted = json.dumps(name).encode("utf-8")
            begin = text.find(quoted + self.between.encode("utf-8"), found)
            if begin < 0:
                raise GrammarError(f"the reply's tokens write no call of {name}")
            found = begin + len(quoted)
            out.append(math.exp(sum(lp for start, piece, lp in zip(starts, pieces, logprobs)
                                    if start < found and start + len(piece) > begin)))
        return out

class ContentStream:
    """The content of a reply as it streams (``ToolFormat.content``): text that may still begin a call is held back
    until it is clear, and a reply that calls shows none. Without a format (no calls allowed) all text is content."""

    def __init__(self, tool_format: ToolFormat | None) -> None:
        self.tool_format = tool_format
        self.held, self.is_call = "", None if tool_format else False

    def piece(self, text: str) -> str:
        """What of a new piece of the reply is content to show now."""
        if self.is_call is None:
            self.held += text
            self.is_call = self.tool_format.begins_call(self.held) if self.held else None
            text = self.held if self.is_call is False else ""
        return "" if self.is_call else text

    def rest(self, text: str) -> str:
        """The content held back that the whole reply, ``text``, shows after all."""
        return self.tool_format.content(text) if self.tool_format and self.is_call is not False else ""


HERMES = ToolFormat("hermes", '<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "\n", parallel=True)
LLAMA3_JSON = ToolFormat("llama3-json", '{"name": ', ', "parameters": ', "}", "", parallel=False)


def read_tools(path: str | Path) -> list[Tool]:
    """The tools of a JSON file holding a list of OpenAI tool definitions; GrammarError naming the file and the
    part at fault."""
    path = Path(path)
    try:
        definitions = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise GrammarError(f"{path}: cannot read ({err.strerror})") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GrammarError(f"{path}: not a JSON file ({err}); write a list of tool definitions") from err
    if not isinstance(definitions, list) or not definitions:
        raise GrammarError(f"{path}: must hold a non-empty list of tool definitions "
                           "([{\"type\": \"function\", \"function\": {\"name\": ...}}])")
    tools = [Tool.from_openai(definition, f"{path}: [{i}]") for i, definition in enumerate(definitions)]
    names = [tool.name for tool in tools]
    if len(set(names)) < len(names):
        raise GrammarError(f"{path}: two tools share a name; names: {', '.join(names)}")
    return tools


def schema_problem(schema: object) -> str | None:
    """What makes ``schema`` no usable JSON Schema (None: it is one)."""
    if not isinstance(schema, dict):
        return f"must be a JSON Schema (an object), got {json.dumps(schema)[:40]}"
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(part) for part in err.path)
        return f"is not a valid JSON Schema ({err.message}{f' at {where}' if where else ''})"
    return None


def template_tool_format(template: str) -> ToolFormat | None:
    """The format a chat template renders tools in, or None where it renders none (ours is used then)."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if '"parameters"' in template:
        return LLAMA3_JSON
    return None


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as a template with tools renders them: each call's arguments as an object (``tojson`` writes it
    again), other messages as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            calls = [{**call, "function": {**call["function"], "arguments": _as_object(call["function"]["arguments"])}}
                     for call in calls]
            message = {**message, "content": message.get("content") or "", "tool_calls": calls}
        out.append(message)
    return out


def in_our_words(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """Messages for a template without tools, in the ``hermes`` format: the tool prompt in the system message,
    calls in the assistant's content, results as user messages."""
    listing = "\n".join(json.dumps(tool.to_openai(), ensure_ascii=False) for tool in tools)
    out: list[dict] = []
    if tools:
        prompt = TOOL_PROMPT.replace("{tools}", listing)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = HERMES.separator.join(HERMES.call_text(c["function"]["name"], c["function"]["arguments"])
                                          for c in message["tool_calls"])
            content = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


def _is_json(text: str) -> bool:
    """Whether ``text`` is one JSON document."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _as_object(arguments: object) -> object:
    """Arguments JSON text as the object it holds (text that holds none stays text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
