"""The engine's tokenizer and chat template, read from ``tokenizer.json`` and ``tokenizer_config.json``.

Message content is always text: before the template renders a message, every control-token string
in its content (``<|im_start|>``, ``<|endoftext|>``, ... : the tokenizer's special tokens) is broken
by a zero-width space after its first character, so it is tokenized as text. Only the template's own
structure produces control tokens, so a user cannot forge a system or assistant turn.

The template runs as transformers runs it (``tojson`` keeps key order and non-ASCII text, ``strftime_now``):
transformers' ``utils/chat_template_utils.py`` ``_compile_jinja_template``. ``with_tools`` gives a view that
renders the tools a reply may call (cabinllm.runtime.model.tools).
"""
from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path

from cabinllm.runtime.errors import CheckpointError, ConfigError
from cabinllm.runtime.model.tools import HERMES, Tool, ToolFormat, for_template, in_our_words, template_tool_format

CONTENT_ESCAPE = "\u200b"  # zero-width space, put inside control-token strings found in message content


class ChatTokenizer:
    """Encodes text, decodes ids and renders chat messages with the model's own template."""

    def __init__(self, folder: str | Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        folder = Path(folder)
        tok_path, cfg_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
        try:
            self._tok = Tokenizer.from_file(str(tok_path))
        except Exception as err:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{tok_path}: unreadable tokenizer ({err}); rebuild the engine") from err
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            template = cfg["chat_template"]
        except (OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"{cfg_path}: unreadable or without chat_template ({err}); rebuild the engine") from err
        self.bos_token: str | None = cfg.get("bos_token")
        self.eos_token: str = cfg.get("eos_token", "")
        self.add_bos_token: bool = bool(cfg.get("add_bos_token", False))
        self.stop_token_ids: list[int] = list(cfg.get("stop_token_ids", []))
        special = {token.content for token in self._tok.get_added_tokens_decoder().values() if token.special}
        self._control_strings = sorted(special | {t for t in (self.bos_token, self.eos_token) if t}, key=len,
                                       reverse=True)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template)
        self._native_tools = template_tool_format(template)
        self.tools: list[Tool] = []

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in the text are recognised."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a whole rendered conversation: BOS first where the model wants it, once (Gemma's and Llama
        3's templates write it themselves)."""
        ids = self.encode(text)
        if not (self.add_bos_token and self.bos_token) or ids[:1] == [self.token_id(self.bos_token)]:
            return ids
        return [self.token_id(self.bos_token)] + ids

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens included."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def decode_reply(self, ids: list[int]) -> str:
        """Text of generated ids without special tokens."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        """Id of a token string, or None."""
        return self._tok.token_to_id(token)

    def escape(self, text: str) -> str:
        """Text in which no control-token string is left whole, so that it encodes as text."""
        for control in self._control_strings:
            while control in text:  # a self-overlapping string may reappear once: repeat until none is left
                text = text.replace(control, control[0] + CONTENT_ESCAPE + control[1:])
        return text

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` holds it."""
        return self._tok.to_str()

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls: its template's format, else ours (``hermes``)."""
        return self._native_tools or HERMES

    def with_tools(self, tools: list[Tool]) -> "ChatTokenizer":
        """A view of this tokenizer whose renderings show ``tools`` to the model."""
        view = copy.copy(self)
        view.tools = list(tools)
        return view

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, as the model was trained to see it; message content escaped.
        Messages may hold tool calls and results in OpenAI's form."""
        extra = {}
        if self._native_tools:
            messages = for_template(messages)
            if self.tools:
                extra["tools"] = [tool.to_openai() for tool in self.tools]
        else:
            messages = in_our_words(messages, self.tools)
        messages = [{**m, "content": self.escape(m["content"])} for m in messages]
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token, **extra)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja's ``tojson`` as transformers defines it for chat templates (no HTML escaping, key order kept)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise ConfigError(f"chat template refused the messages: {message}")
