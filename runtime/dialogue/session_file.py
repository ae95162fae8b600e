"""The session file: the K/V of a dialogue's tokens and a JSON header, in one safetensors file.

K/V are kept in their stored form (int8 codes stay int8); the header holds the conversation
and the fingerprints of the model and of the static KV scales, and a SHA-256 of header and K/V.
The write is atomic: a crash mid-save leaves the previous save in place. The read refuses, with
one SessionFileError naming the file and the problem, a file cut short, a file changed after it
was saved (the checksum), and a header with a field missing, unknown, of the wrong type or out of
range. ``cabinllm.runtime.dialogue.session`` decides what goes in and checks what comes out against its engine.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from cabinllm.runtime.dialogue.overflow import OverflowPolicy
from cabinllm.runtime.errors import ConfigError, Fix, GrammarError, Hint, SessionFileError
from cabinllm.runtime.formats.atomic import atomic_write_bytes
from cabinllm.runtime.generation.sampling import SamplingParams
from cabinllm.runtime.kv.cache import KvCacheConfig
from cabinllm.runtime.kv.memory import available_memory
from cabinllm.runtime.kv.modes import KV_MODES, kv_mode_name
from cabinllm.runtime.kv.window import WINDOW
from cabinllm.runtime.model.tools import Tool

SESSION_FORMAT = "cabin-session/3"  # 2: the KV cache config as one object; 3: a checksum, a checked header
CHECKSUM_FIELD = "sha256"
SESSION_KV_MODES = tuple(name for name, mode in KV_MODES.items() if mode.per_token and mode.reference)

Rule = tuple[str, Callable[[object], bool]]  # what a value must be, and the test
Spec = dict[str, Union[Rule, "Spec"]]        # a JSON object's fields: a rule each, or a nested object


def _count(value: object, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _int(value: object) -> bool:
    return type(value) is int


def _number(value: object) -> bool:
    return type(value) is float and math.isfinite(value) or type(value) is int and abs(value) <= 2**53


def _ids(value: object) -> bool:
    return type(value) is list and all(_count(i) for i in value)


def _content(value: object) -> bool:
    """A message's content: text, or parts of text, pictures and audio clips (by digest; a clip's transcript where
    it is known)."""
    return isinstance(value, str) or type(value) is list and all(
        type(p) is dict and (p.keys() == {"type", "text"} and p["type"] == "text" and isinstance(p["text"], str)
                             or p.keys() == {"type", "digest"} and p["type"] == "image" and _digest(p["digest"])
                             or {"type", "digest"} <= p.keys() <= {"type", "digest", "transcript"}
                             and p["type"] == "audio" and _digest(p["digest"])
                             and isinstance(p.get("transcript", ""), str))
        for p in value)


def _digest(value: object) -> bool:
    """A picture's digest (16 bytes) or a clip's (32), in hex."""
    return isinstance(value, str) and len(value) in (32, 64) and all(c in "0123456789abcdef" for c in value)


def _messages(value: object) -> bool:
    return type(value) is list and all(type(m) is dict and {"role", "content"} <= m.keys() <= MESSAGE_KEYS
                                       and m["role"] in ("system", "user", "assistant", "tool")
                                       and _content(m["content"])
                                       and type(m.get("tool_calls", [])) is list for m in value)


def _images(value: object) -> bool:
    return type(value) is dict and all(
        _digest(d) and type(i) is dict and i.keys() == {"token_ids", "offsets", "grid", "size"}
        and _ids(i["token_ids"]) and _ids(i["offsets"]) and all(o < len(i["token_ids"]) for o in i["offsets"])
        and (i["grid"] is None or _ids(i["grid"]) and len(i["grid"]) == 3) and _ids(i["size"]) and len(i["size"]) == 2
        for d, i in value.items())


def _clips(value: object) -> bool:
    return type(value) is dict and all(
        _digest(d) and type(c) is dict and c.keys() == {"token_ids", "offsets", "seconds"}
        and _ids(c["token_ids"]) and _ids(c["offsets"]) and all(o < len(c["token_ids"]) for o in c["offsets"])
        and _number(c["seconds"]) and c["seconds"] >= 0 for d, c in value.items())


def _media(value: object) -> bool:
    return type(value) is list and all(
        type(m) is list and len(m) == 4 and _count(m[0]) and _count(m[1], 1) and _digest(m[2])
        and (m[3] is None or _ids(m[3]) and len(m[3]) == 3) for m in value)


def _tools(value: object) -> bool:
    try:
        return type(value) is list and all(Tool.from_openai(tool) for tool in value)
    except GrammarError:
        return False


MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id"}
OPTIONAL = {"tools": [], "tool_choice": "auto", "images": {}, "image_names": {}, "clips": {},
            "media": []}  # fields older files may lack


STRING: Rule = ("a string", lambda v: isinstance(v, str))
FINGERPRINT: Rule = ("a non-empty string", lambda v: isinstance(v, str) and v != "")
INTEGER: Rule = ("an integer", _int)
NUMBER: Rule = ("a finite number", _number)
HEADER: Spec = {  # the types; the ranges of kv_cache, overflow and params are their classes' own checks
    "format": STRING,
    CHECKSUM_FIELD: STRING,
    "model_fingerprint": FINGERPRINT,
    "scales_fingerprint": FINGERPRINT,
    "kv_cache": {
        "kv_mode": (f"one of {', '.join(SESSION_KV_MODES)}",
                    lambda v: isinstance(v, str) and kv_mode_name(v) in SESSION_KV_MODES),
        "max_bytes": INTEGER,
        "tokens_per_block": INTEGER,
        "enable_block_reuse": ("true or false", lambda v: type(v) is bool),
        "sink_token_length": INTEGER,
    },
    "system_prompt": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "messages": ("a list of {role: system|user|assistant|tool, content: string or parts} objects", _messages),
    "fed": ("a list of token ids", _ids),
    "pending": ("a list of at most one token id", lambda v: _ids(v) and len(v) <= 1),
    "transcript": STRING,
    "turns": ("an integer >= 0", _count),
    "overflow": {"name": STRING, "keep_fraction": NUMBER,
                 "compact_media": ("true or false", lambda v: type(v) is bool)},
    "params": {
        "max_new_tokens": INTEGER,
        "temperature": NUMBER,
        "top_k": INTEGER,
        "top_p": NUMBER,
        "seed": ("an integer or null", lambda v: v is None or _int(v)),
        "stop_token_ids": ("a list of token ids", _ids),
        "stop_strings": ("a list of strings", lambda v: type(v) is list and all(isinstance(s, str) for s in v)),
    },
    "tools": ("a list of OpenAI tool definitions", _tools),
    "tool_choice": STRING,
    "images": ("an object of pictures by digest: {token_ids, offsets, grid, size}", _images),
    "image_names": ("an object of picture names by digest",
                    lambda v: type(v) is dict and all(_digest(d) and isinstance(n, str) for d, n in v.items())),
    "clips": ("an object of audio clips by digest: {token_ids, offsets, seconds}", _clips),
    "media": ("a list of [start, length, digest, grid] picture and clip spans", _media),
}
CLASSES = {"kv_cache": KvCacheConfig, "overflow": OverflowPolicy, "params": SamplingParams}


def write_session_file(path: str | Path, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write a header and tensors to path atomically, sealed with their checksum."""
    header = {"format": SESSION_FORMAT, **header}
    header[CHECKSUM_FIELD] = payload_sha256(header, tensors)
    atomic_write_bytes(Path(path), save(tensors, metadata={"session": json.dumps(header, ensure_ascii=False)}))


