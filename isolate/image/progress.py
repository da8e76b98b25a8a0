"""A pull's progress: a bar redrawn in place on a terminal, one line of figures at the end everywhere.

On a terminal (and ``TERM`` not ``dumb``) the bar shows the bytes fetched of
the layers this pull fetches (their sizes from the manifest), the layers done,
and the seconds so far, redrawn on one line ten times a second; at the end it
is replaced by the line of figures. Elsewhere (a pipe, a log, a file) only
that line is written: no carriage returns or escapes in a log.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TextIO

INTERVAL = 0.1
_CLEAR = "\r\x1b[K"  # to the line's start, and erase it: the bar is redrawn in place


def is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


def _columns(out: TextIO) -> int:
    try:
        return os.get_terminal_size(out.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f}"


class PullProgress:
    """What one pull shows on ``out``: ``fetched()`` gives the bytes read so far, ``done()`` the layers
    finished; ``total`` bytes and ``layers`` layers are what this pull fetches."""

    def __init__(self, out: TextIO, reference: str, *, total: int, layers: int, fetched: Callable[[], int],
                 done: Callable[[], int]) -> None:
        self.out, self.reference, self.total, self.layers = out, reference, total, layers
        self.fetched, self.done = fetched, done
        self.terminal = is_terminal(out)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def __enter__(self) -> PullProgress:
        if self.terminal:
            self._draw()
            self._thread = threading.Thread(target=self._tick, name="isolate-pull-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.terminal and kind is None:
            self._draw()  # the bar at its end, before the figures take its place
        if self._drawn:
            with self._lock:
                self.out.write(_CLEAR)  # an error's line, or the figures, start on a clean line
                self.out.flush()

    def _tick(self) -> None:
        while not self._stop.wait(INTERVAL):
            self._draw()

    def bar(self, width: int) -> str:
        """The bar's line, at most ``width`` characters."""
        fetched = self.fetched()
        fraction = 1.0 if self.total <= 0 else min(1.0, fetched / self.total)
        figures = (f" {fraction * 100:3.0f}%  {_megabytes(fetched)}/{_megabytes(self.total)} MB  "
                   f"{self.done()}/{self.layers} layers  {time.monotonic() - self.started:.1f} s")
        name = self.reference
        cells = max(10, min(40, width - len(name) - len(figures) - 4))
        room = width - cells - len(figures) - 4
        if len(name) > room:
            name = "..." + name[len(name) - max(room - 3, 0):] if room > 3 else ""
        filled = int(fraction * cells)
        line = f"{name} [{'#' * filled}{'.' * (cells - filled)}]{figures}"
        return line[:width]

    def _draw(self) -> None:
        line = self.bar(_columns(self.out) - 1)  # the last column would wrap on some terminals
        with self._lock:
            try:
                self.out.write(_CLEAR + line)
                self.out.flush()
                self._drawn = True
            except (OSError, ValueError):
                self.terminal = False  # the terminal went away: the figures line still tries

    def figures(self, layers: int) -> str:
        """The one line of figures: bytes, layers, seconds, MB/s."""
        seconds = time.monotonic() - self.started
        fetched = self.fetched()
        return (f"pull {self.reference}: {layers} layer{'s' if layers != 1 else ''}, {_megabytes(fetched)} MB "
                f"fetched in {seconds:.2f} s ({fetched / 1e6 / max(seconds, 1e-6):.1f} MB/s)")


__all__ = ["PullProgress", "is_terminal"]
