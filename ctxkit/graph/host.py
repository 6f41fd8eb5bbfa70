"""Python callbacks of graph host nodes: one C trampoline, a key per callback.

A host node runs at every launch of every executable graph made from its graph, so its
callback is not popped when it runs (unlike ``Stream.launch_host_func``'s): it stays in
:data:`_callbacks` while the :class:`HostCallback` object lives, and the graphs and
executable graphs that use it hold that object. A key whose callback is gone (its graph
and every executable graph of it were dropped while a launch was still queued) is
skipped.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["HOST_FN_ADDR", "HostCallback"]

log = logging.getLogger("ctxkit.graph")

_callbacks: weakref.WeakValueDictionary[int, HostCallback] = weakref.WeakValueDictionary()
_keys = itertools.count(1)


class HostCallback:
    """``fn(*args)`` for a host node, and where an exception it raises goes.

    The exception is handed to the ctxkit stream of the latest launch (re-raised by its
    next ``synchronize()``, like ``Stream.launch_host_func``'s), or logged when that
    launch was on a foreign or the legacy default stream.
    """

    __slots__ = ("__weakref__", "args", "fn", "key", "stream_ref")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.key = next(_keys)
        self.stream_ref: weakref.ref[Any] | None = None
        _callbacks[self.key] = self

    def run(self) -> None:
        try:
            self.fn(*self.args)
        except BaseException as exc:
            self.report(exc)

    def report(self, exc: BaseException) -> None:
        ref = self.stream_ref
        stream = ref() if ref is not None else None
        errors = getattr(stream, "_callback_errors", None)
        if stream is None or errors is None:
            log.error("graph host node %r raised", self.fn, exc_info=exc)
            return
        with stream._lock:
            stream._callback_errors.append(exc)

    def __repr__(self) -> str:
        return f"<HostCallback {self.key} {self.fn!r}>"


def _run_host_node(key: int | None) -> None:
    cb = _callbacks.get(key or 0)
    if cb is not None:
        cb.run()


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_run_host_node)

#: address of the one C trampoline every host node calls (its userData is the key)
HOST_FN_ADDR: int = ctypes.cast(_HOST_FN, ctypes.c_void_p).value or 0
