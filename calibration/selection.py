"""Train/held-out split, seeded selection and tokenization of dialogues.

The split depends only on a dialogue's id (a hash), never on the seed or on how
many dialogues are asked for, so calibration (train) and evaluation (held-out)
never see the same dialogue, whatever options either run used.
"""
from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from typing import Iterable

import torch

from cabinllm.calibration.dialogue_data import Dialogue, LoadReport
from cabinllm.calibration.sources import open_source
from cabinllm.calibration.stitch import conversation_order, stitch
from pathlib import Path

from cabinllm.runtime.errors import AudioError, ConfigError, DataError, Fix, Hint, ImageError
from cabinllm.runtime.model.audio import AudioEncoder, PreparedClip
from cabinllm.runtime.model.interface import MediaFeed
from cabinllm.runtime.model.media import EncodedRows
from cabinllm.runtime.kv.blocks import whole_media_prefix
from cabinllm.runtime.model.tokenizer import ChatTokenizer
from cabinllm.runtime.model.vision import PreparedImage, Vision, read_pictures
from cabinllm.runtime.speech.audio import Clip, read_wav

SPLITS = ("train", "heldout", "all")  # "all": every dialogue, whatever its split
HELDOUT_PERCENT = 20
OVERSAMPLE = 8  # candidates kept per requested dialogue, for those that turn out too short once tokenized


@dataclass
class TokenizedDialogue:
    """A dialogue rendered with the chat template and tokenized (cut to the token limit); ``media``: the pictures or
    clips among its tokens and their rows, ``image_positions`` / ``audio_positions``: the positions that take a
    picture's or a clip's encoder row."""

    id: str
    token_ids: list[int]
    media: MediaFeed | None = None
    image_positions: list[int] = field(default_factory=list)
    audio_positions: list[int] = field(default_factory=list)

    def kinds(self) -> torch.Tensor:
        """What each position takes, as an index of cabinllm.calibration.stats.POSITION_KINDS: 0 a token's
        embedding, 1 a picture's encoder row, 2 a clip's (long, one per token)."""
        kinds = torch.zeros(len(self.token_ids), dtype=torch.long)
        kinds[self.image_positions] = 1
        kinds[self.audio_positions] = 2
        return kinds

    def cut(self, tokens: int) -> "TokenizedDialogue":
        """The first ``tokens`` tokens at most, ending before a picture they would cut."""
        if self.media is None:
            return TokenizedDialogue(self.id, self.token_ids[:tokens])
        end = whole_media_prefix(tokens, self.media.spans)
        spans = [span for span in self.media.spans if span.end <= end]
        return TokenizedDialogue(self.id, self.token_ids[:end], MediaFeed(spans, self.media.rows) if spans else None,
                                 [p for p in self.image_positions if p < end],
                                 [p for p in self.audio_positions if p < end])


def split_of(key: str) -> str:
    """``heldout`` for about HELDOUT_PERCENT % of keys (dialogue ids or groups), ``train`` for the rest; fixed per key."""
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:4], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def select_dialogues(dialogues: Iterable[Dialogue], split: str, count: int | None, seed: int,
                     min_chars: int = 0) -> list[Dialogue]:
    """Up to ``count`` (None: all) dialogues of one split with at least ``min_chars`` characters, chosen by seed.

    The order is a seeded hash of the id, so the choice is reproducible and
    only ``count`` dialogues are held in memory.
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    pool = (d for d in dialogues
            if split in ("all", split_of(d.group or d.id)) and sum(len(m["content"]) for m in d.messages) >= min_chars)

    def order(d: Dialogue) -> bytes:
        return hashlib.sha256(f"{seed}:{d.id}".encode("utf-8")).digest()

    return sorted(pool, key=order) if count is None else heapq.nsmallest(count, pool, key=order)


def tokenize_dialogue(dialogue: Dialogue, tokenizer: ChatTokenizer, max_tokens: int,
                      vision: Vision | None = None, audio: AudioEncoder | None = None) -> TokenizedDialogue:
    """The whole rendered conversation (BOS first if the model wants it) cut to max_tokens, never inside a picture
    or clip; a message's pictures (``images``) are read and prepared by ``vision``, the model's vision part, its
    clips (``audio``: WAV files) by ``audio``, an audio-language model's audio part."""
    if any(m.get("audio") for m in dialogue.messages):
        return _tokenize_clips(dialogue, tokenizer, max_tokens, audio)
    if not any(m.get("images") for m in dialogue.messages):
        return TokenizedDialogue(dialogue.id, tokenizer.encode_prompt(
            tokenizer.render(dialogue.messages, add_generation_prompt=False))[:max_tokens])
    if vision is None:
        raise DataError(f"dialogue {dialogue.id} shows pictures, and only KV calibration and cabin-eval of a "
                        "vision-language model (LLaVA, Idefics3 / SmolVLM, Qwen2-VL) read them (not a text-only model, "
                        "nor weight quantization); use such a model, or data without pictures")
    held: dict[str, PreparedImage] = {}
    try:
        messages = [vision.image_message({"role": m["role"], "content": m["content"]}, read_pictures(m["images"]),
                                         held) if m.get("images") else m for m in dialogue.messages]
    except ImageError as err:
        raise DataError(f"dialogue {dialogue.id}: {err.message}", err.hints) from err
    view = tokenizer.with_images(held, vision.placeholder)
    ids, spans = view.encode_prompt_media(view.render(messages, add_generation_prompt=False))
    positions = [span.start + int(p) for span in spans for p in held[span.digest.hex()].offsets]
    return TokenizedDialogue(dialogue.id, ids, MediaFeed(spans, EncodedRows(vision, held)), positions).cut(max_tokens)


