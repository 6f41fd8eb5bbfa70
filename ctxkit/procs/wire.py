"""What travels between a ``ctxkit.procs`` parent and its children, and how.

Objects are pickled with protocol 5. Out-of-band buffers (contiguous numpy arrays,
bytearrays) of at least ``threshold`` bytes travel in shared-memory blocks
(:mod:`.shm`), one block each, and the message carries their names; a buffer for which
``/dev/shm`` has no room goes through the pipe instead. The receiver maps a block and
unlinks its name at once (the mapping lives on as the array's memory).

Functions a spawned child cannot import (lambdas, closures, functions typed into a
notebook, a REPL or ``python -c``) are pickled **by value** with cloudpickle when it is
installed (the ``cloudpickle`` extra), imported only then.

A child's exception travels as plain data (:func:`describe_exception`), so one that
cannot be pickled, or whose ``__str__`` raises, is still reported.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import process
from typing import Any

from ..errors import CudaError, DeviceTaskError
from . import shm
from .shm import Part

#: Buffers at least this large travel through shared memory (see ``procs`` for numbers).
SHM_THRESHOLD = 1 << 20


CLOUDPICKLE_HINT = (
    "install cloudpickle to send it by value (pip install cloudpickle, or in a ctxkit "
    'checkout pip install -e ".[cloudpickle]")'
)


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError:
        return None
    return cloudpickle


# --- what can be sent ------------------------------------------------------------------


def by_value_reason(fn: Any) -> str:
    """Why a spawned child could not import *fn* by name ("" when it can)."""
    qual = getattr(fn, "__qualname__", "")
    if "<lambda>" in qual:
        return "a lambda"
    if "<locals>" in qual:
        return "a nested function (closure)"
    if getattr(fn, "__module__", None) == "__main__" and not _main_is_importable():
        return "defined in an interactive session (python -c, a REPL or a notebook)"
    return ""


def _main_is_importable() -> bool:
    main = sys.modules.get("__main__")
    return (
        getattr(main, "__file__", None) is not None or getattr(main, "__spec__", None) is not None
    )


def check_shippable(what: str, fn: Any) -> bool:
    """Refuse, before any process starts, a function a spawned child cannot get.

    Returns ``True`` when *fn* must travel by value (cloudpickle is installed), ``False``
    when it is imported by name in the child.
    """
    if not callable(fn):
        raise TypeError(f"{what}: expected a callable, got {type(fn).__name__}")
    reason = by_value_reason(fn)
    if not reason:
        return False
    if _cloudpickle() is None:
        raise TypeError(
            f"{what}: {fn!r} is {reason}, which a spawned process cannot import by name. "
            f"Define it at module level in a file and import it from there, or {CLOUDPICKLE_HINT}"
        )
    return True


def check_main(what: str) -> None:
    """Refuse a main module that a spawned child cannot re-run (read from standard input).

    A spawned child re-runs the parent's main module from its file before it unpickles
    anything; with ``python -`` there is no file and the child dies at start-up.
    """
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None:
        return
    shown = getattr(main, "__file__", None)
    if shown is None:
        return
    path = str(shown)
    origin = getattr(process, "ORIGINAL_DIR", None)  # where multiprocessing resolves it
    if not os.path.isabs(path) and origin is not None:
        path = os.path.join(origin, path)
    if not os.path.isfile(path):
        raise RuntimeError(
            f"{what}: the main module {shown!r} is not a file, so a spawned process "
            "cannot re-run it (the program was read from standard input: `python -`). Save "
            "the program to a file and run `python file.py`, or run it with `python -c` or in a "
            "notebook (functions defined there are sent by value with cloudpickle)"
        )


# --- encoding --------------------------------------------------------------------------


def _dumps(obj: Any, by_value: bool, buffer_callback: Any) -> bytes:
    if by_value:
        cp = _cloudpickle()
        if cp is not None:
            return bytes(cp.dumps(obj, protocol=5, buffer_callback=buffer_callback))
    return pickle.dumps(obj, protocol=5, buffer_callback=buffer_callback)


def dumps(what: str, obj: Any, by_value: bool = False) -> bytes:
    """Pickle *obj* whole (no shared memory); ``TypeError`` naming *what* when it cannot be."""
    try:
        return _dumps(obj, by_value, None)
    except Exception as exc:
        raise _not_picklable(what, exc) from exc


def _not_picklable(what: str, exc: Exception) -> TypeError:
    return TypeError(
        f"{what}: the function and its arguments must be picklable to reach a spawned "
        f"process, but pickling failed: {exc}"
    )


class Payload:
    """A pickled task whose large buffers are not copied anywhere yet.

    ``data`` is the pickle; ``buffers`` its out-of-band buffers, views of the caller's
    memory until :meth:`snapshot` copies them. :meth:`parts` puts each buffer in a
    shared-memory block (or, without room, in the message) when the task is sent.
    """

    __slots__ = ("buffers", "data")

    def __init__(self, data: bytes, buffers: list[memoryview | bytearray]) -> None:
        self.data = data
        self.buffers = buffers

    @classmethod
    def build(cls, what: str, obj: Any, threshold: int | None, by_value: bool) -> Payload:
        """Pickle *obj*; buffers of *threshold* bytes or more stay out of band."""
        found: list[pickle.PickleBuffer] = []

        def out_of_band(buf: pickle.PickleBuffer) -> bool:
            if threshold is None or buf.raw().nbytes < max(threshold, 1):
                return True
            found.append(buf)
            return False

        try:
            data = _dumps(obj, by_value, out_of_band)
        except Exception as exc:
            cp = None if by_value else _cloudpickle()
            if cp is None:
                raise _not_picklable(what, exc) from exc
            found.clear()
            try:  # a lambda among the arguments: cloudpickle can send that too
                data = _dumps(obj, True, out_of_band)
            except Exception:
                raise _not_picklable(what, exc) from exc
        return cls(data, [b.raw() for b in found])

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.buffers)

    def snapshot(self) -> None:
        """Copy the buffers out of the caller's memory (the task waits in a queue)."""
        self.buffers = [b if isinstance(b, bytearray) else bytearray(b) for b in self.buffers]

    def parts(
        self, reserve: Callable[[int], bool], unreserve: Callable[[int], None]
    ) -> tuple[list[Part], int]:
        """The buffers as message parts: a block for each buffer ``reserve(nbytes)``
        allows and ``/dev/shm`` has room for, the bytes themselves otherwise.

        Returns the parts and the bytes put in shared memory (reserved, not given back).
        """
        parts: list[Part] = []
        used = 0
        try:
            for buf in self.buffers:
                raw = memoryview(buf).cast("B")
                name = None
                if reserve(raw.nbytes):
                    name = shm.create(raw)
                    if name is None:
                        unreserve(raw.nbytes)
                if name is None:
                    parts.append(bytearray(raw))
                else:
                    parts.append((name, raw.nbytes))
                    used += raw.nbytes
        except BaseException:
            shm.discard(parts)
            unreserve(used)
            raise
        return parts, used

    def release(self) -> None:
        self.buffers = []


