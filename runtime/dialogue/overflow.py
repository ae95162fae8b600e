"""What to do when the next turn does not fit the KV budget, written once for every backend.

- ``sink-window``: keep the first tokens (system prompt plus a few attention sinks, as in
  StreamingLLM) and the most recent tokens; the kept window is prefilled again at
  compacted positions, so RoPE positions stay contiguous and never pass the model's context.
- ``drop-turns``: drop the oldest whole user/assistant turns, keep the system prompt, and
  prefill what remains (the system prompt's blocks are found again by their hash).
- ``error``: refuse the turn with ``finish_reason: "capacity"``; the session stays usable.

A backend that appends each turn to the cached history aims to leave the history at most
``keep_fraction`` of the budget after an eviction, so the next turns append again instead of
evicting every turn; when the current turn alone needs more, it evicts just enough for it. A
backend that prefills the whole history every turn fills the budget. Every policy keeps the
system prompt and the whole current message; when those and the reply do not fit, the turn
ends with a clear error. ``plan_turn`` is how every backend plans a turn: what is new since the history it holds
(``Held``) where that fits after it, else the whole rendered
conversation when it fits the backend's ``Room``, else what the policy keeps. A picture goes as a unit:
sink-window never keeps part of one, drop-turns drops it with its turn.

Before any policy, media compaction (``OverflowPolicy.compact_media``, on by default): the pictures and audio clips
of turns the assistant already answered are replaced one by one, oldest first, by text (a picture by a marker
naming it, ``[picture: dashboard.jpg]``; an audio part ``{"type": "audio", "digest", "transcript"}`` by its
transcript, or by a marker naming the clip where it has none) until the turn fits, every word kept; only if that cannot make room does the policy run, over the
compacted conversation. The prefix before the first compacted medium stays cached (its blocks are found by hash);
what follows it is prefilled again. A replacement that would not free tokens is not made; the current message's
media are never touched.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, TypeVar

from cabinllm.runtime.errors import CapacityError, ConfigError, Fix, Hint
from cabinllm.runtime.kv.blocks import MediaSpan, whole_media_prefix
from cabinllm.runtime.model.tokenizer import ChatTokenizer

T = TypeVar("T")
OVERFLOW_POLICIES = ("sink-window", "drop-turns", "error")
COMPACT_MEDIA = "compact-media"  # the compaction step's name in a list of steps ("compact-media,drop-turns")
MARKER = "[{kind}: {name}]"  # what an answered medium becomes where nothing more is known of it: its kind and name
# a media part's type -> what a turn's answered medium of that type becomes: the text (from the part and its name),
# what that text is, and what the medium is called; an audio part without a transcript becomes the MARKER
MEDIA_REPLACEMENTS = {
    "image": (MARKER, "marker", "picture"),
    "audio": ("[audio: {transcript}]", "transcript", "audio"),
}


@dataclass
class OverflowPolicy:
    """Which policy, whether answered media are compacted first, and how full the budget is after evicting on a
    backend that appends turns."""

    name: str = field(default="sink-window", metadata={
        "help": "when a turn does not fit the budget: keep the system prompt and the most recent tokens "
                "(sink-window), drop the oldest turns (drop-turns), or refuse the turn (error)"})
    keep_fraction: float = 0.5
    compact_media: bool = field(default=True, metadata={
        "help": "before the policy, replace the pictures and audio of answered turns, oldest first, by a text "
                "marker or their transcript until the turn fits (every word kept)"})

    def __post_init__(self) -> None:
        if self.name not in OVERFLOW_POLICIES:
            raise ConfigError(f"unknown overflow policy {self.name!r}; choose one of {', '.join(OVERFLOW_POLICIES)}")
        if not 0 < self.keep_fraction <= 1:
            raise ConfigError("need 0 < keep_fraction <= 1")
        if type(self.compact_media) is not bool:
            raise ConfigError(f"compact_media is true or false, got {self.compact_media!r}")

    @classmethod
    def from_steps(cls, text: str) -> "OverflowPolicy":
        """The policy a list of steps names, tried in order: ``compact-media,drop-turns`` compacts, then drops
        turns; a policy alone (``drop-turns``) does not compact. ConfigError for any other list."""
        steps = [step.strip() for step in text.split(",")]
        *first, name = steps
        if first not in ([], [COMPACT_MEDIA]) or name not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow steps {text!r}: give one policy of {', '.join(OVERFLOW_POLICIES)}, "
                              f"optionally after {COMPACT_MEDIA} (e.g. {COMPACT_MEDIA},drop-turns)")
        return cls(name, compact_media=bool(first))

    @property
    def steps(self) -> str:
        """The policy as its list of steps (``from_steps`` reads it back)."""
        return f"{COMPACT_MEDIA},{self.name}" if self.compact_media else self.name


@dataclass
class Room:
    """What a backend can hold for one conversation."""

    capacity: int  # tokens the conversation could hold, its reply included
    fits: Callable[[int], bool]  # whether a rebuilt sequence of this many tokens (reply included) fits
    appends_turns: bool  # the history stays cached and each turn appends to it


@dataclass
class Held:
    """What a backend that appends turns holds of the conversation: its sequence's tokens and pictures, the token
    sampled last and not fed yet, and the text they stand for; ``fits(n)``: whether ``n`` more tokens and the reply
    fit after them."""

    ids: list[int]
    media: list[MediaSpan]
    pending: list[int]
    transcript: str
    fits: Callable[[int], bool]


@dataclass
class Compacted:
    """One medium of an answered turn replaced by text: its name, what it is (picture, audio), the tokens that
    freed, and what replaced it (marker, transcript)."""

    name: str
    kind: str
    tokens: int
    replacement: str


@dataclass
class TurnPlan:
    """What a turn feeds: tokens to prefill, the messages and prompt they stand for, whether the
    backend's sequence is rebuilt first, how many tokens of the stream were left out, and the media compacted."""

    feed: list[int]
    messages: list[dict]
    prompt: str
    rebuild: bool = True
    evicted: int = 0
    media: list[MediaSpan] = field(default_factory=list)  # the pictures among the feed's tokens
    compacted: list[Compacted] = field(default_factory=list)