def _tokenize_clips(dialogue: Dialogue, tokenizer: ChatTokenizer, max_tokens: int,
                    audio: AudioEncoder | None) -> TokenizedDialogue:
    """``tokenize_dialogue`` of a dialogue whose messages hold clips (``audio``: WAV paths)."""
    if audio is None:
        raise DataError(f"dialogue {dialogue.id} holds audio clips, and only KV calibration and cabin-eval of an "
                        "audio-language model (Qwen2-Audio) read them; use such a model, or data without audio")
    held: dict[str, PreparedClip] = {}
    try:
        messages = [audio.audio_message({"role": m["role"], "content": m["content"]}, _read_clips(m["audio"]), held)
                    if m.get("audio") else m for m in dialogue.messages]
    except AudioError as err:
        raise DataError(f"dialogue {dialogue.id}: {err.message}", err.hints) from err
    view = tokenizer.with_audio(held, audio.placeholder)
    ids, spans = view.encode_prompt_media(view.render(messages, add_generation_prompt=False))
    positions = [span.start + int(p) for span in spans for p in held[span.digest.hex()].offsets]
    return TokenizedDialogue(dialogue.id, ids, MediaFeed(spans, EncodedRows(audio, held)),
                             audio_positions=positions).cut(max_tokens)


def _read_clips(paths: list[str]) -> list[Clip]:
    """The clips of WAV files; AudioError naming one that cannot be read."""
    clips = []
    for path in map(Path, paths):
        try:
            clips.append(read_wav(path.read_bytes(), path.name))
        except OSError as err:
            raise AudioError(f"{path}: cannot read the clip ({err.strerror}); check the path") from err
    return clips


def stitch_sessions(dialogues: list[Dialogue], tokenizer: ChatTokenizer, min_tokens: int, max_tokens: int,
                    count: int, vision: Vision | None = None,
                    audio: AudioEncoder | None = None) -> list[TokenizedDialogue]:
    """Up to ``count`` sessions of ``min_tokens``..``max_tokens`` tokens, each stitched from consecutive dialogues
    (parts of one conversation together); a dialogue long enough by itself is a session of one."""
    sessions: list[TokenizedDialogue] = []
    current: list[Dialogue] = []
    estimate = 0
    for dialogue in conversation_order(dialogues):
        current.append(dialogue)
        estimate += len(tokenize_dialogue(dialogue, tokenizer, max_tokens, vision, audio).token_ids)
        if estimate < min_tokens:
            continue
        session = tokenize_dialogue(stitch(current), tokenizer, max_tokens, vision, audio)
        if len(session.token_ids) >= max(min_tokens, 2):  # else the dropped system prompts made it short: add another
            sessions.append(session)
            current, estimate = [], 0
            if len(sessions) == count:
                break
    return sessions


