"""The progress bar of ``Pipeline.map(..., progress=True)``: finished chunks, shown with
tqdm when it is installed (an optional extra, imported at the first bar), else as one
line on stderr rewritten in place."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Protocol

__all__ = ["Bar", "LineBar", "make_bar"]


class Bar(Protocol):
    """What a map needs of a progress bar (a tqdm bar has both)."""

    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


#: The line bar rewrites its line at most this often (the last chunk always shows).
LINE_INTERVAL_S = 0.1


class LineBar:
    """``ctxkit map: 12/40 chunks (30%)`` on *stream* (default stderr), rewritten in place
    with a carriage return; safe to update from several drain threads."""

    def __init__(self, total: int, desc: str = "ctxkit map", stream: Any = None) -> None:
        self.total = total
        self.desc = desc
        self.n = 0
        self._stream = stream
        self._lock = threading.Lock()
        self._shown = 0.0
        self._closed = False
        self._draw()

    def update(self, n: int = 1) -> None:
        """*n* more chunks finished."""
        with self._lock:
            self.n += n
            now = time.monotonic()
            if self.n >= self.total or now - self._shown >= LINE_INTERVAL_S:
                self._shown = now
                self._draw()

    def close(self) -> None:
        """Show the final count and end the line. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._draw()
            self._out().write("\n")
            self._out().flush()

    def _out(self) -> Any:
        return self._stream if self._stream is not None else sys.stderr

    def _draw(self) -> None:
        pct = 100 * self.n // self.total if self.total else 100
        out = self._out()
        out.write(f"\r{self.desc}: {self.n}/{self.total} chunks ({pct}%)")
        out.flush()


def make_bar(total: int, desc: str = "ctxkit map") -> Bar:
    """A bar counting *total* chunks: ``tqdm.tqdm`` when importable, else :class:`LineBar`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineBar(total, desc)
    bar: Bar = tqdm(total=total, desc=desc, unit="chunk")
    return bar
