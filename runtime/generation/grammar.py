"""Grammar-constrained decoding: a grammar turns into a mask of the tokens allowed next, applied to the logits
before every sample, so the reply is always a sentence of the grammar.

Grammars are llguidance's: ``json_schema_grammar``, ``regex_grammar``, ``choice_grammar`` and
``tool_call_grammar`` (a Lark grammar with the tools' JSON Schemas embedded) return the grammar text; ``Vocabulary`` holds llguidance's view of one model's tokens (built once
per model, about half a second) and starts one ``GrammarState`` per reply. Mask time per token for our
vocabulary, llguidance against xgrammar: ``python -m cabinllm.benchmarks.studies.grammar_masks``.
JSON is generated in one layout, ``json.dumps``'s (``", "`` and ``": "``, no other whitespace): a small
model cannot wander off into whitespace, and JSON a client sends back renders to the same tokens.
"""
from __future__ import annotations

import json

import llguidance
import numpy as np
import torch

from cabinllm.runtime.errors import GrammarError
from cabinllm.runtime.model.tools import Tool, ToolFormat

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: dict) -> str:
    """The grammar of JSON documents that validate against ``schema``."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)


def regex_grammar(pattern: str) -> str:
    """The grammar of the strings that ``pattern`` matches whole."""
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(options: list[str]) -> str:
    """The grammar of exactly one of ``options``."""
    return regex_grammar("|".join(_literal(option) for option in options))


def tool_call_grammar(tool_format: ToolFormat, tools: list[Tool], choice: str, parallel: bool = True,
                      reply_schema: dict | None = None) -> str:
    """The grammar of a reply that may call ``tools``: calls in ``tool_format`` only (``choice`` "required" or a
    function's name), a reply without calls only ("none"), or either ("auto"). The reply without calls is
    text that never writes a call, or JSON valid against ``reply_schema``. Several calls in one reply where
    ``parallel`` and the format allows it."""
    rules = []
    if choice != "none":
        chosen = [tool for tool in tools if choice in ("auto", "required", tool.name)]
        repeat = f" ({json.dumps(tool_format.separator)} call)*" if parallel and tool_format.parallel else ""
        rules.append(f"calls: call{repeat}")
        rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
        for i, tool in enumerate(chosen):
            head = json.dumps(tool_format.before + json.dumps(tool.name) + tool_format.between)
            rules.append(f"call_{i}: {head} arguments_{i} {json.dumps(tool_format.after)}")
            rules.append(f"arguments_{i}: {_lark_json(tool.parameters)}")
    if choice in ("none", "auto"):
        if reply_schema is not None:
            rules.append(f"reply: {_lark_json(reply_schema)}")
        else:
            rules.append("reply: TEXT")
            rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*{_literal(tool_format.opener)}.*)/")
    start = {"none": "reply", "auto": "calls | reply"}.get(choice, "calls")
    return llguidance.LLMatcher.grammar_from_lark("\n".join([f"start: {start}"] + rules))


def reply_grammar(tool_format: ToolFormat, tools: list[Tool], tool_choice: str = "auto", parallel: bool = True,
                  schema: dict | None = None) -> str | None:
    """The grammar a reply follows: calls of ``tools`` as ``tool_choice`` allows (``tool_call_grammar``), else
    JSON valid against ``schema``, else none (free text)."""
    if tools:
        return tool_call_grammar(tool_format, tools, tool_choice, parallel, schema)
    return json_schema_grammar(schema) if schema is not None else None


def _lark_json(schema: dict) -> str:
    """A Lark rule body for JSON that validates against ``schema``, in ``JSON_LAYOUT``."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _literal(text: str) -> str:
    """A regex matching ``text`` exactly, every character but letters and digits written by its code."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


class Vocabulary:
    """One model's tokens as llguidance sees them: starts a ``GrammarState`` per reply."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        """``vocab_size`` is the width of the model's logits (rows past the tokenizer's are never allowed);
        ``stop_token_ids`` end a reply once the grammar is complete. GrammarError for a tokenizer llguidance
        cannot read."""
        self.vocab_size = vocab_size
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=stop_token_ids)
        except ValueError as err:  # a tokenizer.json llguidance cannot read (its decoder, its model kind)
            raise GrammarError(f"this model's tokenizer cannot drive a grammar ({err})") from err

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (b"" for a special token)."""
        return self._tokenizer.decode_bytes([token])

    def start(self, grammar: str) -> "GrammarState":
        """The state of a reply that has not begun; GrammarError naming the problem when ``grammar`` cannot
        constrain this model (compiled once: llguidance's matcher holds the error instead of raising)."""
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {matcher.get_error().splitlines()[0]}")
        return GrammarState(matcher, self.vocab_size)


class GrammarState:
    """Where one reply is in its grammar: the tokens allowed next, advanced by each sampled token."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher, self._vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """Which tokens may come next, a bool tensor of the logits' width."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[:self._vocab_size]
        return torch.from_numpy(bits.astype(np.bool_))

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab,) with every token the grammar does not allow next at -inf."""
        allowed = self.allowed()
        if not bool(allowed.any()):
            raise GrammarError(f"the grammar allows no token here ({self._matcher.get_error() or 'dead end'})")
        return logits.masked_fill(~allowed[:logits.shape[-1]], float("-inf"))

    def push(self, token: int) -> None:
        """Advance past a sampled token (one ``allowed`` said may come)."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the reply so far is a whole sentence of the grammar."""
        return self._matcher.is_accepting()
