"""Exit safety: programs that leave ctxkit objects alive must exit with code 0 and EMPTY stderr.

Each scenario is a small program (run as ``exit_safety.py --child NAME`` in a fresh
interpreter) that creates objects of one kind and simply returns, leaving them alive for the
interpreter's exit: contexts pushed in several threads, buffers, streams, events, modules,
pinned and registered host memory, graphs, a running ContextExecutor, Pipelines, objects
freed from the wrong thread, a poisoned context, a host callback still pending. The parent
runs every scenario ``--runs`` times (20 by default), ``--jobs`` at a time, and fails on any
run whose exit code is not 0, whose stderr is not empty, or that hangs.

    PYTHONPATH=. python3 scripts/exit_safety.py [--runs 20] [--jobs 4] [--only NAME ...]
    python3 scripts/exit_safety.py --list

Exit codes: 0 all runs clean, 1 some run failed, 2 no GPU (or a bad argument).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import ctxkit as ck  # noqa: E402

_KEEP: list[Any] = []  # module globals: alive until the interpreter tears the module down
SPIN_100MS = 200_000_000  # clock64 ticks, ~100 ms on an H200


# --- helpers for the child scenarios ------------------------------------------------------


def kernels() -> dict[str, Any]:
    """fill_f32, spin, scale_f32 and fault from ptx/, as context-independent kernels."""
    from ctxkit.compiler import kernel_source

    out = {}
    with ck.bind(0):
        for file, name in (
            ("fill.cu", "fill_f32"),
            ("spin.cu", "spin"),
            ("scale.cu", "scale_f32"),
            ("fault.cu", "fault"),
        ):
            obj = ck.compile(kernel_source(file), name=file)
            out[name] = ck.Module.load(obj).function(name)
    return out


def raw_current() -> int:
    from ctxkit._driver import drv

    err, cu = drv.cuCtxGetCurrent()
    if err:
        raise RuntimeError(f"cuCtxGetCurrent: {err}")
    return int(cu)


def contexts() -> tuple[list[ck.Context], ck.Context]:
    """The registry's context of every device, and an owned context on the last device."""
    n = ck.device_count()
    return [ck.registry.context(i) for i in range(n)], ck.Context.create(n - 1)


def resources_in(ctx: ck.Context, k: dict[str, Any]) -> list[Any]:
    """One of every resource kind, created in *ctx*, with work done on them."""
    out: list[Any] = []
    with ctx:
        s = ck.Stream()
        buf = ck.DeviceBuffer(1 << 20)
        arr = ck.device_array((1 << 12,), np.float32)
        ev, ev2 = ck.Event(), ck.Event(timing=False)
        pinned = ck.pinned_empty(1 << 12, np.float32)
        zeros = ck.pinned_zeros(1 << 10, np.float64)
        managed = ck.ManagedBuffer(1 << 16)
        managed_view = managed.as_numpy(np.float32)
        obj = ck.compile(ck.compiler.kernel_source("fill.cu"), name="fill.cu")
        bound_mod = ck.Module.load(obj, context=ctx)
        bound_fill = bound_mod.function("fill_f32")
        ev.record(s)
        k["fill_f32"].launch(4, 256, arr, 1.0, arr.size, stream=s)
        prepared = k["fill_f32"].prepare(4, 256, arr, 2.0, arr.size, stream=s)
        prepared()
        with ck.capture(s) as graph:
            bound_fill.launch(4, 256, arr, 3.0, arr.size, stream=s)
        graph.launch(s)
        built = ck.Graph()
        built.kernel(bound_fill, 4, 256, arr, 4.0, arr.size)
        copy = graph.clone()
        built_exec = built.instantiate()
        built_exec.launch(s)
        arr.copy_to_host(pinned, stream=s)
        ev2.record(s)
        out += [s, buf, arr, ev, ev2, pinned, zeros, managed, managed_view, bound_mod]
        out += [bound_fill, prepared, graph, built, copy, built_exec]
    return out


@dataclass
class Handle:
    """One handle the :class:`Ledger` saw allocated, and how it was freed."""

    call: str
    value: int
    context: int
    phase: str
    freed: tuple[int, str, int] | None = None  # (context current, thread, CUresult)


