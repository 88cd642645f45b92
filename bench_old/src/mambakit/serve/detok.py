"""Token ids to text as they arrive, and the stop strings that end a choice.

(`mambakit.text.TextStream` gives the text of each new token once it is whole.)
`StopText` holds back the end of the text that may be
the start of a stop string, and cuts the text where a stop string first appears.
"""

from __future__ import annotations


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