def read_session_file(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of a session file; SessionFileError when it is cut short, of another format,
    changed since it was saved, or its header is not one a save writes."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise SessionFileError(f"{path}: cannot read it ({err.strerror}); give the file /save wrote") from err
    try:
        tensors = load(blob)
        header = json.loads(_metadata(blob)["session"])
    except (SafetensorError, ValueError, KeyError, TypeError, RecursionError) as err:
        raise SessionFileError(f"{path}: not a complete session file ({err}); it may have been cut short, "
                               "use an earlier save") from err
    if type(header) is not dict or header.get("format") != SESSION_FORMAT:
        found = header.get("format") if type(header) is dict else None
        raise SessionFileError(f"{path}: format {found!r}, expected {SESSION_FORMAT}; it was not saved by this "
                               "version of cabin-chat: start a new conversation")
    if header.get(CHECKSUM_FIELD) != payload_sha256(header, tensors):
        raise SessionFileError(f"{path}: the checksum does not match the contents: the file was damaged or edited "
                               "after it was saved; use an earlier save")
    try:
        check_header(header, tensors)
    except ValueError as err:
        raise SessionFileError(f"{path}: invalid session header: {err}; use a file written by /save") from err
    return header, tensors


def payload_sha256(header: dict, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a header (its checksum field left out) and of every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != CHECKSUM_FIELD},
                                       sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.contiguous().flatten().view(torch.uint8).numpy())
    return digest.hexdigest()


