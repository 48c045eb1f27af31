"""Incremental detokenization with stop strings held back until they are ruled out."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextAssembler:
    """Feed token ids one by one; get back the text that is safe to emit.

    Decoding uses a sliding window (prefix / read offsets, as TGI and vLLM do) so a token that
    completes a multi-byte character is emitted only once the character is whole. Text that could be
    the start of a stop string is held back; when a stop string appears, the text before it is
    emitted and the assembler reports ``stopped``. The stop string itself is never returned.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._text = ""  # everything decoded so far
        self._emitted = 0  # characters of _text already returned
        self.stopped = False
        self.stopped_by: str | None = None  #: the stop string that ended the text (vLLM's ``stop_reason``)

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (end of generation)."""
        if not self.stopped and self._read < len(self._ids):
            tail = self._decode(self._ids[self._prefix :])[len(self._decode(self._ids[self._prefix : self._read])) :]
            self._text += tail.rstrip("\ufffd")
            self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            longest = max(len(s) for s in self._stop)
            search_from = max(0, self._emitted - longest + 1)
            hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits)
                self.stopped_by = next(s for s in self._stop if self._text.find(s, search_from) == cut)
                out = self._text[self._emitted : cut]
                self._text = self._text[:cut]
                self._emitted = cut
                self.stopped = True
                return out
        end = len(self._text)
        if not final and self._stop:
            end -= self._held_back()
        out = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text) - self._emitted), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best
