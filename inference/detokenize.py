"""The text of a growing list of token ids, a few ids decoded per token.

Decoding the whole list at every token made a stream quadratic (1,024 tokens
took ~100 ms of event-loop time). As in vLLM's `detokenize_incrementally`, the
new text is the decode of a window from `_prefix` minus the decode of its part
before `_read`: both start at the same id, so a tokenizer that treats a decode's
first token specially (SentencePiece drops its leading space) does so in both.
The bytes of an unfinished character are held back until it completes.
"""

from __future__ import annotations

from collections.abc import Callable


class Detokenizer:
    """Push ids one at a time; each push says what text they added."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self._pieces: list[str] = []  # the decoded text of ids[:_read], joined on demand
        self._prefix = 0  # the window starts here...
        self._read = 0  # ...and its text up to here is in `_pieces` already

    @property
    def text(self) -> str:
        """The text so far (joined here: O(length), for the rare caller that needs it whole)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token: int) -> str | None:
        """The text `token` appended ("" while a character is unfinished), or None when the
        text had to be decoded again as a whole and is not an extension of what it was."""
        self.ids.append(token)
        window = self.decode(self.ids[self._prefix :])
        if window.endswith("\ufffd"):
            return ""  # an unfinished character: wait for its next bytes
        before = self.decode(self.ids[self._prefix : self._read])
        self._prefix, self._read = self._read, len(self.ids)
        if window.startswith(before):
            piece = window[len(before) :]
            self._pieces.append(piece)
            return piece
        # The window does not extend its own prefix: read the whole list (rare, O(length)).
        old, new = self.text, self.decode(self.ids)
        self._pieces = [new]
        return new[len(old) :] if new.startswith(old) else None