@dataclass
class _Rendering:
    """Messages with what they render to: the prompt, its tokens and the pictures among them."""

    messages: list[dict]
    prompt: str
    ids: list[int]
    media: list[MediaSpan]


def sink_window(tokens: list[int], sink: int, limit: int,
                media: list[MediaSpan] = ()) -> tuple[list[int], list[MediaSpan]]:
    """The first ``sink`` tokens and the most recent ones, at most ``limit`` tokens in all, with the pictures
    kept (``media``: those among ``tokens``): a cut that would split a picture leaves it out whole."""
    if len(tokens) <= limit:
        return tokens, list(media)
    head = whole_media_prefix(sink, media)
    recent = max(limit - sink, 0)
    start = len(tokens) - recent
    start = next((span.end for span in media if span.start < start < span.end), start)
    kept = [span for span in media if span.end <= head] + [span.shifted(head - start) for span in media
                                                           if span.start >= start]
    return tokens[:head] + tokens[start:], kept


def drop_oldest_turns(messages: list[dict], fits: Callable[[list[dict]], bool]) -> list[dict] | None:
    """Drop the oldest messages after the system prompt until ``fits``; None if even the last message alone does not."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head):]
    while body:
        if fits(head + body):
            return head + body
        body = body[1:]
        while body and body[0]["role"] != "user":  # a turn starts with the user
            body = body[1:]
    return None


def answered_media(messages: list[dict]) -> list[tuple[int, int]]:
    """(message, part) indexes of the media parts (types of ``MEDIA_REPLACEMENTS``) in the messages before the last
    assistant reply, oldest first: the media the assistant has answered."""
    answered = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
    return [(i, j) for i, m in enumerate(messages[:answered]) if isinstance(m["content"], list)
            for j, part in enumerate(m["content"]) if part.get("type") in MEDIA_REPLACEMENTS]


def media_replacement(part: dict, name: str) -> tuple[dict, Compacted]:
    """The text part that takes a media part's place (``name``: the medium's, as the user named it) and the record
    of it (its tokens freed not yet known: 0); a part whose transcript is missing or empty becomes the ``MARKER``."""
    text, replacement, kind = MEDIA_REPLACEMENTS[part["type"]]
    transcript = part.get("transcript", "").strip()
    if replacement == "transcript" and not transcript:
        text, replacement = MARKER, "marker"
    return ({"type": "text", "text": text.format(kind=kind, name=name, transcript=transcript)},
            Compacted(name, kind, 0, replacement))


def compacted_steps(tokenizer: ChatTokenizer, messages: list[dict],
                    prompt: str) -> Iterator[tuple[_Rendering, list[Compacted]]]:
    """The conversation (``messages``, rendered as ``prompt``) after each answered medium, oldest first, is replaced
    by text (``media_replacement``), with the media compacted so far. A replacement that frees no token is skipped."""
    compacted: list[Compacted] = []
    tokens = len(tokenizer.encode_prompt(prompt))
    for i, j in answered_media(messages):
        content = messages[i]["content"]
        part = content[j]
        medium = tokenizer.images.get(part["digest"])  # the tokenizer's view holds pictures and clips by digest
        name = getattr(medium, "name", "") or f"{MEDIA_REPLACEMENTS[part['type']][2]} {part['digest'][:12]}"
        text_part, record = media_replacement(part, name)
        candidate = [*messages[:i], {**messages[i], "content": [*content[:j], text_part, *content[j + 1:]]},
                     *messages[i + 1:]]
        prompt = tokenizer.render(candidate)
        ids, media = tokenizer.encode_prompt_media(prompt)
        if len(ids) >= tokens:
            continue
        compacted.append(replace(record, tokens=tokens - len(ids)))
        messages, tokens = candidate, len(ids)
        yield _Rendering(messages, prompt, ids, media), list(compacted)


def shown_images(messages: list[dict], images: dict[str, T]) -> dict[str, T]:
    """The pictures of ``images`` (by digest) that the messages still show: those compacted or dropped let go."""
    shown = {part.get("digest") for m in messages if isinstance(m["content"], list) for part in m["content"]
             if part.get("type") == "image"}
    return {digest: image for digest, image in images.items() if digest in shown}


def capacity_error(err: CapacityError, policy: OverflowPolicy, max_new_tokens: int, capacity: int,
                   pictures: list[tuple[str, int]] = ()) -> CapacityError:
    """A refused turn's error: what did not fit (``err``) with what the user can do as hints (``pictures``: the
    turn's, by name and tokens); a front end words it with ``CabinError.words``."""
    return CapacityError(err.message, capacity_hints(policy, max_new_tokens, capacity, pictures))


