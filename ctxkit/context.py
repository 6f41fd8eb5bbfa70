"""CUDA contexts (``CUcontext``) as Python context managers.

The driver keeps one context stack per thread. ctxkit mirrors only what it pushed
itself, in thread-local state, so that

* re-entering the context already on top costs no driver call, and a context another
  library (PyTorch, CuPy, the runtime API) already made current costs one
  ``cuCtxGetCurrent`` instead of a push and a pop,
* every pop is verified against the handle the driver actually popped, and a
  foreign push/pop inside a ``with`` block is reported, never silently "fixed",
* resources can be freed inside their own context from any thread.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from . import _driver, lifetime
from ._driver import call, drv
from .device import Device, plan_partition, set_partitioner
from .errors import (
    STICKY_CODES,
    ContextClosedError,
    ContextInUseError,
    ContextPoisonedError,
    ContextStackError,
    CudaError,
    NoCurrentContextError,
)

__all__ = ["Context", "context_of_cu", "current_context", "partition", "shutting_down"]


class _ThreadState:
    """What ctxkit pushed in one thread.

    ``top`` is the context ctxkit believes current (``None``: unknown or none);
    ``stack`` holds one entry per open ``with``/push: ``(ctx, previous top)`` for a real
    push, the context itself for a re-entry that cost no driver call, and
    ``(ctx, ADOPTED)`` for a context the driver already had current when ctxkit had
    nothing pushed (another library made it current: nothing to push or pop; the exit
    checks it is still current). ``probe``: whether an outermost block first asks the
    driver for its current context (see :class:`Context`).
    """

    __slots__ = ("probe", "stack", "top")

    def __init__(self) -> None:
        self.top: Context | None = None
        self.stack: list[Any] = []
        self.probe = True


#: The second item of a stack entry for a context ctxkit found current and did not push.
ADOPTED: Any = object()


#: Every thread's ``stack`` (of :class:`_ThreadState`), for :func:`thread_bindings`; a
#: thread leaves with its ``Thread`` object.
_all_threads: weakref.WeakKeyDictionary[threading.Thread, list[Any]] = weakref.WeakKeyDictionary()


# Re-entrant: a finalizer run by the collector while this thread holds it may be the
# thread's first use of ctxkit, which lists the thread. Readers iterate over a copy.
_all_lock = threading.RLock()
_driver.renew_at_fork(__name__, "_all_lock", threading.RLock)


per_thread = threading.local()
"""This thread's :class:`_ThreadState` as ``per_thread.s``, set at the thread's first use
(:func:`thread_state`). Launch hot paths read ``per_thread.s.top`` directly, ``None``
standing for a thread that never used ctxkit (nothing ctxkit-current there)."""


_shutting_down = False


def shutting_down() -> bool:
    """True from interpreter exit on (and in a forked child): frees are skipped, the
    process teardown frees."""
    return _shutting_down


def begin_shutdown() -> None:
    """Interpreter exit: from now on frees are skipped (the process teardown frees)."""
    global _shutting_down
    _shutting_down = True


atexit.register(begin_shutdown)


def thread_state() -> _ThreadState:
    """This thread's ctxkit context bookkeeping (internal)."""
    try:
        return per_thread.s  # type: ignore[no-any-return]
    except AttributeError:
        return _first_use()


def _first_use() -> _ThreadState:
    """Give this thread its state and list the thread.

    The garbage collector may run a finalizer -- a free, which needs this state -- at any
    allocation, also while the state is built here: that nested first use builds the
    state, and this one keeps it (``setdefault``).
    """
    st: _ThreadState = per_thread.__dict__.setdefault("s", _ThreadState())
    with _all_lock:
        _all_threads[threading.current_thread()] = st.stack
    return st


def entry_context(entry: Any) -> Context:
    """The context of a ``thread_state().stack`` entry."""
    return entry[0] if type(entry) is tuple else entry


