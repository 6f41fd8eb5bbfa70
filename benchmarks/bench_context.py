"""Context switching, registry and multithreaded launch costs: ctxkit vs raw cuda.bindings.

    PYTHONPATH=. python3 benchmarks/bench_context.py [--quick]

* per-operation cost of a context switch: raw ``cuCtxPushCurrent``/``cuCtxPopCurrent``,
  a minimal Python ``with`` around them (and that with a ``threading.local`` stack: the
  floor of any ``with`` that knows what it made current per thread), ``with ctx:`` and
  ``with ck.bind(ctx):`` (from another context / already current), ``with ctx:`` in a
  thread with nothing current (as a plain ctxkit program meets it; the raw pair there
  beside it), and ``with ctx:``
  beside PyTorch's ``with torch.cuda.device(0):`` (when torch is installed) with the
  primary context already current in the thread, as torch leaves it; each variant times
  the statement a user writes (``with ck.bind(ctx): pass`` in a loop, no wrapper call),
  all interleaved round by round, the empty loop subtracted;
* launch throughput of 1, 2, 4 and 8 threads, each with its own stream: raw threads
  (the context pushed, their own module) vs plain threads doing checked
  ``Kernel.launch`` calls, plain threads calling a ``PreparedLaunch``, and
  ``ContextExecutor`` workers calling a ``PreparedLaunch``; for reference, raw launches
  each behind one Python call (the floor of any launch object written in Python) and raw
  launches through ctypes with the GIL kept; past the per-launch floor, threads handing
  prepared launches to one ``LaunchQueue`` (one thread makes the driver calls) and
  threads replaying a captured graph of prepared launches (one driver call a batch).
  Every side times the same work: set-up (module load, stream creation, thread start-up)
  happens before a barrier, the clock runs from the barrier until every thread has
  launched and synchronized its stream. The modes run interleaved, round by round;
* a profile (cProfile, one thread) of checked and prepared launches: where the host time
  of a launch goes.

Every target decides on the median of the rounds; the best round is printed beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from hostprofile import profile_text
from verdictlines import (
    QUICK,
    Line,
    emit,
    info,
    median,
    median_info,
    median_target,
    missing_baseline,
    not_measured,
    target,
)

import ctxkit as ck
from ctxkit._driver import drv

THREAD_COUNTS = (1, 2, 4, 8)

#: The launch modes timed from threads (``raw`` is the floor).
THREAD_MODES = ("raw", "launch", "prepared", "executor")

#: Raw launches of other kinds timed beside them (reference, INFO lines only):
#: through one Python call each, and through ctypes with the GIL kept.
REFERENCE_THREAD_MODES = ("raw_python", "raw_gil_held")

#: ctxkit launches past the per-launch floor (INFO lines): threads handing their prepared
#: launches to one ``LaunchQueue``, and threads each replaying a graph of
#: :data:`GRAPH_BATCH` captured prepared launches.
BATCHED_THREAD_MODES = ("queue", "graph")

#: Launches per captured graph of the ``graph`` mode.
GRAPH_BATCH = 100

#: Checked and prepared launches in the profile (each).
PROFILED = 20_000


def per_call_us(fn: Callable[[int], None], n: int) -> float:
    """Microseconds per iteration of one ``fn(n)`` run."""
    t0 = time.perf_counter()
    fn(n)
    return (time.perf_counter() - t0) / n * 1e6


def raw_pair(cu: object) -> Callable[[int], None]:
    push, pop = drv.cuCtxPushCurrent, drv.cuCtxPopCurrent

    def run(n: int) -> None:
        for _ in range(n):
            (err,) = push(cu)
            if err:
                raise RuntimeError(err)
            err, _c = pop()
            if err:
                raise RuntimeError(err)

    return run


def raw_pair_checked(cu: object) -> Callable[[int], None]:
    """The raw pair plus the handle comparison ctxkit does on every pop."""
    push, pop = drv.cuCtxPushCurrent, drv.cuCtxPopCurrent
    want = int(cu)  # type: ignore[call-overload]

    def run(n: int) -> None:
        for _ in range(n):
            (err,) = push(cu)
            if err:
                raise RuntimeError(err)
            err, c = pop()
            if err or int(c) != want:
                raise RuntimeError(err)

    return run


class _RawWith:
    """A minimal Python context manager around the raw pair (the floor for any `with`)."""

    def __init__(self, cu: object) -> None:
        self.cu = cu

    def __enter__(self) -> None:
        (err,) = drv.cuCtxPushCurrent(self.cu)
        if err:
            raise RuntimeError(err)

    def __exit__(self, *exc: object) -> None:
        err, _c = drv.cuCtxPopCurrent()
        if err:
            raise RuntimeError(err)


class _LocalWith(_RawWith):
    """The raw pair plus the least per-thread bookkeeping any context manager needs that
    knows, without asking the driver, what it made current in this thread (a
    ``threading.local`` stack, the popped handle checked): the floor under ``with ctx:``."""

    def __init__(self, cu: object) -> None:
        super().__init__(cu)
        self.local = threading.local()

    def __enter__(self) -> None:
        try:
            stack = self.local.stack
        except AttributeError:
            stack = self.local.stack = []
        (err,) = drv.cuCtxPushCurrent(self.cu)
        if err:
            raise RuntimeError(err)
        stack.append(self)

    def __exit__(self, *exc: object) -> None:
        if self.local.stack.pop() is not self:
            raise RuntimeError("popped out of order")
        err, popped = drv.cuCtxPopCurrent()
        if err or popped != self.cu:
            raise RuntimeError(err)


class _EmptyWith:
    """A context manager that does nothing: the floor of any ``with`` (reference only)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def raw_with(cu: object) -> Callable[[int], None]:
    cm = _RawWith(cu)

    def run(n: int) -> None:
        for _ in range(n):
            with cm:
                pass

    return run


