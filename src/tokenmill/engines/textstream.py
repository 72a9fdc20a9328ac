"""Incremental detokenization: token bytes in, safe text deltas out.

Two things are held back from the caller until they are decided:

* the bytes of a UTF-8 character split across tokens (emitted once complete);
* a tail of text that could still turn into a stop string (emitted once it cannot).

A stop string is never emitted, even when it spans tokens; everything before it is.
Shared by every engine that produces raw token bytes.
"""

from __future__ import annotations

import codecs


class TextStream:
    __slots__ = ("_decoder", "_max_stop", "_pending", "_stops", "decoded", "matched", "stopped")

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self.stopped = False
        # The stop string that stopped it (the earliest in the text; of two starting
        # at the same character, the first listed), once ``stopped``.
        self.matched: str | None = None
        # Characters decoded so far, emitted or held back: where the text of the next
        # token starts (engines align tokens with their text by it).
        self.decoded = 0

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit.

        After a stop string is seen, ``stopped`` is true, ``matched`` names it and
        later input is ignored.
        """
        if self.stopped:
            return ""
        text = self._decoder.decode(data)
        if not text:
            return ""
        self.decoded += len(text)
        if not self._stops:
            return text
        pending = self._pending + text
        # Only a stop string that overlaps the new text can be new: search from there.
        search_from = max(0, len(self._pending) - self._max_stop + 1)
        cut = -1
        for s in self._stops:
            i = pending.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
                self.matched = s
        if cut != -1:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        hold = self._held_tail(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold]

    @property
    def partial(self) -> bool:
        """Whether the bytes fed so far end inside a character (its first bytes held)."""
        return bool(self._decoder.getstate()[0])

    def finish(self) -> str:
        """End of generation: flush what was held back (no stop string can follow).

        Bytes of a character the model never completed (cut by ``max_tokens``) are
        dropped rather than turned into a replacement character.
        """
        if self.stopped:
            return ""
        text = self._pending
        self._pending = ""
        self._decoder.reset()
        return text

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        upto = min(len(text), self._max_stop - 1)
        for n in range(upto, 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                longest = n
                break
        return longest
