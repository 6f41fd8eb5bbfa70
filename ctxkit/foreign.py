"""Streams and contexts ctxkit did not create.

The handle of another library's stream object (``__cuda_stream__``, a CuPy stream's
``.ptr``, a PyTorch stream's ``.cuda_stream``, a ``CUstream`` or an int), and the ctxkit
:class:`~ctxkit.context.Context` of a raw ``CUstream`` or ``CUcontext`` made anywhere:
what the stream resolver and ``Stream.from_handle`` in :mod:`ctxkit.stream` build on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._driver import drv, from_result
from .context import Context

__all__: list[str] = []


def _foreign_stream_int(obj: Any) -> int:
    if isinstance(obj, bool):
        raise TypeError("a stream cannot be a bool")
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if drv is not None and isinstance(obj, drv.CUstream):
        return int(obj)
    proto = getattr(obj, "__cuda_stream__", None)
    if proto is not None:
        _version, handle = proto() if callable(proto) else proto
        return int(handle)
    for attr in ("ptr", "cuda_stream"):
        value = getattr(obj, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise TypeError(
        f"expected a stream (ctxkit.Stream, CUstream, int handle, an object with "
        f"__cuda_stream__, a CuPy or PyTorch stream) or None, got {type(obj).__name__}"
    )


def _context_of_cu(cu: Any) -> Context:
    """The ctxkit Context for a driver ``CUcontext`` made anywhere."""
    known = Context._known.get(int(cu))
    if known is not None and not known.closed:
        return known
    (err,) = drv.cuCtxPushCurrent(cu)
    if err:
        raise from_result(int(err), f"cuCtxPushCurrent({int(cu):#x})")
    try:
        return Context._adopt_current(cu)
    finally:
        drv.cuCtxPopCurrent()


def _context_of_stream(handle: Any) -> Context:
    err, cu = drv.cuStreamGetCtx(handle)
    if err:
        raise from_result(int(err), f"cuStreamGetCtx({int(handle):#x})")
    return _context_of_cu(cu)
