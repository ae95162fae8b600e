"""Grammar-constrained decoding: a grammar turns into a mask of the tokens allowed next, applied to the logits
before every sample, so the reply is always a sentence of the grammar.

Grammars are llguidance's: ``json_schema_grammar``, ``regex_grammar``, ``choice_grammar`` and
``tool_call_grammar`` (a Lark grammar with the tools' JSON Schemas embedded) return the grammar text; ``Vocabulary`` holds llguidance's view of one model's tokens (built once
per model, about half a second) and starts one ``GrammarState`` per reply. Mask time per token for our
vocabulary, llguidance against xgrammar: ``python -m cabinllm.benchmarks.studies.grammar_masks``.
A reply's calls are capped (``MAX_TOOL_CALLS`` unless the caller sets another cap). A reply under a grammar always
closes: ``GrammarState`` keeps a way to a whole sentence from where the reply is (the fewest tokens a search over
closing tokens, single characters and the longest allowed token finds), and a sampled token after which no whole
sentence fits the tokens left is replaced by one after which one does (the model's likeliest such, or the next token
of that way), so a JSON answer or a call closes its strings, arrays and objects instead of being cut; a reply whose
shortest sentence is longer than its whole limit is refused before it starts (``check_room``).
JSON is generated in one layout, ``json.dumps``'s (``", "`` and ``": "``, no other whitespace): a small
model cannot wander off into whitespace, and JSON a client sends back renders to the same tokens.
"""
from __future__ import annotations

import json

import llguidance
import numpy as np
import torch

from cabinllm.runtime.errors import Fix, GrammarError, Hint
from cabinllm.runtime.model.tools import Tool, ToolFormat

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_TOOL_CALLS = 4  # calls one reply makes at most unless the caller sets another cap (vLLM and llama.cpp: no cap)
ENDING_DEPTH = 128  # the longest way to a whole sentence searched for; with more tokens left, a reply is not steered
SEARCH_NODES = 64  # choices one search tries before it gives up (it backtracks where a choice leads nowhere)
SEARCH_BRANCHES = 3  # tokens tried at a choice: closing ones first, then the longest allowed, then single bytes...
SEARCH_WIDE = 2  # ... at the choices of the first tokens of a way; after them, the first token only
CLOSING = b'"}]'  # the bytes that close a JSON string, object or array
BYTE_ORDER = b'"}]0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ _-.' + bytes(range(256))


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
                      reply_schema: dict | None = None, max_calls: int = MAX_TOOL_CALLS) -> str:
    """The grammar of a reply that may call ``tools``: calls in ``tool_format`` only (``choice`` "required" or a
    function's name), a reply without calls only ("none"), or either ("auto"). The reply without calls is
    text that never writes a call, or JSON valid against ``reply_schema``. Up to ``max_calls`` calls in one reply
    where ``parallel`` and the format allows it, else one."""
    rules = []
    if choice != "none":
        chosen = [tool for tool in tools if choice in ("auto", "required", tool.name)]
        more = max_calls - 1 if parallel and tool_format.parallel else 0
        repeat = f" ({json.dumps(tool_format.separator)} call){{0,{more}}}" if more else ""
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
                  schema: dict | None = None, max_calls: int = MAX_TOOL_CALLS) -> str | None:
    """The grammar a reply follows: calls of ``tools`` as ``tool_choice`` allows (``tool_call_grammar``, at most
    ``max_calls``, one unless ``parallel``), else JSON valid against ``schema``, else none (free text)."""
    if tools:
        return tool_call_grammar(tool_format, tools, tool_choice, parallel, schema, max_calls)
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
        self.vocab_size, self.stop_token_ids = vocab_size, list(stop_token_ids)
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=stop_token_ids)
        except ValueError as err:  # a tokenizer.json llguidance cannot read (its decoder, its model kind)
            raise GrammarError(f"this model's tokenizer cannot drive a grammar ({err})") from err
        self._search_order: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (b"" for a special token)."""
        return self._tokenizer.decode_bytes([token])

    def start(self, grammar: str, tool_format: ToolFormat | None = None) -> "GrammarState":
        """The state of a reply that has not begun (``tool_format``: the format of the calls the grammar writes);
        GrammarError naming the problem when ``grammar`` cannot constrain this model (compiled once: llguidance's
        matcher holds the error instead of raising)."""
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {matcher.get_error().splitlines()[0]}")
        return GrammarState(matcher, self, tool_format)

    def allowed(self, matcher) -> np.ndarray:
        """Which tokens may come next in ``matcher``'s state, a bool array of the logits' width."""
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(words, bitorder="little")[:self.vocab_size].astype(np.bool_)

    def ending(self, matcher, limit: int) -> list[int] | None:
        """A way from ``matcher``'s state to a whole sentence of at most ``limit`` tokens, the shortest the search
        finds ([] where the state is one; None where it finds none): forced tokens as they come, else closing tokens
        first, then the longest allowed token, then single bytes, backtracking where a choice leads nowhere.
        ``matcher`` is left as it was."""
        search, way, nodes = matcher.deep_copy(), [], 0

        def reach(left: int) -> bool:
            nonlocal nodes
            if search.is_accepting():
                return True
            nodes += 1
            if left <= 0 or nodes > SEARCH_NODES or search.is_error():
                return False
            forced = search.compute_ff_tokens()
            branches = SEARCH_BRANCHES if len(way) < SEARCH_WIDE else 1
            steps = [forced] if forced else [[token] for token in self._choices(self.allowed(search))][:branches]
            for step in steps:
                if len(step) > left or not search.consume_tokens(step):
                    continue
                way.extend(step)
                if reach(left - len(step)):
                    return True
                del way[-len(step):]
                search.rollback(len(step))
            return False

        return way if reach(limit) else None

    def _choices(self, allowed: np.ndarray) -> list[int]:
        """The tokens a search tries next among ``allowed``, best first."""
        closing, longest, single = self._order()
        picks = [*closing[allowed[closing]][:2], *longest[allowed[longest]][:1], *single[allowed[single]][:2]]
        return list(dict.fromkeys(int(token) for token in picks))[:SEARCH_BRANCHES]

    def _order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The search's token lists (built once): tokens of closing bytes only (after spaces), those that end a
        string first, longest first; every token, longest first; the single-byte tokens in ``BYTE_ORDER``."""
        if self._search_order is None:
            spelled = [(token, self.token_bytes(token)) for token in range(self.vocab_size)]
            spelled = [(token, text) for token, text in spelled if text]
            by_length = sorted(spelled, key=lambda item: -len(item[1]))
            singles = {text[0]: token for token, text in reversed(by_length) if len(text) == 1}
            order = list(dict.fromkeys(BYTE_ORDER))
            closing = [(token, text.lstrip(b" ")) for token, text in by_length if not text.strip(b" ").strip(CLOSING)]
            closing.sort(key=lambda item: (not item[1].startswith(b'"'), -len(item[1])))  # a string's end first
            self._search_order = (
                np.array([token for token, _ in closing], dtype=np.int64),
                np.array([token for token, _ in by_length], dtype=np.int64),
                np.array([singles[byte] for byte in order if byte in singles], dtype=np.int64))
        return self._search_order