def thread_bindings() -> dict[str, list[Context]]:
    """Contexts ctxkit has bound in each live thread, innermost last, keyed by thread name.

    For diagnostics: foreign pushes (PyTorch, raw cuda.bindings) are not listed.
    """
    with _all_lock:
        states = _all_threads.copy()
    out: dict[str, list[Context]] = {}
    for t, stack in states.items():
        ctxs = [e[0] for e in list(stack) if type(e) is tuple]
        if ctxs:
            out[f"{t.name} ({t.ident})"] = ctxs
    return out


def current_handle() -> int:
    """Handle of this thread's current context according to the driver (0 when none)."""
    top = thread_state().top
    if top is not None:
        return top.handle
    _driver.init()
    return int(call(drv.cuCtxGetCurrent, what="cuCtxGetCurrent"))


def current_context() -> Context | None:
    """This thread's current context as the driver reports it, or ``None``.

    Contexts made current by other libraries (PyTorch, CuPy, raw cuda.bindings) are
    returned too: their primary context is recognised as ``Context.primary(device)``.
    """
    _driver.init()
    cu = call(drv.cuCtxGetCurrent, what="cuCtxGetCurrent")
    return Context._adopt_current(cu) if int(cu) else None


def context_of_cu(cu: Any) -> Context:
    """The ctxkit Context for a driver ``CUcontext`` made anywhere."""
    known = Context._known_open(int(cu))
    if known is not None:
        return known
    call(drv.cuCtxPushCurrent, cu, what=f"cuCtxPushCurrent({int(cu):#x})")
    try:
        return Context._adopt_current(cu)
    finally:
        drv.cuCtxPopCurrent()