def capacity_hints(policy: OverflowPolicy, max_new_tokens: int, capacity: int,
                   pictures: list[tuple[str, int]] = ()) -> tuple[Hint, ...]:
    """What the user can do about a turn that does not fit, leaving out the policy already chosen."""
    hints = [Hint(Fix.NEW_CONVERSATION), Hint(Fix.RAISE_KV_BUDGET)]
    if pictures:
        hints.insert(0, Hint(Fix.SMALLER_PICTURES, ", ".join(f"{name} takes {tokens} tokens"
                                                              for name, tokens in pictures)))
    if 2 * max_new_tokens > capacity:  # the reply's reservation is most of the budget
        hints.insert(0, Hint(Fix.LOWER_MAX_NEW_TOKENS, f"{max_new_tokens} of the {capacity} tokens the budget holds "
                                                       "are kept for the reply"))
    if policy.name == "error":
        hints.append(Hint(Fix.OTHER_OVERFLOW))
    return tuple(hints)


def plan_turn(tokenizer: ChatTokenizer, messages: list[dict], room: Room, policy: OverflowPolicy, sink_tokens: int,
              max_new_tokens: int, held: Held | None = None) -> TurnPlan:
    """What a turn prefills: only what is new since the ``held`` history where it and the reply fit after it (a
    backend that appends turns), else the rendered ``messages`` whole when they and the reply fit the room, else
    what the policy keeps of them (``plan_overflow``)."""
    prompt = tokenizer.render(messages)
    if held and (held.ids or held.pending) and prompt.startswith(held.transcript):
        new, new_media = tokenizer.encode_media(prompt[len(held.transcript):])
        offset = len(held.pending)
        if held.fits(offset + len(new)):
            return TurnPlan(held.pending + new, messages, prompt, rebuild=False,
                            media=[span.shifted(offset) for span in new_media])
        history = held.ids + held.pending
        stream, media = history + new, held.media + [span.shifted(len(history)) for span in new_media]
    else:
        stream, media = tokenizer.encode_prompt_media(prompt)
    if room.fits(len(stream) + max_new_tokens):
        return TurnPlan(stream, messages, prompt, media=media)
    frame = tokenizer.frame_tokens(messages, prompt)
    return plan_overflow(policy, sink_tokens, messages, prompt, stream, room, tokenizer, max_new_tokens, frame, media)