def with_cm(cm: Any) -> Callable[[int], None]:
    """``with cm: pass`` n times: the statement itself, no call around it."""

    def run(n: int) -> None:
        for _ in range(n):
            with cm:
                pass

    return run


def with_call(fn: Callable[[Any], Any], arg: Any) -> Callable[[int], None]:
    """``with fn(arg): pass`` n times (``with ck.bind(ctx):``, ``with torch.cuda.device(0):``)."""

    def run(n: int) -> None:
        for _ in range(n):
            with fn(arg):
                pass

    return run


def empty_loop(n: int) -> None:
    for _ in range(n):
        pass


def torch_device_variant() -> tuple[Callable[[int], None] | None, str]:
    """``with torch.cuda.device(0):`` when torch with CUDA is installed."""
    try:
        import torch
    except Exception as exc:
        return None, f"torch is not installed ({type(exc).__name__})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    torch.cuda.init()
    return with_call(torch.cuda.device, 0), f"torch {torch.__version__}"


def bench_switching(n: int, rounds: int) -> tuple[dict[str, list[float]], str]:
    """Per-round microseconds of every variant (the empty loop of the same round
    subtracted), variants interleaved within each round; and the torch note.

    Three situations, each as a user meets it:

    * a switch (``raw``, ``enter``, ``bind_cold``, ...): another ctxkit context is
      current (an owned one on the same device), so every variant really pushes and pops;
    * ``enter_current`` beside ``torch_device``: device 0's primary context is current in
      the thread already, as PyTorch leaves it (torch then skips ``cudaSetDevice``, ctxkit
      the push), while ctxkit has nothing pushed;
    * ``reenter``/``bind_hot``: ctxkit has the context on top already;
    * ``enter_fresh`` beside ``raw_fresh`` (the raw pair there, printed to show whether
      the driver's push onto an empty stack costs more than a switch): a thread with
      nothing current (ctxkit has found it so once).
    """
    ctx = ck.registry.context(0)
    other = ck.Context.create(0)
    try:
        return _switching_rounds(ctx, other, n, rounds)
    finally:
        other.close()


