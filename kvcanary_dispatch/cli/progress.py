"""A one-line progress display on stderr for the command line (no dependency).

On a terminal the line is redrawn in place (``\\r``); elsewhere (a pipe, a CI log) a plain line
is written at most every ``every_s`` seconds, so logs stay short.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


def fmt_duration(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``)."""
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """``update(done, text)`` redraws ``[####....] done/total  text  elapsed, ~left``;
    ``total=None`` draws no bar and no estimate. ``close()`` ends the line."""

    def __init__(
        self,
        total: int | None,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        every_s: float = 10.0,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.start = time.perf_counter()
        self._last_plain = -every_s
        self._drawn = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, done: int, text: str) -> str:
        el = self.elapsed()
        parts = []
        if self.total:
            width = 20
            fill = min(width, width * done // self.total)
            parts.append(f"[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total}")
        else:
            parts.append(str(done))
        if text:
            parts.append(text)
        timing = fmt_duration(el)
        if self.total and 0 < done < self.total:
            timing += f", ~{fmt_duration(el / done * (self.total - done))} left"
        parts.append(timing)
        return "  ".join(parts)

    def update(self, done: int, text: str = "") -> None:
        if not self.enabled:
            return
        line = self.line(done, text)
        if self.tty:
            cols = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + line[: cols - 1].ljust(cols - 1))
            self._drawn = True
        elif self.elapsed() - self._last_plain >= self.every_s:
            self.stream.write(line + "\n")
            self._last_plain = self.elapsed()
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False
