"""Incremental detokenization that never emits half of a UTF-8 character."""
from __future__ import annotations

from typing import Callable


class TextStream:
    """Turns generated ids into text pieces; holds back text while a character is incomplete."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became complete (may be empty)."""
        self.ids.append(token_id)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.text = text[len(self.text):], text
        return piece