class Ledger:
    """Every handle ctxkit allocates while the ledger is installed, and its free.

    Wraps cuda.bindings' allocating and freeing functions (ctxkit looks them up on ``drv``
    at call time, and each finalizer keeps the free function it was made with) and records
    the context current at every call. Exact and local to this process, unlike
    ``cuMemGetInfo``, which counts every process on the device (the parent runs ``--jobs``
    scenarios at once) and the driver's lazy per-context reservations.
    """

    PAIRS: ClassVar[dict[str, str]] = {
        "cuMemAlloc": "cuMemFree",
        "cuMemAllocManaged": "cuMemFree",
        "cuMemHostAlloc": "cuMemFreeHost",
        "cuStreamCreateWithPriority": "cuStreamDestroy",
        "cuEventCreate": "cuEventDestroy",
        "cuModuleLoadDataEx": "cuModuleUnload",
        "cuGraphInstantiate": "cuGraphExecDestroy",
        "cuGraphCreate": "cuGraphDestroy",
        "cuGraphClone": "cuGraphDestroy",
        "cuStreamEndCapture": "cuGraphDestroy",
    }

    def __init__(self, drv: Any) -> None:
        self.drv = drv
        self.phase = ""
        self.live: dict[tuple[str, int], Handle] = {}
        self.done: list[Handle] = []
        self._saved: dict[str, Any] = {}
        self._lock = threading.Lock()

    def install(self) -> Ledger:
        for alloc, free in self.PAIRS.items():
            for name, wrap in ((alloc, self._alloc), (free, self._free)):
                if name not in self._saved:
                    self._saved[name] = getattr(self.drv, name)
                    setattr(self.drv, name, wrap(name, self._saved[name]))
        return self

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(self.drv, name, fn)
        self._saved.clear()

    def _context(self) -> int:
        err, cu = self.drv.cuCtxGetCurrent()
        return -1 if err else int(cu)

    def _alloc(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        free = self.PAIRS[name]

        @functools.wraps(fn)
        def alloc(*args: Any) -> Any:
            res = fn(*args)
            if not res[0] and res[1] is not None and int(res[1]):
                handle = Handle(name, int(res[1]), self._context(), self.phase)
                with self._lock:
                    self.live[(free, handle.value)] = handle
            return res

        return alloc

    def _free(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def free(value: Any, *args: Any) -> Any:
            ctx = self._context()
            res = fn(value, *args)
            err = int(res[0] if isinstance(res, tuple) else res)
            with self._lock:
                handle = self.live.pop((name, int(value)), None)
                if handle is not None:
                    handle.freed = (ctx, threading.current_thread().name, err)
                    self.done.append(handle)
            return res

        return free

    def problems(
        self, phase: str, contexts: list[ck.Context], calls: set[str], thread: str | None = None
    ) -> list[str]:
        """What went wrong with the handles allocated in *phase*: each of *calls* must have
        been seen in every one of *contexts*, and every handle freed without error, with
        its own context current (by *thread* when given)."""
        with self._lock:
            live = [h for h in self.live.values() if h.phase == phase]
            done = [h for h in self.done if h.phase == phase]
        out = [
            f"{phase}: {h.call} handle {h.value:#x} of context {h.context:#x} was never freed"
            for h in live
        ]
        seen = {(h.call, h.context) for h in live + done}
        out += [
            f"{phase}: no {call} in context {c.handle:#x} was seen (the ledger missed it)"
            for c in contexts
            for call in sorted(calls)
            if (call, c.handle) not in seen
        ]
        for h in done:
            assert h.freed is not None
            ctx, by, err = h.freed
            what = f"{phase}: {h.call} handle {h.value:#x} of context {h.context:#x}"
            if err:
                out.append(f"{what}: its free failed with CUresult {err}")
            if ctx != h.context:
                out.append(f"{what} was freed with context {ctx:#x} current")
            if thread is not None and by != thread:
                out.append(f"{what} was freed in thread {by!r}, not {thread!r}")
        return out


# --- scenarios ----------------------------------------------------------------------------


def scenario_pushed_threads() -> None:
    """Contexts pushed and never popped: in the main thread, in daemon threads still alive
    at exit, and in threads that ended with contexts on their stack."""
    primaries, owned = contexts()
    k = kernels()
    hold = threading.Event()
    ready = threading.Semaphore(0)

    def pusher(i: int, stay: bool) -> None:
        stack = [primaries[i % len(primaries)], owned, primaries[(i + 1) % len(primaries)]]
        for c in stack:
            c.push()
        buf = ck.DeviceBuffer(1 << 16)
        k["fill_f32"].launch(1, 128, buf, float(i), 1 << 14)
        _KEEP.append(buf)
        ready.release()
        if stay:
            hold.wait()

    threads = [
        threading.Thread(target=pusher, args=(i, i < 4), daemon=i < 4, name=f"pusher-{i}")
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for _ in threads:
        ready.acquire()
    primaries[0].push()
    owned.push()
    with ck.bind(primaries[-1]):
        _KEEP.append(ck.DeviceBuffer(1 << 16))
    _KEEP.extend([owned, hold, threads])


def scenario_resources() -> None:
    """Every resource kind alive in a primary and an owned context, with work still queued
    (a spin kernel and an async copy behind it) at exit."""
    primaries, owned = contexts()
    k = kernels()
    for ctx in (primaries[0], owned):
        items = resources_in(ctx, k)
        s, buf, pinned = items[0], items[1], items[5]
        with ctx:
            host = np.zeros(1 << 16, np.float32)
            registered = ck.register_host(host)
            registered.__enter__()  # left registered
            k["spin"].launch(1, 1, SPIN_100MS, 0, stream=s)
            buf[: pinned.nbytes].copy_to_host(pinned, stream=s)
        _KEEP.extend([items, host, registered])
    _KEEP.append(owned)


def scenario_executor() -> None:
    """ContextExecutors still running tasks (launches, copies) at exit, never shut down."""
    primaries, owned = contexts()
    k = kernels()

    def task(i: int) -> int:
        buf = ck.DeviceBuffer(1 << 16)
        k["fill_f32"].launch(1, 128, buf, float(i), 1 << 14)
        out = buf.copy_to_host(np.empty(1 << 14, np.float32))
        time.sleep(0.005)
        return int(out[0])

    ex = ck.ContextExecutor(primaries[0], max_workers=4)
    ex2 = ck.ContextExecutor(owned, max_workers=2)
    futs = [ex.submit(task, i) for i in range(200)] + [ex2.submit(task, i) for i in range(50)]
    for f in futs[:8]:
        if f.result() != futs.index(f):
            raise AssertionError("executor task computed a wrong value")
    _KEEP.extend([ex, ex2, futs, owned])


def scenario_pipeline() -> None:
    """A Pipeline left open after a map (and its trace), plus one with staging grown."""
    k = kernels()
    p = ck.Pipeline()
    x = np.random.default_rng(0).random(1 << 22, dtype=np.float32)
    out = p.map(k["scale_f32"], x, args=(np.float32(2.0),))
    if not np.array_equal(out, x * np.float32(2.0)):
        raise AssertionError("Pipeline.map computed a wrong result")
    timeline = p.trace()
    p2 = ck.Pipeline(devices=[0])
    p2.map(k["scale_f32"], x[: 1 << 20], args=(np.float32(3.0),))
    _KEEP.extend([p, p2, out, timeline])


def scenario_pipeline_busy() -> None:
    """Pipeline.map calls still running in daemon threads when the main thread returns: a
    long map, and a loop whose next call starts while the interpreter exits (neither may
    print a traceback or hang the exit)."""
    k = kernels()
    p = ck.Pipeline()
    q = ck.Pipeline(devices=[0])
    x = np.random.default_rng(1).random(1 << 25, dtype=np.float32)
    small = x[: 1 << 21]
    started = threading.Event()

    def run() -> None:
        started.set()
        p.map(k["scale_f32"], x, args=(np.float32(2.0),), chunk_bytes=1 << 22)

    def again() -> None:
        while True:
            out = q.map(k["scale_f32"], small, args=(np.float32(2.0),))
            if not np.array_equal(out, small * np.float32(2.0)):
                raise AssertionError("Pipeline.map computed a wrong result")

    threads = [
        threading.Thread(target=run, daemon=True, name="busy-map"),
        threading.Thread(target=again, daemon=True, name="busy-map-loop"),
    ]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)
    _KEEP.extend([p, q, x, threads])


def scenario_wrong_thread_free() -> None:
    """Objects freed from threads other than their creator's: one with no context, one
    with another context current, thread-local objects at thread exit, cycles at exit.

    A :class:`Ledger` checks that every handle made in the first three cases is freed,
    without error and in its own context. (Device-wide free memory cannot tell: the
    scenarios run ``--jobs`` at a time, and a process starting next to this one takes
    hundreds of MiB per context, far more than the few MiB these objects hold.)"""
    from ctxkit._driver import drv

    primaries, owned = contexts()
    ctxs = [*primaries, owned]
    k = kernels()
    ledger = Ledger(drv).install()
    errors: list[BaseException] = []

    ledger.phase = "dropped in a thread with no context"
    made: list[Any] = []
    for c in ctxs:
        made += resources_in(c, k)
    for c in ctxs:
        c.synchronize()

    def drop_without_context(items: list[Any]) -> None:
        try:
            if raw_current() != 0:
                raise AssertionError("a fresh thread has a current context")
            items.clear()
            gc.collect()
            if raw_current() != 0:
                raise AssertionError("freeing left a context current in the thread")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=drop_without_context, args=(made,), name="dropper")
    t.start()
    t.join()
    problems = ledger.problems(ledger.phase, ctxs, set(Ledger.PAIRS), thread="dropper")

    ledger.phase = "dropped with another context current"
    built: list[Any] = []

    def build(c: ck.Context) -> None:
        with ck.bind(c):
            built.extend([ck.DeviceBuffer(1 << 20), ck.Stream(), ck.Event()])

    threads = [threading.Thread(target=build, args=(c,)) for c in ctxs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with owned:
        built.clear()
        gc.collect()
        if raw_current() != owned.handle:
            errors.append(AssertionError("freeing in the main thread changed its context"))
    calls = {"cuMemAlloc", "cuStreamCreateWithPriority", "cuEventCreate"}
    problems += ledger.problems(ledger.phase, ctxs, calls, thread="MainThread")

    ledger.phase = "thread-local at thread exit"

    def thread_local_owner(c: ck.Context) -> None:
        local = threading.local()
        with ck.bind(c):
            local.buf = ck.DeviceBuffer(1 << 20)
            local.stream = ck.Stream()
        # the thread ends with nothing current; its locals are freed in its teardown

    for c in ctxs:
        th = threading.Thread(target=thread_local_owner, args=(c,))
        th.start()
        th.join()
    gc.collect()
    calls = {"cuMemAlloc", "cuStreamCreateWithPriority"}
    problems += ledger.problems(ledger.phase, ctxs, calls)
    ledger.uninstall()
    if problems:
        errors.append(AssertionError("\n".join(problems[:20])))
    if errors:
        raise errors[0]

    for c in ctxs:  # reference cycles: only the cyclic GC (at exit, any thread) frees them
        with c:
            cycle: list[Any] = [ck.DeviceBuffer(1 << 16), ck.Stream(), ck.Event()]
            cycle.append(cycle)
    hold = threading.Event()
    holding = threading.Semaphore(0)

    def keeper(c: ck.Context) -> None:  # a daemon thread holding objects, no context current
        with ck.bind(c):
            objs = [ck.DeviceBuffer(1 << 16), ck.Stream()]
        holding.release()
        hold.wait()
        del objs

    for c in ctxs:
        threading.Thread(target=keeper, args=(c,), daemon=True).start()
    for _ in ctxs:  # the objects exist before exit begins (a slow thread start made them late)
        if not holding.acquire(timeout=60):
            raise AssertionError("a keeper thread did not make its objects within 60 s")
    _KEEP.extend([owned, hold])


def scenario_poisoned() -> None:
    """A context poisoned by a kernel fault, its objects and those of another context
    still alive at exit, and an object of the other context dropped after the fault.

    On current drivers (580 / CUDA 13.0) the fault is process-wide: the use of device 0's
    context after device 1's fault must raise ContextPoisonedError (a driver that confines
    faults may let it compute: then the result must be right)."""
    primaries, victim = contexts()
    k = kernels()
    other = primaries[0]
    with other:
        survivor = ck.DeviceBuffer(1 << 16)
        dropped = ck.DeviceBuffer(1 << 16)
        other_stream = ck.Stream()
    with victim:
        buf = ck.DeviceBuffer(1 << 16)
        s = ck.Stream()
        ev = ck.Event()
        k["fault"].launch(1, 1, buf, stream=s)
        try:
            s.synchronize()
        except ck.ContextPoisonedError:
            pass
        else:
            raise AssertionError("the fault kernel did not poison the context")
    if not victim.poisoned:
        raise AssertionError("the victim context is not marked poisoned")
    del dropped  # freed in a context the driver now refuses: quietly, nothing printed
    gc.collect()
    try:
        with other:
            ok = ck.DeviceBuffer(1 << 16)
            k["fill_f32"].launch(1, 128, ok, 5.0, 1 << 14)
            if not np.all(ok.copy_to_host(np.empty(1 << 14, np.float32)) == 5.0):
                raise AssertionError(f"{other!r} computed a wrong result after the fault")
        _KEEP.append(ok)
    except ck.ContextPoisonedError as exc:
        if exc.name != "CUDA_ERROR_ILLEGAL_ADDRESS":
            raise AssertionError(f"unexpected error after the fault: {exc}") from exc
    _KEEP.extend([victim, buf, s, ev, survivor, other_stream])


def scenario_pending_host_func() -> None:
    """A host callback still queued behind a running kernel when the interpreter exits."""
    primaries, _owned = contexts()
    k = kernels()
    with primaries[0]:
        s = ck.Stream()
        calls: list[int] = []
        k["spin"].launch(1, 1, SPIN_100MS, 0, stream=s)
        s.launch_host_func(lambda: calls.append(1))
    _KEEP.extend([s, calls, _owned])


SCENARIOS: dict[str, Callable[[], None]] = {
    name[len("scenario_") :]: fn
    for name, fn in sorted(globals().items())
    if name.startswith("scenario_") and callable(fn)
}


# --- the parent ---------------------------------------------------------------------------


@dataclass
class Outcome:
    scenario: str
    run: int
    code: int | None
    stderr: str
    seconds: float

    @property
    def clean(self) -> bool:
        return self.code == 0 and self.stderr == ""


def run_child(scenario: str, run: int, timeout: float) -> Outcome:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", scenario],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        raw = exc.stderr or b""
        err = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw) + (
            f"\n[hung: killed after {timeout:.0f} s]"
        )
    return Outcome(scenario, run, code, err, time.perf_counter() - t0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs per scenario (default 20)")
    p.add_argument("--jobs", type=int, default=4, help="scenario processes at a time")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these scenarios")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds before a run is hung")
    p.add_argument("--list", action="store_true", help="print the scenario names and exit")
    p.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.child:
        SCENARIOS[args.child]()
        print(f"{args.child}: objects left alive for the interpreter's exit")
        return 0
    if args.list:
        print("\n".join(SCENARIOS))
        return 0
    names = args.only or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"exit_safety: unknown scenario(s) {unknown}; known: {list(SCENARIOS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if ck.device_count() == 0:
        print("no GPU: exit_safety.py needs an NVIDIA GPU and driver", file=sys.stderr)
        return 2
    print(f"exit safety: {len(names)} scenarios x {args.runs} runs, {args.jobs} at a time")
    tasks = [(name, i) for i in range(args.runs) for name in names]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        outcomes = list(pool.map(lambda t: run_child(t[0], t[1], args.timeout), tasks))
    failed = [o for o in outcomes if not o.clean]
    for name in names:
        mine = [o for o in outcomes if o.scenario == name]
        clean = sum(o.clean for o in mine)
        mean = sum(o.seconds for o in mine) / max(1, len(mine))
        print(f"{name:<20} {clean:>3}/{len(mine)} clean (exit 0, empty stderr)  {mean:.1f} s/run")
    for o in failed[:10]:
        tail = "\n    ".join(o.stderr.strip().splitlines()[-15:]) or "(stderr empty)"
        print(f"FAILED {o.scenario} run {o.run}: exit code {o.code}\n    {tail}")
    total = len(outcomes)
    print(f"exit safety: {total - len(failed)}/{total} runs clean")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