def plan_overflow(policy: OverflowPolicy, sink_tokens: int, messages: list[dict], prompt: str, stream: list[int],
                  room: Room, tokenizer: ChatTokenizer, max_new_tokens: int, frame: tuple[int, int],
                  media: list[MediaSpan] = ()) -> TurnPlan:
    """Make room for a turn whose token stream (whole history plus the new message) does not fit: compact answered
    media first where the policy says so (``compacted_steps``), then apply the policy; ``frame``: the tokens of its
    system prompt and of its new message with its headers (``ChatTokenizer.frame_tokens``).

    Compaction, as the policies, aims at ``keep_fraction`` of the budget on a backend that appends turns, else
    compacts just enough for this turn. Whatever the policy keeps, it keeps the system prompt and the whole current
    message with its template headers; when even those and the reply do not fit, CapacityError says so.
    """
    capacity = room.capacity
    most = capacity - max_new_tokens  # prompt tokens the budget takes at all
    target = min(most, int(capacity * policy.keep_fraction) - max_new_tokens) if room.appends_turns else most
    system, message = frame
    if system + message > most:
        raise CapacityError(f"the message is {message} tokens with its template headers, the system prompt {system} "
                            f"and the reply may take {max_new_tokens} more: {system + message + max_new_tokens} "
                            f"tokens, but the KV budget holds {capacity}; shorten the message")
    compacted: list[Compacted] = []
    if policy.compact_media:
        fitting = None  # the first compaction that fits this turn, where none leaves room for the next ones
        for rendering, compacted in compacted_steps(tokenizer, messages, prompt):
            if len(rendering.ids) <= target:
                fitting = (rendering, compacted)
                break
            if fitting is None and len(rendering.ids) <= most:
                fitting = (rendering, compacted)
        if fitting:
            rendering, compacted = fitting
            return TurnPlan(rendering.ids, rendering.messages, rendering.prompt, media=rendering.media,
                            compacted=compacted)
        if compacted:  # every answered medium compacted and still too long: the policy goes on from there
            messages, prompt, stream, media = rendering.messages, rendering.prompt, rendering.ids, rendering.media
    plan = _apply_policy(policy, sink_tokens, messages, prompt, stream, room, tokenizer, max_new_tokens, system,
                         message, target, most, media)
    return replace(plan, compacted=compacted)


def _apply_policy(policy: OverflowPolicy, sink_tokens: int, messages: list[dict], prompt: str, stream: list[int],
                  room: Room, tokenizer: ChatTokenizer, max_new_tokens: int, system: int, message: int, target: int,
                  most: int, media: list[MediaSpan]) -> TurnPlan:
    """What the policy keeps of a turn that does not fit (``plan_overflow``'s limits: ``target``, ``most``)."""
    capacity = room.capacity
    if policy.name == "sink-window":
        window = max(target, system + message)
        head = min(system + sink_tokens, window - message)  # the system prompt always, the sink tokens if room
        kept, kept_media = sink_window(stream, head, window, media)
        if room.fits(len(kept) + max_new_tokens):
            return TurnPlan(kept, messages, prompt, evicted=len(stream) - len(kept), media=kept_media)
    elif policy.name == "drop-turns":
        encoded: dict[int, tuple[str, list[int], list[MediaSpan]]] = {}  # each candidate rendered once, by length

        def encode(kept: list[dict]) -> tuple[str, list[int], list[MediaSpan]]:
            if len(kept) not in encoded:
                text = tokenizer.render(kept)
                encoded[len(kept)] = (text, *tokenizer.encode_prompt_media(text))
            return encoded[len(kept)]

        for limit in (target, most):  # leave room for the next turns if possible, else just fit this one
            kept_messages = drop_oldest_turns(messages, lambda m: len(encode(m)[1]) <= limit)
            if kept_messages:
                kept_prompt, ids, kept_media = encode(kept_messages)
                return TurnPlan(ids, kept_messages, kept_prompt, evicted=max(0, len(stream) - len(ids)),
                                media=kept_media)
    raise CapacityError(f"the turn needs {len(stream) + max_new_tokens} tokens of KV but the budget holds {capacity} "
                        f"for this conversation (policy {policy.name})")
