"""Stop-sequence matching over streamed text deltas, one checker per request.

Streamed text is never taken back, so text that could still turn out to be the start of a
stop sequence is held until the next deltas decide it. A stop sequence can be split over any
number of tokens and plans; the checker only ever looks at the held text plus the new delta,
because an occurrence cannot start inside text that was already released.

When several stop sequences match, the one that starts earliest in the text wins, and on a
tie the longest. A complete match is therefore reported only once no other stop sequence
could still complete at an earlier (or the same, and longer) position; until then the text
from that position on is held too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


class StopChecker:
    """Finds the first stop sequence in a request's streamed text."""

    __slots__ = ("_stops", "_include", "_first_chars", "_first_char_re", "_prefixes", "_max_len",
                 "_pending", "_done", "matched")

    def __init__(self, stop_sequences: Sequence[str], include_stop_sequence: bool) -> None:
        # Longest first, so that among matches at one position the longest is seen first.
        self._stops: tuple[str, ...] = tuple(
            sorted({s for s in stop_sequences if s}, key=len, reverse=True)
        )
        self._include = include_stop_sequence
        self._first_chars: frozenset[str] = frozenset(s[0] for s in self._stops)
        # One C-level scan per delta for the common case of text that cannot start a stop.
        chars = "".join(re.escape(c) for c in sorted(self._first_chars))
        self._first_char_re = re.compile(f"[{chars}]" if chars else "(?!)")
        # Every proper prefix of every stop: text ending in one of these may still complete it.
        self._prefixes: frozenset[str] = frozenset(
            s[:k] for s in self._stops for k in range(1, len(s))
        )
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self._done = False
        self.matched: str | None = None  # the stop sequence found, once one is

    @property
    def finished(self) -> bool:
        return self._done

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add the next text delta. Returns (text safe to emit now, matched stop or None);
        after a match the checker is finished and later feeds return ("", None)."""
        if self._done:
            return "", None
        if not self._stops:
            return delta, None
        if not self._pending and self._first_char_re.search(delta) is None:
            return delta, None  # nothing here can begin a stop sequence
        text = self._pending + delta
        match = self._earliest_match(text)
        hold = self._hold_start(text)
        if match is not None and hold > match[0]:
            return self._finish(text, match)
        # No match yet, or an earlier/longer candidate might still complete: keep waiting.
        self._pending = text[hold:]
        return text[:hold], None

    def flush(self) -> str:
        """End of request without a reported match: release the held text. If the held text
        already contains a stop sequence (one that was waiting on a longer or earlier
        candidate), the text is cut there and `matched` is set."""
        if self._done:
            return ""
        text, self._pending = self._pending, ""
        match = self._earliest_match(text) if text and self._stops else None
        if match is not None:
            return self._finish(text, match)[0]
        self._done = True
        return text

    def _finish(self, text: str, match: tuple[int, str]) -> tuple[str, str]:
        start, stop = match
        self._done = True
        self._pending = ""
        self.matched = stop
        end = start + len(stop) if self._include else start
        return text[:end], stop

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:  # longest first: a later stop wins only if strictly earlier
            i = text.find(stop)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _hold_start(self, text: str) -> int:
        """Smallest position whose suffix is a proper prefix of some stop (else len(text))."""
        n = len(text)
        best = n
        start = max(0, n - self._max_len + 1)
        for c in self._first_chars:
            j = text.find(c, start, best)
            while j != -1:
                if text[j:] in self._prefixes:
                    best = j
                    break
                j = text.find(c, j + 1, best)
        return best
