"""The engine's tokenizer and chat template, read from ``tokenizer.json`` and ``tokenizer_config.json``.

Message content is always text: before the template renders a message, every control-token string
in its content (``<|im_start|>``, ``<|endoftext|>``, ... : the tokenizer's special tokens) is broken
by a zero-width space after its first character, so it is tokenized as text. Only the template's own
structure produces control tokens, so a user cannot forge a system or assistant turn.

A vision-language engine's view (``with_images``) renders image parts of a message where the template puts its
placeholder, as a marker naming the picture's digest; ``encode`` writes each marker as the picture's own tokens
(its processor's expansion), and ``encode_media`` also says where each picture's tokens are. An audio-language
engine's view (``with_audio``) does the same for audio parts and clips.

The template runs as transformers runs it (``tojson`` keeps key order and non-ASCII text, ``strftime_now``):
transformers' ``utils/chat_template_utils.py`` ``_compile_jinja_template``. ``with_tools`` gives a view that
renders the tools a reply may call (cabinllm.runtime.model.tools).
"""
from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from pathlib import Path

from cabinllm.runtime.errors import CheckpointError, ConfigError
from cabinllm.runtime.kv.blocks import MediaSpan
from cabinllm.runtime.model.tools import HERMES, Tool, ToolFormat, for_template, in_our_words, template_tool_format

CONTENT_ESCAPE = "\u200b"  # zero-width space, put inside control-token strings found in message content
IMAGE_OPEN, IMAGE_CLOSE = "\ue000", "\ue001"  # private-use characters around a medium's digest in a prompt
# a picture's digest (16 bytes) or a clip's (Clip.digest: 32)
_IMAGE_MARKER = re.compile(f"{IMAGE_OPEN}([0-9a-f]{{32}}(?:[0-9a-f]{{32}})?){IMAGE_CLOSE}")


def image_marker(digest: bytes) -> str:
    """How a rendered prompt names a picture or clip (``with_images``, ``with_audio`` write its tokens in its
    place)."""
    return f"{IMAGE_OPEN}{digest.hex()}{IMAGE_CLOSE}"


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
        # digest hex -> a PreparedImage (cabinllm.runtime.model.vision) or PreparedClip (cabinllm.runtime.model.audio)
        self.images: dict[str, object] = {}
        self.placeholders: dict[str, str] = {}  # a part's type ("image", "audio") -> what the template writes for it

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in the text are recognised, image markers written as the
        pictures' tokens."""
        return self.encode_media(text)[0]

    def encode_media(self, text: str) -> tuple[list[int], list[MediaSpan]]:
        """Token ids of text and where each picture's (or clip's) tokens are among them (positions from 0)."""
        pieces = _IMAGE_MARKER.split(text) if IMAGE_OPEN in text else [text]
        ids, spans = self._tok.encode(pieces[0], add_special_tokens=False).ids, []
        for digest, after in zip(pieces[1::2], pieces[2::2]):
            image = self.images.get(digest)
            if image is None:
                raise ConfigError(f"the prompt names picture or clip {digest[:12]}, which this conversation does not "
                                  "hold; send it again")
            spans.append(MediaSpan(len(ids), len(image.token_ids), bytes.fromhex(digest), image.grid))
            ids += image.token_ids + self._tok.encode(after, add_special_tokens=False).ids
        return ids, spans

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a whole rendered conversation: BOS first where the model wants it, once (Gemma's and Llama
        3's templates write it themselves)."""
        return self.encode_prompt_media(text)[0]

    def encode_prompt_media(self, text: str) -> tuple[list[int], list[MediaSpan]]:
        """``encode_prompt``'s ids and where each picture's tokens are among them."""
        ids, media = self.encode_media(text)
        if not (self.add_bos_token and self.bos_token) or ids[:1] == [self.token_id(self.bos_token)]:
            return ids, media
        return [self.token_id(self.bos_token)] + ids, [span.shifted(1) for span in media]

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

    def with_images(self, images: dict[str, object], placeholder: str) -> "ChatTokenizer":
        """A view that renders a message's image parts (``{"type": "image", "digest": hex}``) as the pictures
        ``images`` holds by digest, where the template writes ``placeholder``."""
        return self._with_media("image", images, placeholder)

    def with_audio(self, clips: dict[str, object], placeholder: str) -> "ChatTokenizer":
        """A view that renders a message's audio parts (``{"type": "audio", "digest": hex}``) as the clips ``clips``
        holds by digest (PreparedClip), where the template writes ``placeholder``."""
        return self._with_media("audio", clips, placeholder)

    def _with_media(self, kind: str, items: dict[str, object], placeholder: str) -> "ChatTokenizer":
        view = copy.copy(self)
        view.images, view.placeholders = {**self.images, **items}, {**self.placeholders, kind: placeholder}
        view._control_strings = sorted({*self._control_strings, IMAGE_OPEN}, key=len, reverse=True)
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
        messages = [{**m, "content": self._escape_content(m["content"])} for m in messages]
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token, **extra)
        for kind in ("image", "audio"):
            text = self._media_markers(text, messages, kind)
        return text

    def _media_markers(self, text: str, messages: list[dict], kind: str) -> str:
        """The rendered text with the placeholder of each part of ``kind`` replaced by its marker, in order."""
        noun = {"image": "pictures", "audio": "audio clips"}[kind]
        digests = [part["digest"] for m in messages if isinstance(m["content"], list) for part in m["content"]
                   if part.get("type") == kind]
        if not digests:
            return text
        placeholder = self.placeholders.get(kind)
        if placeholder is None or text.count(placeholder) != len(digests):
            engine = "a vision-language" if kind == "image" else "an audio-language"
            raise ConfigError(f"the messages hold {len(digests)} {noun} and the chat template wrote "
                              f"{text.count(placeholder) if placeholder else 0} {kind} placeholders; send {noun} to "
                              f"{engine} engine only")
        pieces = text.split(placeholder)
        return pieces[0] + "".join(image_marker(bytes.fromhex(d)) + p for d, p in zip(digests, pieces[1:]))

    def frame_tokens(self, messages: list[dict], prompt: str) -> tuple[int, int]:
        """Tokens of the conversation's system prompt (0 without one) and of its last message with its template
        headers, as ``prompt`` (the whole rendering) holds them: what every overflow policy keeps."""
        system = 0
        if messages and messages[0]["role"] == "system":
            system = len(self.encode_prompt(self.render(messages[:1], add_generation_prompt=False)))
        return system, len(self.encode(prompt[len(self.render(messages[:-1], add_generation_prompt=False)):]))

    def _escape_content(self, content: str | list[dict]) -> str | list[dict]:
        """Message content with its text escaped: a string, or parts of which the text ones are."""
        if isinstance(content, str):
            return self.escape(content)
        return [{**part, "text": self.escape(part["text"])} if part.get("type") == "text" else part
                for part in content]


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Jinja's ``tojson`` as transformers defines it for chat templates (no HTML escaping, key order kept)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise ConfigError(f"chat template refused the messages: {message}")