def prepare_dialogues(data: str, split: str, count: int | None, seed: int, tokenizer: ChatTokenizer,
                      max_tokens: int, min_tokens: int = 0, sessions: bool = False,
                      vision: Vision | None = None,
                      audio: AudioEncoder | None = None) -> tuple[list[TokenizedDialogue], dict]:
    """Load, split, select and tokenize ``count`` dialogues (None: every one) of ``min_tokens``..``max_tokens`` tokens.

    With ``sessions``, each is a session stitched from consecutive dialogues of the split until it has
    ``min_tokens`` (cabinllm.calibration.stitch), for positions no single dialogue reaches. Dialogues that show
    pictures need ``vision``, the model's vision part; dialogues that hold clips ``audio``, its audio part.
    Returns them with a data summary (source, load report, split, seed, token counts).
    """
    if count is None and sessions:
        raise DataError("stitched sessions need a number of sessions", (Hint(Fix.NUM_DIALOGUES),))
    if count is None:
        return _prepare_every_dialogue(data, split, seed, tokenizer, max_tokens, min_tokens, vision, audio)
    if count < 1 or max_tokens < 2 or min_tokens > max_tokens:
        raise DataError(f"need at least 1 dialogue, max_tokens >= 2 and min_tokens <= max_tokens "
                        f"(got {count}, {max_tokens}, {min_tokens})")
    pool = count * OVERSAMPLE
    while True:
        dialogues, report = open_source(data)
        # A token is at least one UTF-8 byte and a character at most four, so shorter texts cannot qualify.
        candidates = select_dialogues(dialogues, split, pool, seed, min_chars=0 if sessions else min_tokens // 4)
        if sessions:
            chosen = stitch_sessions(candidates, tokenizer, min_tokens, max_tokens, count, vision, audio)
        else:
            chosen = _long_enough(candidates, tokenizer, min_tokens, max_tokens, count, vision, audio)
        if len(chosen) == count or len(candidates) < pool:
            break
        pool *= OVERSAMPLE  # too many candidates were short once tokenized: look further down the same order
    if len(chosen) < count:
        what = "sessions" if sessions else "dialogues"
        hints = (Hint(Fix.LOWER_MIN_TOKENS),) + (() if sessions else (Hint(Fix.STITCH_SESSIONS),))
        raise DataError(f"{data}: only {len(chosen)} {split} {what} of at least {min_tokens} tokens found, "
                        f"{count} asked for; ask for fewer or use a larger data set", hints)
    summary = _summary(report, split, seed, chosen, max_tokens, min_tokens)
    summary["sessions"] = sessions
    return chosen, summary


def _long_enough(dialogues: list[Dialogue], tokenizer: ChatTokenizer, min_tokens: int, max_tokens: int,
                 count: int, vision: Vision | None, audio: AudioEncoder | None) -> list[TokenizedDialogue]:
    """The first ``count`` dialogues that have at least ``min_tokens`` tokens, cut to ``max_tokens``."""
    chosen = []
    for dialogue in dialogues:
        tokenized = tokenize_dialogue(dialogue, tokenizer, max_tokens, vision, audio)
        if len(tokenized.token_ids) >= max(min_tokens, 2):
            chosen.append(tokenized)
            if len(chosen) == count:
                break
    return chosen


def _prepare_every_dialogue(data: str, split: str, seed: int, tokenizer: ChatTokenizer, max_tokens: int,
                            min_tokens: int, vision: Vision | None,
                            audio: AudioEncoder | None) -> tuple[list[TokenizedDialogue], dict]:
    if max_tokens < 2 or min_tokens > max_tokens:
        raise DataError(f"need max_tokens >= 2 and min_tokens <= max_tokens (got {max_tokens}, {min_tokens})")
    dialogues, report = open_source(data)
    chosen = []
    for dialogue in select_dialogues(dialogues, split, None, seed, min_chars=min_tokens // 4):
        tokenized = tokenize_dialogue(dialogue, tokenizer, max_tokens, vision, audio)
        if len(tokenized.token_ids) >= max(min_tokens, 2):
            chosen.append(tokenized)
    if not chosen:
        raise DataError(f"{data}: no {split} dialogue of at least {min_tokens} tokens found; use a larger data set",
                        (Hint(Fix.LOWER_MIN_TOKENS),))
    return chosen, _summary(report, split, seed, chosen, max_tokens, min_tokens)


def _summary(report: LoadReport, split: str, seed: int, chosen: list[TokenizedDialogue], max_tokens: int,
             min_tokens: int) -> dict:
    summary = {**report.to_dict(), "split": split, "seed": seed, "dialogues": len(chosen),
               "tokens": sum(len(d.token_ids) for d in chosen), "max_tokens": max_tokens,
               "min_tokens": min_tokens, "ids": [d.id for d in chosen]}
    return summary | media_summary(chosen)


def media_summary(dialogues: list[TokenizedDialogue]) -> dict:
    """``{"pictures": {"count", "image_positions"}}`` of dialogues that show pictures, ``{"clips": {"count",
    "audio_positions"}}`` of dialogues that hold clips, else {}."""
    summary = {}
    for key, positions in (("pictures", "image_positions"), ("clips", "audio_positions")):
        count = sum(len(d.media.spans) for d in dialogues if d.media and getattr(d, positions))
        if count:
            summary[key] = {"count": count, positions: sum(len(getattr(d, positions)) for d in dialogues)}
    return summary