def _switching_rounds(
    ctx: ck.Context, other: ck.Context, n: int, rounds: int
) -> tuple[dict[str, list[float]], str]:
    bind = ck.bind
    empty_cm = _EmptyWith()
    switch: dict[str, Callable[[int], None]] = {
        "raw": raw_pair(ctx.cu),
        "raw_checked": raw_pair_checked(ctx.cu),
        "raw_with": raw_with(ctx.cu),
        "local_with": with_cm(_LocalWith(ctx.cu)),
        "empty_with": with_cm(empty_cm),
        "enter": with_cm(ctx),
        "bind_cold": with_call(bind, ctx),
    }
    current: dict[str, Callable[[int], None]] = {"enter_current": with_cm(ctx)}
    torch_run, torch_note = torch_device_variant()
    if torch_run is not None:
        current["torch_device"] = torch_run
    hot: dict[str, Callable[[int], None]] = {
        "reenter": with_cm(ctx),
        "bind_hot": with_call(bind, ctx),
    }
    fresh = {"enter_fresh": with_cm(ctx), "raw_fresh": raw_pair(ctx.cu)}
    t: dict[str, list[float]] = {k: [] for k in [*switch, *current, *hot, *fresh]}
    with _driver_current(ctx):
        for fn in current.values():
            fn(min(n, 1000))
    for _ in range(rounds):
        base = per_call_us(empty_loop, n)
        with other:
            us = {name: per_call_us(fn, n) for name, fn in switch.items()}
        us.update({name: in_fresh_thread(fn, n) for name, fn in fresh.items()})
        with _driver_current(ctx):
            us.update({name: per_call_us(fn, n) for name, fn in current.items()})
        with ctx:
            us.update({name: per_call_us(fn, n) for name, fn in hot.items()})
        for name, v in us.items():
            t[name].append(v - base)
    return t, torch_note


def in_fresh_thread(fn: Callable[[int], None], n: int) -> float:
    """:func:`per_call_us` of ``fn(n)`` in a new thread with nothing current, after one
    untimed call (a plain ctxkit thread: its first outermost block asks the driver)."""
    out: list[float] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(1)
            out.append(per_call_us(fn, n))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="bench-fresh")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


class _driver_current:
    """*ctx* current in the driver but not pushed by ctxkit: what torch leaves behind."""

    def __init__(self, ctx: ck.Context) -> None:
        self.ctx = ctx

    def __enter__(self) -> None:
        (err,) = drv.cuCtxPushCurrent(self.ctx.cu)
        if err:
            raise RuntimeError(err)

    def __exit__(self, *exc: object) -> None:
        drv.cuCtxPopCurrent()


# --- launch throughput from several threads ------------------------------------------


class Gate:
    """A start barrier for *n* worker threads and the clock of their timed work.

    A worker does its set-up, :meth:`start`, the timed work, :meth:`finish`, then its
    tear-down. Each worker reads the clock itself, right after the barrier lets it go and
    right after its work, so :meth:`seconds` (first start to last finish) covers exactly
    the timed work of all of them, however the threads are scheduled around it.
    """

    def __init__(self, n: int, timeout: float = 300.0) -> None:
        self._barrier = threading.Barrier(n, timeout=timeout)
        self._lock = threading.Lock()
        self._starts: list[float] = []
        self._ends: list[float] = []

    def start(self) -> None:
        self._barrier.wait()
        t = time.perf_counter()
        with self._lock:
            self._starts.append(t)

    def finish(self) -> None:
        t = time.perf_counter()
        with self._lock:
            self._ends.append(t)

    def abort(self) -> None:
        """A worker failed: release the others (their :meth:`start` raises)."""
        self._barrier.abort()

    def seconds(self) -> float:
        """From the first worker's start to the last worker's finish."""
        return max(self._ends) - min(self._starts)


def _guarded(gate: Gate, work: Callable[[], None], errors: list[BaseException]) -> None:
    try:
        work()
    except BaseException as exc:
        errors.append(exc)
        gate.abort()


def _timed_gate(gate: Gate, joins: list[Callable[[], Any]], errors: list[BaseException]) -> float:
    """Wait for every worker; the seconds of their timed work, or the first worker error."""
    for join in joins:
        join()
    if errors:
        first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (first or errors)[0]
    return gate.seconds()


class _PythonLaunch:
    """The raw launch behind one Python call that checks its result: the floor of any
    launch object written in Python (``PreparedLaunch`` is one)."""

    def __init__(self, call: tuple[Any, ...]) -> None:
        self.call = call

    def __call__(self) -> None:
        (err,) = drv.cuLaunchKernel(*self.call)
        if err:
            raise RuntimeError(err)


class RawVia(NamedTuple):
    """How a raw worker calls ``cuLaunchKernel``: through cuda.bindings (the default),
    through *gil_held* (:func:`gil_held_launch`), or, with *python_call*, through a
    :class:`_PythonLaunch`."""

    gil_held: Any = None
    python_call: bool = False