def encode(obj: Any, threshold: int | None = SHM_THRESHOLD) -> tuple[bytes, list[Part]]:
    """Pickle *obj* now; buffers of *threshold* bytes or more go to shared-memory blocks,
    or stay in the pickle where ``/dev/shm`` has no room. ``threshold=None``: no blocks."""
    parts: list[Part] = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if threshold is None or raw.nbytes < max(threshold, 1):
            return True
        name = shm.create(raw)
        if name is None:
            return True
        parts.append((name, raw.nbytes))
        return False

    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    except BaseException:
        shm.discard(parts)
        raise
    return data, parts


def decode(data: bytes, parts: Sequence[Part]) -> Any:
    """Inverse of :func:`encode` / :meth:`Payload.parts`; consumes the blocks, also when
    it fails."""
    buffers: list[Any] = []
    try:
        for part in parts:
            buffers.append(shm.attach(*part) if isinstance(part, tuple) else part)
    except BaseException:
        shm.discard(parts[len(buffers) :])
        raise
    return pickle.loads(data, buffers=buffers)


def result_bytes(
    fn: Any, ordinal: int, value: Any, threshold: int | None = SHM_THRESHOLD
) -> tuple[bytes, list[Part]]:
    try:
        return encode(value, threshold)
    except Exception as exc:
        raise TypeError(
            f"the result of {getattr(fn, '__qualname__', fn)!r} on device {ordinal} cannot be "
            f"pickled back to the parent ({exc}); return host data (numpy arrays, numbers), "
            "not device objects"
        ) from exc


# --- errors ----------------------------------------------------------------------------


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What the parent needs to rebuild a child's exception: picklable plain data."""
    pickled: bytes | None
    try:
        pickled = pickle.dumps(exc, protocol=5)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    cls = type(exc)
    cuda = isinstance(exc, CudaError)
    try:
        tb = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    except Exception as inner:
        tb = f"(the traceback could not be formatted: {_safe_str(inner)})"
    return {
        "type": f"{cls.__module__}.{cls.__qualname__}",
        "message": _safe_str(exc),
        "traceback": tb,
        "code": int(getattr(exc, "code", 0) or 0) if cuda else 0,
        "name": str(getattr(exc, "name", "")) if cuda else "",
        "pickled": pickled,
    }


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as inner:
        try:
            why = f"{type(inner).__name__}: {inner}"
        except Exception:
            why = type(inner).__name__
        return f"<str() of this {type(exc).__name__} raised {why}>"


def unpickle_exception(desc: dict[str, Any]) -> BaseException | None:
    """The child's exception object, when it could be pickled; else ``None``."""
    data: bytes | None = desc.get("pickled")
    if data is None:
        return None
    try:
        exc = pickle.loads(data)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def error_from(
    desc: dict[str, Any],
    device: int,
    pid: int | None,
    exitcode: int | None,
    attempts: int,
    head: str,
    kind: str = "exception",
) -> DeviceTaskError:
    tb = desc["traceback"]
    return DeviceTaskError(
        f"{head}: {desc['type']}: {desc['message']}\n--- traceback in child process {pid} ---\n"
        f"{tb.rstrip()}",
        device=device,
        kind=kind,
        pid=pid,
        exitcode=exitcode,
        traceback=tb,
        exception_type=desc["type"],
        child_exception=unpickle_exception(desc),
        attempts=attempts,
        code=desc["code"],
        name=desc["name"],
    )