class GrammarState:
    """Where one reply is in its grammar: the tokens allowed next, advanced by each sampled token, and a way to a
    whole sentence from there that the tokens left can hold."""

    def __init__(self, matcher, vocabulary: Vocabulary, tool_format: ToolFormat | None = None) -> None:
        self._matcher, self._vocabulary = matcher, vocabulary
        self.tool_format = tool_format  # the format of the calls the grammar writes (None: it writes none)
        self._ending: list[int] | None = None  # a way to a whole sentence from here (None: not known)
        self._checked: dict[int, list[int] | None] = {}  # tokens ``fits`` checked, each with the way after it

    def allowed(self) -> torch.Tensor:
        """Which tokens may come next, a bool tensor of the logits' width."""
        return torch.from_numpy(self._vocabulary.allowed(self._matcher))

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
        if token in self._checked:
            self._ending = self._checked[token]
        elif self._ending and self._ending[0] == token:
            self._ending = self._ending[1:]
        else:
            self._ending = None
        self._checked = {}

    @property
    def complete(self) -> bool:
        """Whether the reply so far is a whole sentence of the grammar."""
        return self._matcher.is_accepting()

    def ending(self, limit: int) -> list[int] | None:
        """A way from here to a whole sentence of at most ``limit`` tokens (``Vocabulary.ending``; None where none
        is found within ``limit`` and ``ENDING_DEPTH``)."""
        if self._ending is None or len(self._ending) > limit:
            self._ending = self._vocabulary.ending(self._matcher, min(limit, ENDING_DEPTH))
        return self._ending

    def check_room(self, max_tokens: int) -> None:
        """GrammarError, its hint the tokens needed, where the shortest whole sentence the search finds from here is
        longer than ``max_tokens`` tokens."""
        if max_tokens >= ENDING_DEPTH or self.ending(max_tokens) is not None:
            return
        shortest = self._vocabulary.ending(self._matcher, ENDING_DEPTH)
        if shortest is not None:
            raise GrammarError(f"the shortest reply the grammar allows takes {len(shortest)} tokens, more than the "
                               f"{max_tokens} the reply may have",
                               (Hint(Fix.RAISE_MAX_NEW_TOKENS, str(len(shortest))),))

    def fits(self, token: int, left: int) -> bool:
        """Whether a whole sentence can still follow ``token`` (one the mask allows) within the ``left`` tokens after
        it; True where the search cannot tell (a way from here not known within ``ENDING_DEPTH``)."""
        if token in self._vocabulary.stop_token_ids or left >= ENDING_DEPTH:
            return True
        here = self.ending(left + 1)
        if here is None:
            return True
        if here and here[0] == token:
            after: list[int] | None = here[1:]
        else:
            after, search = None, self._matcher.deep_copy()
            if search.consume_token(token):
                if here and len(here) <= left and search.validate_tokens(here) == len(here):
                    search.consume_tokens(here)
                    after = here if search.is_accepting() else None  # the same way still ends it (a free string)
                    search.rollback(len(here))
                if after is None:
                    after = self._vocabulary.ending(search, left)
        self._checked[token] = after
        return after is not None

    def steer(self, logits: torch.Tensor, left: int, tried: int = 3) -> torch.Tensor:
        """``logits`` (already constrained) with only the tokens after which a whole sentence fits the ``left`` tokens
        allowed: of the ``tried`` likeliest, those that fit, and the next token of the way from here (a stop token
        where the reply is whole)."""
        here = self.ending(left + 1) or []
        keep = [here[0]] if here else [t for t in self._vocabulary.stop_token_ids if t < logits.shape[-1]]
        likeliest = torch.topk(logits, min(tried, logits.shape[-1])).indices.tolist()
        keep += [t for t in likeliest if logits[t] > float("-inf") and t not in keep and self.fits(t, left)]
        keep = [t for t in keep if logits[t] > float("-inf")]
        if not keep:  # nothing steers (no stop token allowed where the reply is whole): as the mask allows
            return logits
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
        allowed[keep] = True
        return logits.masked_fill(~allowed, float("-inf"))