#: Raw launches through cuda.bindings, as a user of the bindings writes them.
BINDINGS = RawVia()


def raw_thread_launches(
    ctx: ck.Context, cubin: bytes, n: int, gate: Gate, via: RawVia = BINDINGS
) -> None:
    """A raw cuda.bindings worker: push, load, make a stream (untimed); launch n times
    (the way *via* says) and synchronize (timed); destroy and pop (untimed)."""
    (err,) = drv.cuCtxPushCurrent(ctx.cu)
    if err:
        raise RuntimeError(f"cuCtxPushCurrent: {err!r}")
    try:
        err, mod = drv.cuModuleLoadData(cubin)
        if err:
            raise RuntimeError(f"cuModuleLoadData: {err!r}")
        err, fn = drv.cuModuleGetFunction(mod, b"empty")
        if err:
            raise RuntimeError(f"cuModuleGetFunction: {err!r}")
        a = ctypes.c_void_p(0)
        b = ctypes.c_int(0)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
        addr = ctypes.addressof(params)
        err, stream = drv.cuStreamCreate(1)
        if err:
            raise RuntimeError(f"cuStreamCreate: {err!r}")
        gil_held = via.gil_held
        gate.start()
        if via.python_call:
            python_launch = _PythonLaunch((fn, 1, 1, 1, 32, 1, 1, 0, stream, addr, 0))
            for _ in range(n):
                python_launch()
        elif gil_held is None:
            launch = drv.cuLaunchKernel
            for _ in range(n):
                (err,) = launch(fn, 1, 1, 1, 32, 1, 1, 0, stream, addr, 0)
                if err:
                    raise RuntimeError(err)
        else:
            hf, hs = int(fn), int(stream)
            for _ in range(n):
                if gil_held(hf, 1, 1, 1, 32, 1, 1, 0, hs, addr, None):
                    raise RuntimeError("cuLaunchKernel failed")
        drv.cuStreamSynchronize(stream)
        gate.finish()
        drv.cuStreamDestroy(stream)
        drv.cuModuleUnload(mod)
    finally:
        drv.cuCtxPopCurrent()


def gil_held_launch() -> Any:
    """libcuda's ``cuLaunchKernel`` through ``ctypes.PyDLL``, which keeps the GIL during
    the call (an experiment, not a ctxkit path: a launch that blocks on a full queue then
    stalls every Python thread); ``None`` where libcuda cannot be loaded."""
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, *[ctypes.c_void_p] * 3]
    return fn


def ctxkit_task_launches(kernel: ck.Kernel, n: int, gate: Gate, prepared: bool = True) -> None:
    """The ctxkit twin, with the context current (an executor worker, or a bound thread):
    a stream and, if *prepared*, a prepared launch (untimed); n launches, checked
    (``Kernel.launch``) or prepared, and a synchronize (timed)."""
    stream = ck.Stream()
    launch = kernel.prepare(1, 32, 0, 0, stream=stream) if prepared else None
    gate.start()
    if launch is not None:
        for _ in range(n):
            launch()
    else:
        checked = kernel.launch
        for _ in range(n):
            checked(1, 32, 0, 0, stream=stream)
    stream.synchronize()
    gate.finish()
    stream.close()


def ctxkit_queued_launches(kernel: ck.Kernel, q: ck.LaunchQueue, n: int, gate: Gate) -> None:
    """A bound thread's stream and prepared launch (untimed); n submits to the shared
    LaunchQueue *q*, its flush and a synchronize (timed)."""
    stream = ck.Stream()
    launch = kernel.prepare(1, 32, 0, 0, stream=stream)
    submit = q.submit
    gate.start()
    for _ in range(n):
        submit(launch)
    q.flush()
    stream.synchronize()
    gate.finish()
    stream.close()


