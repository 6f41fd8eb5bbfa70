"""The driver's stream-capture rules, graphs and libraries for tests/support/fakegpu.py.

Work enqueued on a capturing stream becomes graph nodes instead of running. A call that
is unsafe during capture (allocation, free, unload, a synchronous copy, work on the
legacy default stream, ``cuCtxSynchronize``) made by a thread the capture's mode forbids
-- the capturing thread in ``thread_local``/``global`` mode, every thread while a
``global`` capture is open -- fails with ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` and
invalidates the capture, as does waiting for the capturing stream in any mode;
``cuStreamEndCapture`` then fails with ``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``. A thread
relaxes what it may call with ``cuThreadExchangeStreamCaptureMode`` (its own interaction
mode, ``global`` by default, as on the driver). A capturing stream that waits for an event
recorded outside its capture fails with ``CUDA_ERROR_STREAM_CAPTURE_ISOLATION`` and
invalidates the capture (measured on an H200: every mode).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as _real

from tests.support.fakedriver import FakeHandle
from tests.support.fakegraph import FakeGraph, GraphNodes, Node

INVALID_VALUE = 1
INVALID_HANDLE = 400
ILLEGAL_STATE = 401
STREAM_CAPTURE_UNSUPPORTED = 900
STREAM_CAPTURE_INVALIDATED = 901
STREAM_CAPTURE_ISOLATION = 905
STREAM_CAPTURE_IMPLICIT = 906
STREAM_CAPTURE_WRONG_THREAD = 908
STREAM_NON_BLOCKING = 1
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2
LEGACY_STREAMS = (0, 1)  # the legacy default stream and CU_STREAM_LEGACY
_KERNEL = _real.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
_capture_ids = itertools.count(1)


class Capture:
    """One open ``cuStreamBeginCapture`` .. ``cuStreamEndCapture`` sequence."""

    def __init__(self, stream: int, ctx: int, mode: int, blocking: bool) -> None:
        self.stream = stream
        self.ctx = ctx
        self.mode = mode
        self.blocking = blocking
        self.id = next(_capture_ids)
        self.tid = threading.get_ident()
        self.thread = threading.current_thread().name
        self.nodes: list[Callable[[], None]] = []
        self.invalidated_by = ""

    def forbids(self, tid: int, thread_mode: int = CAPTURE_GLOBAL) -> bool:
        """True when an unsafe call made by thread *tid*, whose interaction mode is
        *thread_mode*, conflicts with this capture."""
        if thread_mode == CAPTURE_RELAXED:
            return False
        if tid == self.tid:
            return self.mode != CAPTURE_RELAXED
        return self.mode == CAPTURE_GLOBAL and thread_mode == CAPTURE_GLOBAL


class CaptureRules(GraphNodes):
    """Mixed into FakeGPU, which supplies ``streams`` (with ``ctx``/``flags``),
    ``current()``, ``_handles`` and ``_submit``; explicitly built graphs come from
    tests/support/fakegraph.py."""

    def init_capture_rules(self) -> None:
        self.captures: dict[int, Capture] = {}  # stream handle -> its open capture
        self.invalidations: list[str] = []  # what invalidated which capture
        self.after_begin_capture: Callable[[], None] | None = None
        self.thread_modes: dict[int, int] = {}  # cuThreadExchangeStreamCaptureMode
        self.init_graph_nodes()
        self.libraries: set[int] = set()
        # Re-entrant: a collection inside a locked section may run a finalizer (a module
        # unload, a free) that asks the capture rules again in the same thread.
        self._clock = threading.RLock()

    def _invalidate(self, cap: Capture, why: str) -> None:
        if not cap.invalidated_by:
            cap.invalidated_by = why
            self.invalidations.append(
                f"{why} (thread {threading.current_thread().name!r}) invalidated the "
                f"capture of stream {cap.stream:#x} begun in thread {cap.thread!r}"
            )

    def unsafe(self, what: str) -> int:
        """A call that is unsafe during stream capture: refused, and the captures that
        forbid it in this thread are invalidated (0 when no capture forbids it)."""
        tid = threading.get_ident()
        mode = self.thread_modes.get(tid, CAPTURE_GLOBAL)
        with self._clock:
            hit = [c for c in list(self.captures.values()) if c.forbids(tid, mode)]
            for cap in hit:
                self._invalidate(cap, what)
        return STREAM_CAPTURE_UNSUPPORTED if hit else 0

    def _legacy(self, what: str, unsafe: bool = True) -> int:
        """Work on (or a wait for) the legacy default stream: unsafe (not so an event
        record: *unsafe* False), and an implicit dependency on every capturing *blocking*
        stream of the context."""
        err = self.unsafe(f"{what} on the legacy default stream") if unsafe else 0
        ctx = self.current()
        with self._clock:
            joined = [c for c in list(self.captures.values()) if c.blocking and c.ctx == ctx]
            for cap in joined:
                self._invalidate(cap, f"{what} on the legacy default stream")
        return err or (STREAM_CAPTURE_IMPLICIT if joined else 0)

    def _conflicts(self, h: Any, what: str) -> int:
        """Waiting for a capturing stream conflicts with its capture in every mode."""
        cap = self.captures.get(int(h))
        if cap is None:
            return 0
        with self._clock:
            self._invalidate(cap, what)
        return STREAM_CAPTURE_UNSUPPORTED

    def isolation(self, h: Any, captured_by: Capture | None) -> int:
        """A wait of stream *h* for an event recorded in *captured_by* (``None``: outside
        any capture): ``CUDA_ERROR_STREAM_CAPTURE_ISOLATION`` when *h* captures and the
        event is not of its capture (the capture is invalidated), else 0."""
        cap = self.captures.get(int(h))
        if cap is None or captured_by is cap:
            return 0
        with self._clock:
            self._invalidate(cap, "cuStreamWaitEvent for uncaptured work")
        return STREAM_CAPTURE_ISOLATION

    def cuThreadExchangeStreamCaptureMode(self, mode: Any) -> tuple[int, Any]:
        tid = threading.get_ident()
        prev = self.thread_modes.get(tid, CAPTURE_GLOBAL)
        self.thread_modes[tid] = int(mode)
        return (0, _real.CUstreamCaptureMode(prev))

    def _capture_status(self, h: Any) -> tuple[int, Capture | None]:
        cap = self.captures.get(int(h))
        if cap is None:
            return 0, None
        return (2 if cap.invalidated_by else 1), cap

    def cuStreamIsCapturing(self, h: Any) -> tuple[int, Any]:
        status, _cap = self._capture_status(h)
        return (0, _real.CUstreamCaptureStatus(status))

    def cuStreamGetCaptureInfo(self, h: Any) -> tuple[Any, ...]:
        status, cap = self._capture_status(h)
        cid = 0 if cap is None else cap.id
        return (0, _real.CUstreamCaptureStatus(status), cid, None, [], [], 0)

    def cuStreamBeginCapture(self, h: Any, mode: Any) -> tuple[int]:
        key = int(h)
        if key in (0, 1, 2):
            return (STREAM_CAPTURE_UNSUPPORTED,)
        s = self.streams.get(key)
        if s is None:
            return (INVALID_HANDLE,)
        with self._clock:
            if key in self.captures:
                return (ILLEGAL_STATE,)
            blocking = not s.flags & STREAM_NON_BLOCKING
            self.captures[key] = Capture(key, s.ctx, int(mode), blocking)
        hook = self.after_begin_capture
        if hook is not None:
            self.after_begin_capture = None
            hook()
        return (0,)

    def cuStreamEndCapture(self, h: Any) -> tuple[int, FakeHandle | None]:
        key = int(h)
        with self._clock:
            cap = self.captures.get(key)
            if cap is None:
                return (ILLEGAL_STATE, None)
            if cap.mode != CAPTURE_RELAXED and cap.tid != threading.get_ident():
                return (STREAM_CAPTURE_WRONG_THREAD, None)
            del self.captures[key]
        if cap.invalidated_by:
            return (STREAM_CAPTURE_INVALIDATED, None)
        g = FakeHandle(next(self._handles))
        graph = FakeGraph(cap.ctx)
        for i, op in enumerate(cap.nodes):  # one stream: each node after the one before
            graph.nodes.append(Node(_KERNEL, [i - 1] if i else [], op))
        self.graphs[int(g)] = graph
        return (0, g)

    # --- graphs ----------------------------------------------------------------------

    def cuGraphUpload(self, exe: Any, h: Any) -> tuple[int]:
        if int(exe) not in self.graphs:
            return (INVALID_VALUE,)
        if int(h) in LEGACY_STREAMS:
            return (self._legacy("cuGraphUpload"),)
        return (0,)

    def cuGraphDestroy(self, g: Any) -> tuple[int]:
        err = self.unsafe("cuGraphDestroy")
        if err:
            return (err,)
        return (0,) if self.graphs.pop(int(g), None) is not None else (INVALID_VALUE,)

    def cuGraphExecDestroy(self, exe: Any) -> tuple[int]:
        err = self.unsafe("cuGraphExecDestroy")
        if err:
            return (err,)
        return (0,) if self.graphs.pop(int(exe), None) is not None else (INVALID_VALUE,)

    # --- libraries (context-independent modules) ----------------------------------------

    def cuLibraryLoadData(self, code: Any, *args: Any) -> tuple[int, FakeHandle | None]:
        err = self.unsafe("cuLibraryLoadData")
        if err:
            return (err, None)
        h = FakeHandle(next(self._handles))
        self.libraries.add(int(h))
        return (0, h)

    def cuLibraryUnload(self, lib: Any) -> tuple[int]:
        err = self.unsafe("cuLibraryUnload")
        if err:
            return (err,)
        if int(lib) not in self.libraries:
            return (INVALID_HANDLE,)
        self.libraries.discard(int(lib))
        return (0,)

    def cuLibraryGetKernel(self, lib: Any, name: bytes) -> tuple[int, FakeHandle | None]:
        if int(lib) not in self.libraries:
            return (INVALID_HANDLE, None)
        h = FakeHandle(next(self._handles))
        self.kernel_names[int(h)] = name.decode() if isinstance(name, bytes) else str(name)
        return (0, h)
