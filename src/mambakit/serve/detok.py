"""Token ids to text as they arrive, and the stop strings that end a choice.

`Detokenizer` gives the text of each new token once it is whole: an incomplete UTF-8
sequence (byte tokenizer) or a piece a tokenizer decodes to U+FFFD is held until the
tokens that complete it arrive. `StopText` holds back the end of the text that may be
the start of a stop string, and cuts the text where a stop string first appears.
"""

from __future__ import annotations

import codecs

from ..text import ByteTokenizer


class Detokenizer:
    """Incremental decoding of one choice's tokens, after its prompt."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.byte = isinstance(tokenizer, ByteTokenizer)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # a few prompt tokens decoded along, so that word-initial spaces come out right
        self.ids = list(prompt_ids[-4:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        if self.tok is None:
            return ""
        if self.byte:
            return self.utf8.decode(bytes([token]))
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before) :]
        return ""

    def flush(self) -> str:
        if self.tok is None:
            return ""
        if self.byte:
            return self.utf8.decode(b"", final=True)
        text = self.tok.decode(self.ids[self.prefix :])
        return text[len(self.tok.decode(self.ids[self.prefix : self.read])) :]


class StopText:
    """The text of one choice with its stop strings: `add` returns what may be sent now."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, piece: str) -> str:
        """Append `piece`; the text that can be sent (up to a stop string, when one is now
        complete: then `stopped` is set)."""
        if not piece:
            return ""
        start = max(0, len(self.text) - self.hold)  # a stop string may straddle the join
        self.text += piece
        if self.stops:
            cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0),
                      default=-1)  # fmt: skip
            if cut >= 0:
                self.stopped = True
                self.text = self.text[:cut]
                return self.flush()
        end = len(self.text) - self.hold if self.stops else len(self.text)
        return self._upto(end)

    def flush(self) -> str:
        """The held-back rest (the choice has ended)."""
        return self._upto(len(self.text))

    def _upto(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out