def ctxkit_graph_launches(kernel: ck.Kernel, n: int, gate: Gate) -> None:
    """Batched launches from one thread: :data:`GRAPH_BATCH` prepared launches captured
    into a graph (untimed), the graph replayed ``n // GRAPH_BATCH`` times and the stream
    synchronized (timed)."""
    stream = ck.Stream()
    launch = kernel.prepare(1, 32, 0, 0, stream=stream)
    with ck.capture(stream) as graph:
        for _ in range(GRAPH_BATCH):
            launch()
    gate.start()
    for _ in range(max(1, n // GRAPH_BATCH)):
        graph.launch(stream)
    stream.synchronize()
    gate.finish()
    graph.close()
    stream.close()


def _run_threads(nthreads: int, work: Callable[[Gate], None]) -> float:
    """Seconds of the timed work of *nthreads* plain threads each running ``work(gate)``."""
    gate = Gate(nthreads)
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_guarded, args=(gate, lambda: work(gate), errors))
        for _ in range(nthreads)
    ]
    for t in threads:
        t.start()
    return _timed_gate(gate, [t.join for t in threads], errors)


def raw_rate(
    ctx: ck.Context, cubin: bytes, nthreads: int, per_thread: int, via: RawVia = BINDINGS
) -> float:
    """Launches per second of *nthreads* raw threads (set-up outside the clock)."""
    secs = _run_threads(nthreads, lambda g: raw_thread_launches(ctx, cubin, per_thread, g, via))
    return nthreads * per_thread / secs


def _bound_rate(nthreads: int, launches: int, work: Callable[[Gate], None]) -> float:
    """Launches per second of *nthreads* plain threads, each binding device 0's registry
    context for its life (``with ck.bind(ctx):``) and making *launches* in ``work(gate)``."""
    ctx = ck.registry.context(0)

    def bound(gate: Gate) -> None:
        with ck.bind(ctx):
            work(gate)

    return nthreads * launches / _run_threads(nthreads, bound)


def thread_rate(kernel: ck.Kernel, nthreads: int, per_thread: int, prepared: bool) -> float:
    """Checked or prepared launches per second of *nthreads* bound threads."""
    return _bound_rate(
        nthreads, per_thread, lambda g: ctxkit_task_launches(kernel, per_thread, g, prepared)
    )


def queue_rate(kernel: ck.Kernel, nthreads: int, per_thread: int) -> float:
    """Launches per second of *nthreads* bound threads handing prepared launches to one
    LaunchQueue (made before the clock starts)."""
    with ck.LaunchQueue(ck.registry.context(0)) as q:
        return _bound_rate(
            nthreads, per_thread, lambda g: ctxkit_queued_launches(kernel, q, per_thread, g)
        )


