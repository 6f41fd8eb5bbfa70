"""Just-in-time page-locking of the user's pageable arrays (``host_path="register"``).

The whole pages of each chunk (:func:`ctxkit.pipeline.plan.host_pieces`) are registered with
``cuMemHostRegister(PORTABLE)`` on the host pool a few chunks ahead of the feeder, the
chunk's DMA runs straight from/to them, and the drain thread unregisters them once the
chunk's D2H has completed. A page is registered by at most one chunk at a time, and
:meth:`Registrar.finish` undoes every registration of a device before its run returns,
also after an error or Ctrl-C.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from .._driver import describe, drv
from ..context import Context
from ..trace import Recorder
from .hostthreads import HostPool, thread_label

__all__ = [
    "NO_USABLE_CONTEXT",
    "REGISTER_PORTABLE",
    "REGISTER_READ_ONLY",
    "Registrar",
    "Segment",
    "register_pages",
    "relaxed_capture",
    "unregister_pages",
]


REGISTER_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: usable by every context


REGISTER_READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY: the device only reads it


_ALREADY_REGISTERED = 712


NO_USABLE_CONTEXT = -1


def register_pages(ptr: int, nbytes: int, read_only: bool) -> int:
    """``cuMemHostRegister(PORTABLE)`` of whole pages in the current context; memory the
    device only reads is retried ``READ_ONLY`` (read-only mappings refuse the first).
    Returns the CUresult as an int."""
    (err,) = drv.cuMemHostRegister(ptr, nbytes, REGISTER_PORTABLE)
    if err and read_only and int(err) != _ALREADY_REGISTERED:
        (err,) = drv.cuMemHostRegister(ptr, nbytes, REGISTER_PORTABLE | REGISTER_READ_ONLY)
    return int(err)


@contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread's stream-capture mode relaxed for the block
    (``cuThreadExchangeStreamCaptureMode``): an unsafe call such as
    ``cuMemHostUnregister`` then neither fails nor invalidates a capture open in this
    thread or, in global mode, in another one. A driver that cannot exchange the mode
    leaves it as it was."""
    try:
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        err, previous = drv.cuThreadExchangeStreamCaptureMode(mode)
    except Exception:
        err, previous = 1, None
    try:
        yield
    finally:
        if not err:
            drv.cuThreadExchangeStreamCaptureMode(previous)


def unregister_pages(ptr: int, contexts: Iterable[Context]) -> int:
    """``cuMemHostUnregister(ptr)`` now, in relaxed capture mode, in the first usable
    context of *contexts* (a ``PORTABLE`` registration is known to every context, so a
    closed or poisoned one can be stood in for). Returns the CUresult as an int, or
    :data:`NO_USABLE_CONTEXT`."""
    for ctx in contexts:
        if ctx.closed or ctx.poisoned:
            continue
        try:
            with ctx, relaxed_capture():
                (err,) = drv.cuMemHostUnregister(ptr)
        except Exception:
            continue
        return int(err)
    return NO_USABLE_CONTEXT


class Segment:
    """Whole pages ``[ptr, ptr + nbytes)`` of a user array, registered for one chunk."""

    __slots__ = ("_reg", "_unreg", "chunk", "ctx", "device", "error", "nbytes", "ptr", "read_only")

    def __init__(
        self, ctx: Context, device: int, chunk: int, ptr: int, nbytes: int, read_only: bool
    ) -> None:
        self.ctx = ctx
        self.device = device
        self.chunk = chunk
        self.ptr = ptr
        self.nbytes = nbytes
        self.read_only = read_only
        self.error = ""
        self._reg: Future[bool] | None = None
        self._unreg: Future[None] | None = None

    def __repr__(self) -> str:
        return f"<Segment {self.ptr:#x}+{self.nbytes} chunk={self.chunk} device={self.device}>"


class Registrar:
    """Registers segments on a :class:`HostPool` and unregisters them after their DMA.

    Parameters
    ----------
    pool : HostPool
        Threads that run the (blocking) driver calls in parallel.
    stop : threading.Event
        Set when the run stops: registrations not started yet are skipped.
    recorder : Recorder, optional
        Gets a ``register``/``unregister`` host interval per call.
    """

    def __init__(self, pool: HostPool, stop: threading.Event, recorder: Recorder | None) -> None:
        self.pool = pool
        self.stop = stop
        self.rec = recorder
        self._lock = threading.Lock()
        self._segments: dict[int, list[Segment]] = {}

    def register(self, seg: Segment) -> None:
        """Queue the registration of *seg* (see :meth:`wait`)."""
        with self._lock:
            self._segments.setdefault(seg.device, []).append(seg)
        seg._reg = self.pool.submit(self._register, seg)

    def register_here(self, seg: Segment, claim: Callable[[], bool]) -> bool:
        """Register *seg* in the calling thread if ``claim()`` (called under the
        registrar's lock, so the two cannot cross :meth:`finish`) says so; False when it
        did not (then *seg* is not the registrar's)."""
        fut: Future[bool] = Future()
        seg._reg = fut  # before claim(): whoever sees the segment may wait for it
        with self._lock:
            if not claim():
                return False
            self._segments.setdefault(seg.device, []).append(seg)
        try:
            ok = self._register(seg)
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        fut.set_result(ok)
        return True

    def wait(self, seg: Segment) -> bool:
        """Wait for *seg*'s registration: True when its pages are locked; False when the
        driver refused (``seg.error`` says why) or the run stopped first."""
        assert seg._reg is not None
        return seg._reg.result()

    def release(self, seg: Segment) -> None:
        """Queue the unregistration of a registered *seg* whose DMA has completed."""
        if seg._unreg is None and self.wait(seg):
            seg._unreg = self.pool.submit(self._unregister, seg, urgent=False)

    def finish(self, device: int) -> list[BaseException]:
        """Once *device*'s streams are idle: wait for each of its registrations, undo
        those never released, wait for every unregistration; return the failures."""
        with self._lock:
            segments = self._segments.pop(device, [])
        errors: list[BaseException] = []
        for seg in segments:
            try:
                if seg._unreg is not None:
                    seg._unreg.result()
                elif self.wait(seg):
                    self._unregister(seg)
            except BaseException as exc:
                errors.append(exc)
        return errors

    def _register(self, seg: Segment) -> bool:
        if self.stop.is_set():
            seg.error = "the run stopped"
            return False
        t0 = time.perf_counter()
        try:
            with seg.ctx:
                err = register_pages(seg.ptr, seg.nbytes, seg.read_only)
        except Exception as exc:
            seg.error = f"{type(exc).__name__}: {exc}"
            return False
        self._trace("register", seg, t0)
        if err:
            seg.error = describe(int(err))[0]
            return False
        return True

    def _unregister(self, seg: Segment) -> None:
        t0 = time.perf_counter()
        with seg.ctx:
            err = unregister_pages(seg.ptr, (seg.ctx,))
        self._trace("unregister", seg, t0)
        if err:
            raise seg.ctx.note_error(
                err, f"cuMemHostUnregister({seg.ptr:#x}) of {seg.nbytes} bytes of chunk {seg.chunk}"
            )

    def _trace(self, name: str, seg: Segment, t0: float) -> None:
        if self.rec is not None:
            self.rec.host(name, seg.device, thread_label(), seg.chunk, t0, time.perf_counter())