def check_header(header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the first header field that is missing, unknown, of the wrong type or out of range
    (for kv_cache, overflow and params: as their classes check them), or messages that do not follow the
    system prompt, or K/V for another number of tokens than ``fed``."""
    for key, default in OPTIONAL.items():
        header.setdefault(key, default)
    if type(header.get("overflow")) is dict:  # files from before media compaction: the default
        header["overflow"].setdefault("compact_media", OverflowPolicy.compact_media)
    _check_object(header, HEADER, "")
    for field, kind in CLASSES.items():
        try:
            kind(**header[field])
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from err
    system = header["system_prompt"]
    head = [{"role": "system", "content": system}] if system else []
    rest = header["messages"][len(head):]
    if header["messages"][:len(head)] != head or any(m["role"] == "system" for m in rest):
        raise ValueError("the messages must start with the system prompt's message (when there is one) and "
                         "hold no other system message")
    tokens = len(header["fed"])
    shapes = {name: list(t.shape) for name, t in tensors.items()}
    # every token's rows; a sliding-window pool's (runtime.kv.window) of the window only
    if bool(tensors) != bool(tokens) or any(len(shape) < 2 or not (shape[1] == tokens or name.startswith(WINDOW)
                                                                   and shape[1] <= tokens)
                                            for name, shape in shapes.items()):
        raise ValueError(f"'fed' lists {tokens} tokens but the K/V tensors have shapes {shapes} "
                         "(layers, tokens, ...)")


def check_fits(path: str | Path, header: dict, tensors: dict[str, torch.Tensor], pools: dict[str, torch.Tensor],
               vocab_size: int, context: int) -> None:
    """SessionFileError when a checked session does not fit a model and cache: a token id outside the
    vocabulary, more tokens than the context, or K/V tensors unlike the cache's ``pools``."""
    for field in ("fed", "pending"):
        outside = [i for i in header[field] if i >= vocab_size]
        if outside:
            raise SessionFileError(f"{path}: token id {outside[0]} in '{field}' is outside this model's "
                                   f"vocabulary of {vocab_size} ids; restore it with the engine it was saved from")
    tokens = len(header["fed"]) + len(header["pending"])
    if tokens > context:
        raise SessionFileError(f"{path}: the session holds {tokens} tokens, more than this model's context of "
                               f"{context}; restore it with the engine it was saved from")
    for start, length, digest, _ in header["media"]:
        medium = header["images"].get(digest) or header["clips"].get(digest)
        if start + length > len(header["fed"]) or medium is None or len(medium["token_ids"]) != length:
            raise SessionFileError(f"{path}: picture or clip span [{start}, {start + length}) of {digest[:12]} does "
                                   "not match the tokens, pictures and clips saved; the file is damaged, start a new "
                                   "session")
    want = {name: (str(p.dtype), [p.shape[0], *p.shape[3:]]) for name, p in pools.items()}
    got = {name: (str(t.dtype), [t.shape[0], *t.shape[2:]]) for name, t in tensors.items()}
    if tensors and got != want:
        raise SessionFileError(f"{path}: the K/V tensors {got} are not this cache's {want} "
                               "(name: dtype, [layers, per token...]); restore it with the engine it was saved from")


def within_memory(config: KvCacheConfig) -> KvCacheConfig:
    """config, when this machine's memory can hold its budget; ValueError otherwise."""
    memory = available_memory()
    if config.max_bytes > memory:
        raise ConfigError(f"the session's KV budget of {config.max_bytes / 2**20:.0f} MiB is more than the "
                          f"{memory / 2**20:.0f} MiB of memory this machine has available; restore it into a "
                          "smaller cache", (Hint(Fix.LOWER_KV_BUDGET),))
    return config


def _check_object(value: object, spec: Spec, where: str) -> None:
    """ValueError unless value is a JSON object with exactly spec's fields, each passing its rule."""
    if type(value) is not dict:
        raise ValueError(f"{where or 'the header'} is {_show(value)}, expected an object")
    unknown, missing = sorted(value.keys() - spec.keys()), sorted(spec.keys() - value.keys())
    if unknown or missing:
        raise ValueError(f"{where or 'the header'} has " + " and ".join(
            ([f"unknown fields {unknown}"] if unknown else []) + ([f"no {missing}"] if missing else [])))
    for key, rule in spec.items():
        at = f"{where}.{key}" if where else key
        if isinstance(rule, dict):
            _check_object(value[key], rule, at)
        elif not rule[1](value[key]):
            raise ValueError(f"{at} is {_show(value[key])}, expected {rule[0]}")


def _show(value: object) -> str:
    """A JSON value for a message, cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _metadata(blob: bytes) -> dict:
    """The string metadata of a safetensors blob."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + size])["__metadata__"]