def graph_rate(kernel: ck.Kernel, nthreads: int, per_thread: int) -> float:
    """Kernel launches per second of *nthreads* bound threads replaying captured graphs
    (:func:`ctxkit_graph_launches`)."""
    launches = max(1, per_thread // GRAPH_BATCH) * GRAPH_BATCH
    return _bound_rate(nthreads, launches, lambda g: ctxkit_graph_launches(kernel, per_thread, g))


def executor_rate(
    ex: ck.ContextExecutor, kernel: ck.Kernel, nthreads: int, per_thread: int
) -> float:
    """Launches per second of *nthreads* ContextExecutor tasks (set-up outside the clock)."""
    gate = Gate(nthreads)
    errors: list[BaseException] = []

    def work() -> None:
        ctxkit_task_launches(kernel, per_thread, gate)

    futures = [ex.submit(_guarded, gate, work, errors) for _ in range(nthreads)]
    return nthreads * per_thread / _timed_gate(gate, [f.result for f in futures], errors)


def _empty_kernel() -> tuple[ck.Kernel, bytes]:
    from ctxkit.compiler import kernel_source

    obj = ck.compile(kernel_source("empty.cu"), name="empty.cu", target="cubin")
    kernel = ck.Module.load(obj).function("empty")
    return kernel, obj.code


def thread_modes(
    ctx: ck.Context, kernel: ck.Kernel, cubin: bytes, ex: ck.ContextExecutor, nthreads: int
) -> dict[str, Callable[[int], float]]:
    """Each mode of :data:`THREAD_MODES` as ``rate(launches_per_thread)`` for *nthreads*,
    and ``raw_gil_held`` where libcuda loads (:func:`gil_held_launch`)."""
    modes: dict[str, Callable[[int], float]] = {
        "raw": lambda k: raw_rate(ctx, cubin, nthreads, k),
        "launch": lambda k: thread_rate(kernel, nthreads, k, prepared=False),
        "prepared": lambda k: thread_rate(kernel, nthreads, k, prepared=True),
        "executor": lambda k: executor_rate(ex, kernel, nthreads, k),
        "raw_python": lambda k: raw_rate(ctx, cubin, nthreads, k, RawVia(python_call=True)),
        "queue": lambda k: queue_rate(kernel, nthreads, k),
        "graph": lambda k: graph_rate(kernel, nthreads, k),
    }
    held = gil_held_launch()
    if held is not None:
        modes["raw_gil_held"] = lambda k: raw_rate(ctx, cubin, nthreads, k, RawVia(gil_held=held))
    return modes


def bench_thread_throughput(per_thread: int, rounds: int) -> dict[str, list[float]]:
    """Launch rates per mode and thread count (``<mode>_threads<N>``), the modes
    interleaved round by round."""
    ctx = ck.registry.context(0)
    with ctx:
        kernel, cubin = _empty_kernel()
    rates: dict[str, list[float]] = {}
    for nthreads in THREAD_COUNTS:
        with ck.ContextExecutor(ctx, max_workers=nthreads) as ex:
            modes = thread_modes(ctx, kernel, cubin, ex, nthreads)
            for rate in modes.values():
                rate(100)  # warm-up: lazy loading, first launches, worker threads
            for _ in range(rounds):
                for mode, rate in modes.items():
                    rates.setdefault(f"{mode}_threads{nthreads}", []).append(rate(per_thread))
    return rates


def profile_launches(n: int, top: int = 12) -> str:
    """A cProfile of *n* checked and *n* prepared launches in this thread, the *top*
    entries by own time: where the host time of a launch goes."""
    ctx = ck.registry.context(0)
    with ctx:
        kernel, _ = _empty_kernel()
        stream = ck.Stream()
        prepared = kernel.prepare(1, 32, 0, 0, stream=stream)

        def launches() -> None:
            for _ in range(n):
                kernel.launch(1, 32, 0, 0, stream=stream)
            for _ in range(n):
                prepared()

        text = profile_text(launches, top)
        stream.synchronize()
        stream.close()
    return text


def print_tables(r: Mapping[str, Any]) -> None:
    med = {k: median(v) for k, v in r.items() if isinstance(v, list)}
    raw = med["raw"]
    print(f"context switches, us per operation (median of {len(r['raw'])} rounds):")
    print("  (switches start from another ctxkit context on the device)")
    print(f"  raw cuCtxPushCurrent+cuCtxPopCurrent : {raw:.3f}")
    print(f"    + int(popped) == handle check      : {med['raw_checked']:.3f}")
    print(f"    as a minimal Python `with` class   : {med['raw_with']:.3f}")
    if "local_with" in med:
        print(f"    + a threading.local stack          : {med['local_with']:.3f}")
    if "empty_with" in med:
        print(f"  an empty Python `with` (no driver)   : {med['empty_with']:.3f}")
    print(
        f"  with ctx: (not current)              : {med['enter']:.3f} ({med['enter'] / raw:.2f}x)"
    )
    print(f"  with ctx: (already current)          : {med['reenter']:.3f}")
    if "enter_current" in med:
        print(f"  with ctx: (current in the driver)    : {med['enter_current']:.3f}")
    print(
        f"  with ck.bind(ctx): (not current)     : {med['bind_cold']:.3f} "
        f"({med['bind_cold'] / raw:.2f}x)"
    )
    print(f"  with ck.bind(ctx): (already current) : {med['bind_hot']:.3f}")
    if "torch_device" in med:
        print(f"  with torch.cuda.device(0): (current) : {med['torch_device']:.3f}")
    if "enter_fresh" in med:
        print(f"  raw pair (thread, nothing current)   : {med['raw_fresh']:.3f}")
        print(
            f"  with ctx: (thread, nothing current)  : {med['enter_fresh']:.3f} "
            f"({med['enter_fresh'] / raw:.2f}x)"
        )
    print_thread_table(med)


def print_thread_table(med: Mapping[str, float]) -> None:
    """Launches/s per mode and thread count (medians), each mode's ratio to raw beside it."""
    every = (*THREAD_MODES, *REFERENCE_THREAD_MODES, *BATCHED_THREAD_MODES)
    modes = [m for m in every if f"{m}_threads1" in med]
    print("launches/s from N threads, each on its own stream (medians; ratio to raw):")
    print(f"threads | {' | '.join(f'{m:>16s}' for m in modes)}")
    for n in THREAD_COUNTS:
        raw = med.get(f"raw_threads{n}")
        if not raw:
            continue
        cells = [f"{raw:16,.0f}"]
        for mode in modes[1:]:
            v = med.get(f"{mode}_threads{n}")
            cells.append(f"{v:9,.0f} ({v / raw:.2f})" if v else f"{'-':>16s}")
        print(f"{n:7d} | {' | '.join(cells)}")
    if "raw_python" in modes:
        print("  (raw_python: raw launches, each behind one Python call that checks the result)")
    if "raw_gil_held" in modes:
        print("  (raw_gil_held: raw launches through ctypes.PyDLL, the GIL kept during each call)")
    if "queue" in modes:
        print("  (queue: the threads hand their prepared launches to one ck.LaunchQueue)")
    if "graph" in modes:
        print(
            f"  (graph: each thread replays a graph of {GRAPH_BATCH} captured prepared launches; "
            "kernel launches/s)"
        )


def _ratio_line(
    name: str, num: Sequence[float], den: Sequence[float], op: str, limit: float, what: str
) -> Line:
    """Target on the ratio of medians; the ratio of the best rounds beside it."""
    value = median(num) / median(den)
    best = min(num) / min(den) if op == "<=" else max(num) / max(den)
    return target(name, value, op, limit, "x", f"{what}; medians of {len(num)}; best {best:.2f}x")


#: Targets: ``with ctx:`` and a cold bind at most 1.5x the raw pair; a hot
#: bind at most 0.35 us; every launch mode at least 0.95x raw threads at every count.
WITH_VS_RAW = 1.5
BIND_HOT_US = 0.35
REENTER_US = 0.3
THREADS_VS_RAW = 0.95


def verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The SUMMARY lines of this benchmark from its measurements (pure: no GPU).

    *r* holds per-round microseconds per variant (``raw``, ``enter``, ``reenter``,
    ``bind_cold``, ``bind_hot``, ``enter_current``, ``enter_fresh``, optional
    ``torch_device``), launch rates per mode and thread count (``<mode>_threads<N>``,
    modes :data:`THREAD_MODES`) and ``torch_note``.
    """
    lines = [
        _ratio_line(
            "context.with_vs_raw_pair",
            r["enter"],
            r["raw"],
            "<=",
            WITH_VS_RAW,
            "with ctx: switching from another context",
        ),
        median_target("context.reenter_us", r["reenter"], "<=", REENTER_US, "us"),
        _ratio_line(
            "registry.bind_cold_vs_raw", r["bind_cold"], r["raw"], "<=", WITH_VS_RAW, "switching"
        ),
        median_target("registry.bind_hot_us", r["bind_hot"], "<=", BIND_HOT_US, "us"),
    ]
    if r.get("enter_fresh"):
        lines.append(
            _ratio_line(
                "context.with_fresh_thread_vs_raw_pair",
                r["enter_fresh"],
                r["raw"],
                "<=",
                WITH_VS_RAW,
                "with ctx: in a thread with nothing current, as a plain ctxkit program",
            )
        )
    else:
        lines.append(not_measured("context.with_fresh_thread_vs_raw_pair", "not measured"))
    if r.get("torch_device"):
        lines.append(
            _ratio_line(
                "context.with_vs_torch_device",
                r["enter_current"],
                r["torch_device"],
                "<=",
                1.0,
                "with ctx: vs with torch.cuda.device(0):, device 0's primary context "
                "current in the thread for both (as torch leaves it)",
            )
        )
    else:
        lines.append(
            missing_baseline(
                r, "context.with_vs_torch_device", "<=", 1.0, "x", r.get("torch_note", "no torch")
            )
        )
    lines += thread_verdicts(r)
    lines.append(median_info("context.raw_pair_us", r["raw"], "us", higher=False))
    floors = {
        "raw_with": (
            "context.python_with_floor_vs_raw_pair",
            "the floor of any Python `with` that pushes and pops: a minimal class around the "
            "raw pair, vs the raw pair",
        ),
        "local_with": (
            "context.thread_local_with_floor_vs_raw_pair",
            "the floor of a `with` that knows what it made current in each thread: the "
            "minimal class plus a threading.local stack and the popped handle checked",
        ),
    }
    for key, (name, what) in floors.items():
        if r.get(key):
            lines.append(info(name, median(r[key]) / median(r["raw"]), "x", what))
    if r.get("empty_with"):
        lines.append(
            median_info(
                "context.empty_with_us",
                r["empty_with"],
                "us",
                higher=False,
                what="a Python `with` that does nothing: the floor under reenter and bind_hot",
            )
        )
    return lines


#: The line of each ctxkit launch mode timed from threads.
THREAD_LINES = {
    "launch": "threads.launch_vs_raw",
    "prepared": "threads.prepared_vs_raw",
    "executor": "registry.executor_vs_raw_threads",
}


def _worst_vs_raw(r: Mapping[str, Any], mode: str) -> tuple[float, str] | None:
    """*mode*'s launch rate over raw threads' at the worst thread count (medians), and a
    note listing every count; ``None`` when it was not measured."""
    ratios = {
        n: median(r[f"{mode}_threads{n}"]) / median(r[f"raw_threads{n}"])
        for n in THREAD_COUNTS
        if r.get(f"raw_threads{n}") and r.get(f"{mode}_threads{n}")
    }
    if not ratios:
        return None
    each = ", ".join(f"{n} threads {v:.2f}x" for n, v in ratios.items())
    return min(ratios.values()), f"worst thread count; launch rates, medians; {each}"


def thread_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """Per ctxkit mode: the worst thread count's ratio to raw threads (a target); and how
    8 threads compare with 1 raw thread (INFO: does throughput fall as threads are added)."""
    lines: list[Line] = []
    for mode, name in THREAD_LINES.items():
        worst = _worst_vs_raw(r, mode)
        if worst is None:
            lines.append(not_measured(name, f"{mode} launches from threads not measured"))
            continue
        lines.append(target(name, worst[0], ">=", THREADS_VS_RAW, "x", worst[1]))
    floor = _worst_vs_raw(r, "raw_python")
    if floor is not None:
        what = "the floor of a launch object written in Python: raw launches, each behind one call"
        lines.append(info("threads.python_floor_vs_raw", floor[0], "x", f"{what}; {floor[1]}"))
    batched = {
        "queue": "prepared launches handed to one LaunchQueue",
        "graph": f"kernels launched through captured graphs of {GRAPH_BATCH} prepared launches",
    }
    for mode, what in batched.items():
        worst = _worst_vs_raw(r, mode)
        if worst is not None:
            lines.append(info(f"threads.{mode}_vs_raw", worst[0], "x", f"{what}; {worst[1]}"))
    one, top = min(THREAD_COUNTS), max(THREAD_COUNTS)
    if r.get(f"raw_threads{one}"):
        base = median(r[f"raw_threads{one}"])
        for mode in (*THREAD_MODES, *REFERENCE_THREAD_MODES, *BATCHED_THREAD_MODES):
            if r.get(f"{mode}_threads{top}"):
                lines.append(
                    info(
                        f"threads.{mode}_{top}_vs_raw_{one}",
                        median(r[f"{mode}_threads{top}"]) / base,
                        "x",
                        f"{mode} launches from {top} threads vs 1 raw thread (medians)",
                    )
                )
    return lines


def measure(n: int, per_thread: int, rounds: int, thread_rounds: int = 5) -> dict[str, Any]:
    """Switch costs (*n* per round, *rounds* rounds) and launch rates (*per_thread*
    launches per thread, *thread_rounds* rounds per mode and thread count)."""
    r: dict[str, Any] = {}
    switches, r["torch_note"] = bench_switching(n, rounds)
    r.update(switches)
    r.update(bench_thread_throughput(per_thread, thread_rounds))
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_context: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    quick = args.quick
    r = measure(50_000 if quick else 300_000, 2_000 if quick else 10_000, 5 if quick else 7)
    r[QUICK] = quick
    print_tables(r)
    print(f"where a launch's host time goes (cProfile of 1 thread, {PROFILED:,} launches each):")
    print(profile_launches(PROFILED // 10 if quick else PROFILED))
    return emit(verdicts(r))


if __name__ == "__main__":
    sys.exit(main())