class Context:
    """A CUDA context; ``with ctx:`` pushes it on this thread's stack and pops it after.

    Do not construct directly: use :meth:`create` (an owned context, destroyed by
    :meth:`close`), :meth:`primary` (the device's primary context, shared with
    PyTorch, CuPy and Numba; :meth:`close` releases ctxkit's reference), or
    :meth:`green` / :meth:`Device.partition <ctxkit.Device.partition>` (green contexts:
    disjoint sets of SMs of one device; :meth:`close` destroys them).

    Contexts compare and hash by handle. ``with`` blocks nest to any depth and across
    devices; re-entering the context already on top costs no driver call. When ctxkit
    has nothing pushed in the thread and the driver already has this context current
    (PyTorch or CuPy made its primary context current), ``with ctx:`` uses it as it is:
    nothing is pushed or popped, and one ``cuCtxGetCurrent`` at exit checks that it is
    still current. ctxkit asks this at a thread's outermost blocks until it once finds no
    context current there; from then on they push and pop at once, the raw pair's two
    calls (a context another library makes current in that thread later is pushed over,
    and is on top again after the block). A foreign push or pop inside any block is
    reported at its exit with :class:`~ctxkit.errors.ContextStackError`, and the stack is
    left as foreign code left it.

    Attributes
    ----------
    device : Device
        The device the context runs on.
    handle : int
        The ``CUcontext`` value.
    cu : CUcontext
        The driver's ``CUcontext`` object, for driver calls that take a context.
    kind : str
        ``"owned"`` (created here), ``"primary"``, ``"green"`` (an SM partition) or
        ``"foreign"`` (made elsewhere).
    cu_green : CUgreenCtx or None
        The driver's green context of a ``"green"`` context (``cu`` is its
        ``cuCtxFromGreenCtx``); ``None`` for the other kinds.
    closed : bool
        True after :meth:`close`.
    """

    _known: ClassVar[weakref.WeakValueDictionary[int, Context]] = weakref.WeakValueDictionary()
    _primaries: ClassVar[dict[int, Context]] = {}
    _class_lock: ClassVar[threading.RLock] = threading.RLock()

    __slots__ = (
        "__weakref__",
        "_driver_id",
        "_poison",
        "_sm_count",
        "_unusable",
        "closed",
        "cu",
        "cu_green",
        "device",
        "handle",
        "kind",
    )

    def __init__(
        self, cu: Any, device: Device, kind: str, cu_green: Any = None, sm_count: int = 0
    ) -> None:
        self.cu = cu
        self.cu_green = cu_green
        self._sm_count = sm_count
        self.handle = int(cu)
        self.device = device
        self.kind = kind
        self._poison: CudaError | None = None
        self._unusable = False  # closed or poisoned: one flag for the push path
        self.closed = False
        # the driver's unique id of a primary context: after close, tells the context this
        # object retained from a new one at the same handle
        self._driver_id = _driver.context_id(cu) if kind == "primary" else None
        Context._known[self.handle] = self

    # --- construction --------------------------------------------------------------

    @classmethod
    def create(cls, device: Device | int = 0, flags: int = 0) -> Context:
        """Create an owned context on *device* (``cuCtxCreate``).

        The new context is *not* left current: use ``with ctx:``. ``flags`` takes
        ``CUctx_flags`` values (e.g. ``CU_CTX_SCHED_BLOCKING_SYNC``) as an int.
        """
        dev = Device(device)
        try:
            flags = int(flags)  # CUctx_flags members too
        except (TypeError, ValueError):
            raise TypeError(f"flags must be an int of CUctx_flags bits, got {flags!r}") from None
        cu = _driver.ctx_create(flags, dev.handle)
        popped = call(drv.cuCtxPopCurrent, what="cuCtxPopCurrent after cuCtxCreate")
        ctx = cls(cu, dev, "owned")
        if int(popped) != ctx.handle:  # pragma: no cover - driver contract
            raise ContextStackError(
                f"cuCtxCreate left {int(popped):#x} current instead of {ctx.handle:#x}"
            )
        return ctx

    @classmethod
    def primary(cls, device: Device | int = 0) -> Context:
        """The retained primary context of *device*: the one PyTorch/CuPy/Numba use.

        Returns the same object on every call until it is closed.
        """
        dev = Device(device)
        ctx = cls._primaries.get(dev.ordinal)
        if ctx is not None and not ctx.closed:
            return ctx
        with cls._class_lock:
            ctx = cls._primaries.get(dev.ordinal)
            if ctx is None or ctx.closed:
                what = f"cuDevicePrimaryCtxRetain(device={dev.ordinal})"
                cu = call(drv.cuDevicePrimaryCtxRetain, dev.handle, what=what)
                ctx = cls(cu, dev, "primary")
                cls._primaries[dev.ordinal] = ctx
        return ctx

    @classmethod
    def green(cls, device: Device | int, sm_count: int) -> Context:
        """A green context of at least *sm_count* SMs of *device* (rounded up to the
        device's :attr:`~ctxkit.Device.sm_granularity`), for work confined to them:
        ``Device(device).partition([sm_count], remainder=False)[0]``."""
        return Device(device).partition([sm_count], remainder=False)[0]

    @classmethod
    def _known_open(cls, handle: int) -> Context | None:
        """The open Context of *handle* that ctxkit knows already, if any."""
        known = cls._known.get(handle)
        return known if known is not None and not known.closed else None

    @classmethod
    def _adopt_current(cls, cu: Any) -> Context:
        """The Context of *cu*, current in this thread: a known one, the device's primary
        context, or a new wrapper of a context some other library made."""
        known = cls._known_open(int(cu))
        if known is not None:
            return known
        dev = Device(int(call(drv.cuCtxGetDevice, what="cuCtxGetDevice")))
        prim = cls.primary(dev)
        if prim.handle == int(cu):
            return prim
        with cls._class_lock:
            return cls._known_open(int(cu)) or cls(cu, dev, "foreign")

    # --- properties ----------------------------------------------------------------

    @property
    def is_primary(self) -> bool:
        """True for a device's primary context."""
        return self.kind == "primary"

    @property
    def sm_count(self) -> int:
        """The SMs its kernels run on: its partition's (green) or the device's."""
        return self._sm_count or self.device.multiprocessor_count

    @property
    def poisoned(self) -> bool:
        """True once a sticky error (kernel fault) made the context unusable."""
        return self._poison is not None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Context):
            return self.handle == other.handle
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.handle)

    __reduce__ = lifetime.process_local(
        "send the device ordinal (a ck.Device pickles) and use ck.registry.context(n) there"
    )

    def __repr__(self) -> str:
        state = " closed" if self.closed else (" poisoned" if self._poison else "")
        sms = f" sm_count={self._sm_count}" if self._sm_count else ""
        return (
            f"<Context {self.kind} device={self.device.ordinal}{sms} handle={self.handle:#x}"
            f"{state}>"
        )

    # --- push / pop ----------------------------------------------------------------

    def __enter__(self) -> Context:
        try:
            st = per_thread.s
        except AttributeError:
            st = _first_use()
        top = st.top
        if top is self:
            st.stack.append(self)
            return self
        if (self._unusable or (top is None and st.probe)) and self._adopted(st, top):
            return self
        (err,) = drv.cuCtxPushCurrent(self.cu)
        if err:
            raise self.note_error(err, "cuCtxPushCurrent")
        st.stack.append((self, top))
        st.top = self
        return self

    def _adopted(self, st: _ThreadState, top: Context | None) -> bool:
        """``__enter__`` of an unusable context (it raises), or of an outermost block that
        first asks whether the driver has this context current already: True when it is
        (the block then pushes nothing)."""
        self.check_usable()
        if top is None and st.probe:
            err, cu = drv.cuCtxGetCurrent()
            if not err and int(cu) == self.handle:
                st.stack.append((self, ADOPTED))
                st.top = self
                return True
            st.probe = not err and bool(int(cu))  # nothing current: ctxkit owns this stack
        return False

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        try:
            st = per_thread.s
        except AttributeError:
            st = _first_use()
        try:
            entry = st.stack.pop()
        except IndexError:
            entry = None
        if entry is self:
            return
        if type(entry) is not tuple or entry[0] is not self:
            if entry is not None:
                st.stack.append(entry)
            raise self._order_error(st.stack)
        prev = entry[1]
        if prev is ADOPTED:
            self._exit_adopted(st, entry)
            return
        err, popped = drv.cuCtxPopCurrent()
        if err:
            st.top = None
            raise self.note_error(err, "cuCtxPopCurrent")
        # cuda-bindings 13 handles compare by value (a fraction of int()'s cost); 12.8
        # handles by identity, so they are checked with int() when they differ
        if popped != self.cu and int(popped) != self.handle:
            self._restore_foreign(st, entry, popped, popped=True)
        st.top = prev

    def _exit_adopted(self, st: _ThreadState, entry: tuple[Any, ...]) -> None:
        """The exit of a block that found this context current: check it still is."""
        err, cu = drv.cuCtxGetCurrent()
        st.top = None
        if err:
            raise self.note_error(err, "cuCtxGetCurrent")
        if int(cu) != self.handle:
            self._restore_foreign(st, entry, cu, popped=False)

    def push(self) -> None:
        """Make this context current in the calling thread (pair with :meth:`pop`)."""
        self.__enter__()

    def pop(self) -> None:
        """Undo the matching :meth:`push`; verifies the driver popped this context.

        Raises
        ------
        ContextStackError
            The innermost ctxkit push in this thread is another context, or foreign
            code left a different context on top (it is put back; nothing is lost).
        """
        self.__exit__(None, None, None)

    def _order_error(self, stack: list[Any]) -> ContextStackError:
        pop = f"pop of {self!r} in thread {threading.current_thread().name!r}"
        if not stack:
            return ContextStackError(f"{pop}, but ctxkit pushed nothing here")
        return ContextStackError(
            f"{pop}, but the innermost context ctxkit pushed here is "
            f"{entry_context(stack[-1])!r}; pop contexts in reverse order of push "
            "(prefer `with ctx:` blocks)"
        )

    def _restore_foreign(
        self, st: _ThreadState, entry: tuple[Any, ...], top: Any, popped: bool
    ) -> None:
        """Foreign code changed the stack inside this block: leave it as that code left it,
        then report the change.

        *top* is the driver's top where this context was expected: popped by ctxkit
        already (*popped*, a block that pushed) or still on the stack (a block that used
        the context another library made current). If foreign code pushed on top of this
        context, this context is still beneath it, so ctxkit keeps its record: once the
        foreign code pops its context, ``ctx.pop()`` completes. If foreign code popped
        this context, the record is dropped.
        """
        got = int(top)
        st.top = None
        own = entry[1] is not ADOPTED
        prev = entry[1] if own else None
        if not got or (prev is not None and got == prev.handle):
            pushed_over = False  # this context was popped (nothing or the previous is on top)
        else:  # look one entry beneath the top (error path: the calls do not matter)
            if not popped:
                drv.cuCtxPopCurrent()
            _, under = drv.cuCtxGetCurrent()
            pushed_over = int(under) == self.handle
            popped = True
        if popped and got:
            drv.cuCtxPushCurrent(top)
        where = threading.current_thread().name
        if pushed_over:
            st.stack.append(entry)
            detail = (
                "foreign code pushed a context inside the block and did not pop it; this "
                "context is still beneath it: pop the foreign context, then call ctx.pop()"
            )
        else:
            detail = "foreign code popped this context inside the block"
        expected = "expected to pop" if own else "expected to find"
        kept = (
            f"ctxkit put {got:#x} back and did not pop it"
            if own
            else "ctxkit pushed nothing here (another library had made this context current)"
            " and popped nothing"
        )
        raise ContextStackError(
            f"context stack changed under ctxkit in thread {where!r}: {expected} "
            f"{self.handle:#x} ({self.kind}, device {self.device.ordinal}) but the top was "
            f"{got:#x}; {detail}. {kept}. Keep every push/pop inside a ctxkit block balanced."
        )

    # --- lifetime ------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise ``ContextClosedError``/``ContextPoisonedError`` if it cannot be used
        (``ForkError`` in a forked child)."""
        if not self._unusable:
            return
        _driver.check_fork(f"{self!r}")
        if self.closed:
            raise ContextClosedError(f"{self!r} is closed; create a new context")
        assert self._poison is not None
        raise ContextPoisonedError(
            f"{self!r} is poisoned by an earlier fault and cannot be used: {self._poison}",
            self._poison.code,
            self._poison.name,
        )

    def note_error(self, err: Any, what: str) -> CudaError:
        """Build the exception for a failed call made in this context.

        A sticky error marks the context poisoned, so later uses fail fast.
        """
        exc = _driver.from_result(int(err), f"{what} on {self!r}")
        if int(err) in STICKY_CODES and self._poison is None:
            self._poison = exc
            self._unusable = True
        return exc

    def synchronize(self) -> None:
        """Wait for all work in this context (GIL released while waiting).

        Raises
        ------
        ContextPoisonedError
            A kernel faulted; the context can no longer be used.
        """
        with self:
            (err,) = drv.cuCtxSynchronize()
        if err:
            raise self.note_error(err, "cuCtxSynchronize")

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` device memory in bytes (``cuMemGetInfo``)."""
        with self:
            free, total = call(drv.cuMemGetInfo, what="cuMemGetInfo")
        return int(free), int(total)

    def run_in(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` with this context current (cheap when it already is)."""
        with self:
            return fn(*args)

    def close(self) -> None:
        """Destroy an owned context / release a primary one. Idempotent.

        A primary context's work is waited for first: PyTorch or CuPy may keep it alive
        past the release, and what ctxkit frees after ``close()`` (pinned pages, cached
        blocks) counts its copies as finished, as they are once a context is destroyed.

        Raises
        ------
        ContextInUseError
            The context is current in some thread: ctxkit's own pushes, and for a context
            ctxkit made, the calling thread's driver stack (a primary context another
            library made current there is theirs, and closing releases only ctxkit's
            retain).
        """
        if self.closed:
            return
        _driver.check_fork(f"close of {self!r}")
        lifetime.context_closing(self)  # caches give back what they hold in it, while it exists
        if self.kind == "primary" and not (self._unusable or _shutting_down):
            with contextlib.suppress(Exception):  # a fault poisons it: no work left to wait for
                self.synchronize()
        with Context._class_lock:
            if self.closed:
                return
            users = [t for t, ctxs in thread_bindings().items() if any(c is self for c in ctxs)]
            # a primary context PyTorch or CuPy made current here stays theirs: releasing
            # ctxkit's retain leaves it alive for them (or reset, and retained again later)
            if not users and self.kind != "primary" and _driver.bindings_available():
                err, cu = drv.cuCtxGetCurrent()
                if not err and int(cu) == self.handle:
                    users = [threading.current_thread().name]
            if users:
                raise ContextInUseError(
                    f"cannot close {self!r}: it is current in thread(s) {users}; leave "
                    "the `with` blocks (or pop it) in those threads first"
                )
            self.closed = True
            self._unusable = True
            Context._known.pop(self.handle, None)
            if self.kind == "owned":
                call(drv.cuCtxDestroy, self.cu, what=f"cuCtxDestroy({self.handle:#x})")
            elif self.kind == "green":
                call(drv.cuGreenCtxDestroy, self.cu_green, what=f"cuGreenCtxDestroy of {self!r}")
            elif self.kind == "primary":
                if Context._primaries.get(self.device.ordinal) is self:
                    del Context._primaries[self.device.ordinal]
                what = f"cuDevicePrimaryCtxRelease(device={self.device.ordinal})"
                call(drv.cuDevicePrimaryCtxRelease, self.device.handle, what=what)

    # --- freeing resources from any thread ----------------------------------------

    def free(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call a driver free function *in this context*, from whatever thread.

        Used by buffers, streams, events and modules when they are closed or collected:
        the context is bound for the call (no cost when it already is) so the handle is
        never freed in whatever context happens to be current. A destroyed context freed
        its resources already, and at interpreter exit the process teardown does; both
        skip. A closed primary context that another retainer keeps alive still holds
        them: they are freed there (:meth:`freeing`).
        """
        if _shutting_down or (self._unusable and not self._released_primary()):
            return
        if not lifetime.begin_free(self, fn, args):
            return  # an open stream capture forbids it: it runs when the capture ends
        try:
            if not self._unusable:
                with self:  # already current: a re-entry, no driver call
                    lifetime.check_free(fn(*args), fn)
                return
            with self.freeing() as live:
                if live:
                    lifetime.check_free(fn(*args), fn)
        finally:
            lifetime.end_free()

    def _released_primary(self) -> bool:
        return self.closed and self.kind == "primary" and self._poison is None

    @contextlib.contextmanager
    def freeing(self) -> Iterator[bool]:
        """Bind the driver context that holds what was made in this one, for freeing it.

        Yields True with it current: this context while open (a re-entry when it is
        current already), or, once closed, a primary context that another retainer
        (PyTorch, CuPy, a newer ctxkit primary) keeps alive; its memory, registrations
        and streams outlived ``close``, and leaving them would leak them (or, for
        registered pages that are then unmapped, break every later host allocation of
        the process with ``CUDA_ERROR_ALREADY_MAPPED``). Yields False when they went with
        the context (destroyed, or a primary every retainer released) or can no longer
        be freed (poisoned).
        """
        if not self._unusable:
            with self:
                yield True
            return
        if not self._released_primary():
            yield False
            return
        with _driver.live_primary(self.device.handle, self._driver_id) as cu:
            if cu is None:
                yield False
                return
            call(drv.cuCtxPushCurrent, cu, what="cuCtxPushCurrent of a released primary")
            try:
                yield True
            finally:
                call(drv.cuCtxPopCurrent, what="cuCtxPopCurrent of a released primary")

    def resources_alive(self) -> bool:
        """True while what was made in this context still exists in the driver: it is
        open, poisoned (nothing can free it any more) or a closed primary context kept
        alive by another retainer (see :meth:`freeing`)."""
        if not self._unusable or self._poison is not None:
            return True
        with self.freeing() as live:
            return live


_driver.renew_at_fork(Context, "_class_lock", threading.RLock)


def _disown_in_forked_child() -> None:
    """The parent's contexts and what lives in them are not this process's: every use
    raises ForkError (one flag the push path reads anyway) and no free reaches the driver."""
    global _shutting_down
    if not _driver.in_forked_child():
        return
    _shutting_down = True
    for ctx in list(Context._known.values()):
        ctx._unusable = True


_driver.on_fork_in_child(_disown_in_forked_child)


def partition(device: Device, sm_counts: Sequence[int], remainder: bool = True) -> list[Context]:
    """:meth:`Device.partition <ctxkit.Device.partition>`: one split of *device*'s SMs
    into green contexts (the remainder last, with *remainder*)."""
    where = f"device {device.ordinal}"
    _driver.require_green(f"{where}.partition({list(sm_counts)})")
    Context.primary(device)  # each green context retains it: keep it alive in between
    res = _driver.sm_resource(device.handle)
    total = int(res.sm.smCount)
    plan = plan_partition(sm_counts, total, *device.sm_granularity, where=where)
    groups, rest, scratch = _driver.sm_split(device.handle, res, plan)
    made: list[Context] = []
    try:
        if len(groups) != len(plan):
            raise ValueError(
                f"cannot partition {where} ({total} SMs, granularity "
                f"{device.sm_granularity}) into {plan} SMs: the driver made {len(groups)} "
                "of those groups; ask for fewer or smaller partitions"
            )
        for r in groups + ([rest] if remainder and int(rest.sm.smCount) else []):
            green = _driver.green_create(device.handle, r)
            cu = call(drv.cuCtxFromGreenCtx, green, what="cuCtxFromGreenCtx")
            made.append(Context(cu, device, "green", green, int(r.sm.smCount)))
    except BaseException:
        for ctx in made:
            ctx.close()
        raise
    finally:
        for green in scratch:
            drv.cuGreenCtxDestroy(green)
    return made


set_partitioner(partition)


def no_context_error(what: str) -> NoCurrentContextError:
    """The error for an operation that needs a context in a thread that has none."""
    t = threading.current_thread()
    known = [c for c in list(Context._known.values()) if not c.closed]
    known.sort(key=lambda c: c.device.ordinal)
    listing = ", ".join(f"device {c.device.ordinal}: {c!r}" for c in known) or "none yet"
    return NoCurrentContextError(
        f"{what} needs a current CUDA context, but thread {t.name!r} (ident {t.ident}) "
        f"has none (the driver would answer CUDA_ERROR_INVALID_CONTEXT: contexts are "
        f"current per thread). Contexts ctxkit knows: {listing}. Fix: wrap the work in "
        "`with ctxkit.bind(device_or_ctx):`, decorate the function with "
        "`@ctxkit.bound(device)`, or run it on a `ctxkit.ContextExecutor`.",
        201,
        "CUDA_ERROR_INVALID_CONTEXT",
    )


def require_current(what: str) -> Context:
    """The current context, or a :class:`NoCurrentContextError` naming the fix.

    Called before operations that the driver would otherwise refuse with
    ``CUDA_ERROR_INVALID_CONTEXT``.
    """
    top = thread_state().top
    if top is not None:
        return top
    ctx = current_context()
    if ctx is None:
        raise no_context_error(what)
    return ctx
