"""How a :class:`~ctxkit.pipeline.pipeline.Pipeline` carries out a map call: its base
class :class:`MapRunner`.

For one call it merges the call's overrides into the pipeline's options, tells
:func:`~ctxkit.pipeline.plan.plan_map` what the host memory of both arrays is (claiming
pin on reuse), loads a kernel given as ``(ObjectCode, name)``, then starts a feeder and a
drain thread per active device (:mod:`ctxkit.pipeline.run`,
:mod:`ctxkit.pipeline.run`) and waits for them in short timed waits, so that Ctrl-C
stops the run promptly, yet never returns while a worker may still touch the arrays. A
base class, so that the body of ``Pipeline`` is its public API (the members the API
docs list).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import numpy as np

from ..compiler.objectcode import ObjectCode
from ..context import Context
from ..errors import ContextPoisonedError, PipelineError
from ..module.kernel import Kernel
from ..module.module import Module
from ..trace import Recorder
from .arguments import _memory_kind
from .pincache import Held, PinClaims
from .plan import MapOptions, addr, default_chunk_bytes, plan_map, row_bytes
from .run import (
    DeviceStats,
    Run,
    RunStats,
    drain,
    feed,
    make_bar,
    make_launcher,
    run_stats,
    unblock_if_not_run,
)
from .staging import DeviceState, HostPool, Progress, Registrar, take_host_pool

__all__ = ["MapRunner"]


class MapRunner:
    """The base class of :class:`~ctxkit.pipeline.pipeline.Pipeline` that carries out its
    map calls; the state it works on is set up by ``Pipeline.__init__``."""

    tracing: bool
    _options: MapOptions
    _devices: list[DeviceState]
    _host_pool: list[HostPool]
    _lock: threading.RLock
    _run: Run | None
    _recorder: Recorder | None
    _kernels: dict[tuple[int, str], tuple[Any, Module, Kernel]]
    _stats: RunStats
    _closed: bool
    _pins: PinClaims

    if TYPE_CHECKING:  # properties of Pipeline

        @property
        def contexts(self) -> list[Context]: ...

        @property
        def host_threads(self) -> int: ...

        @property
        def poisoned(self) -> bool: ...

    # --- map -----------------------------------------------------------------------

    def _staging_bytes(self, x: Any, opts: MapOptions) -> int:
        """Bytes of input and output staging buffers a map of *x* may use on every device:
        the headroom a pooled default output leaves in the pool's budget (so the
        staging of this map, or of a later pageable output, still fits)."""
        nbytes = getattr(x, "nbytes", 0)
        chunk = opts.chunk_bytes or default_chunk_bytes(nbytes, len(self._devices))
        return 2 * len(self._devices) * opts.staging_buffers * min(chunk, nbytes)

    def _options_for(
        self, chunk_bytes: int | None, block: int, schedule: str | None, **more: Any
    ) -> MapOptions:
        """The pipeline's options with one call's overrides (the same object when the
        call overrides nothing, as most do)."""
        base = self._options
        if more.get("host_path") is None:
            more.pop("host_path", None)
        if chunk_bytes is not None:
            more["chunk_bytes"] = chunk_bytes
        if schedule is not None:
            more["schedule"] = schedule
        more["block"] = block
        changes = {k: v for k, v in more.items() if getattr(base, k) != v}
        return dataclasses.replace(base, **changes) if changes else base

    def _map(
        self,
        kernel: Any,
        x: np.ndarray,
        out: np.ndarray,
        args: Sequence[Any],
        opts: MapOptions,
        progress: bool = False,
        pooled_out: bool = False,
    ) -> np.ndarray:
        self._check_usable()
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of extra kernel arguments, not {type(args)}")
        try:
            with self._lock:
                if isinstance(kernel, tuple):
                    kernel = self._load(kernel)
                launch = make_launcher(kernel, x, out, tuple(args), opts.block)
                self._check_usable()
                if isinstance(kernel, Kernel):
                    for dev in self._devices:
                        kernel.preload(dev.ctx)
                self._new_recording()
                t0 = time.perf_counter()
                held: list[Held] = []
                try:
                    host = ("pinned", "pinned")
                    if not opts.managed:
                        host = self._host_kinds(x, out, opts.host_path, held, pooled_out)
                    rows = (row_bytes(x), row_bytes(out))
                    plan = plan_map(x.shape[0], rows, len(self._devices), opts, host)
                    run = Run(x, out, plan, launch, self._recorder)
                    if not plan.empty:
                        self._execute(run, progress)
                finally:
                    self._pins.done(held)
                self._stats = run_stats(run, time.perf_counter() - t0, x.nbytes)
        except RuntimeError:
            _park_if_exiting()
            raise
        return out

    def _execute(self, run: Run, progress: bool = False) -> None:
        plan = run.plan
        if progress:
            run.bar = make_bar(len(plan.chunks))
        try:
            self._execute_run(run)
        finally:
            if run.bar is not None:
                run.bar.close()

    def _execute_run(self, run: Run) -> None:
        plan = run.plan
        if plan.needs_pool:
            run.pool = self._pool()
        if plan.registers:
            assert run.pool is not None
            run.registrar = Registrar(run.pool, run.stop, run.rec)
        self._run = run
        futures: list[Future[Any]] = []
        try:
            for dev in (self._devices[part] for part in plan.active):
                q: queue.SimpleQueue[Any] = queue.SimpleQueue()
                run.stats[dev.ordinal] = DeviceStats(dev.ordinal)
                run.taken[dev.ordinal] = []
                run.progress[dev.ordinal] = Progress()
                feeder = dev.worker.submit(feed, run, dev, q)
                feeder.add_done_callback(functools.partial(unblock_if_not_run, q))
                futures.append(feeder)
                futures.append(dev.drainer.submit(drain, run, dev, q))
            for f in futures:
                _result_interruptibly(f)
        except BaseException:
            _stop_and_wait(run, futures)
            raise
        finally:
            run.drop_arrays()
        if not self.tracing:
            self._recycle(run)
        if run.errors:
            if self.poisoned:
                self._pins.cache.strand_poisoned()
            first = run.errors[0]
            if isinstance(first, PipelineError) and len(run.errors) > 1:
                first.args = (f"{first} (+{len(run.errors) - 1} more errors in this run)",)
            raise first

    def _pool(self) -> HostPool:
        if not self._host_pool:
            self._host_pool.append(take_host_pool(self.host_threads))
        return self._host_pool[0]

    def _host_kinds(
        self,
        x: np.ndarray,
        out: np.ndarray,
        paths: tuple[str, str],
        held: list[Held],
        pooled_out: bool = False,
    ) -> tuple[str, str]:
        """What the input's and the output's memory is for :func:`plan_map`:
        ``"held"`` when pin on reuse keeps it locked (only asked for sides on the
        ``"auto"`` path; the ranges it lends are added to *held*), ``"pinned"`` when
        page-locked otherwise (*pooled_out*: the output comes from the pinned pool),
        else ``"pageable"``."""
        ctxs = self.contexts

        def hold(a: np.ndarray, read_only: bool) -> bool:
            h = self._pins.acquire(a, ctxs, read_only)
            if h is not None:
                held.append(h)
            return h is not None

        if pooled_out:
            held_in = paths[0] == "auto" and hold(x, True)
            return ("held" if held_in else _memory_kind(x)), "pinned"
        if x.nbytes and x.nbytes == out.nbytes and addr(x) == addr(out):
            held_in = held_out = "auto" in paths and hold(x, False)
        else:
            held_in = paths[0] == "auto" and hold(x, True)
            held_out = paths[1] == "auto" and hold(out, False)
        return (
            "held" if held_in else _memory_kind(x),
            "held" if held_out else _memory_kind(out),
        )

    # --- kernels -------------------------------------------------------------------

    def _load(self, pair: tuple[Any, ...]) -> Kernel:
        if len(pair) != 2 or not isinstance(pair[1], str):
            raise TypeError(
                "a kernel given as a tuple must be (ObjectCode, 'entry_name'), got "
                f"{tuple(type(p).__name__ for p in pair)}"
            )
        obj, name = pair
        if not isinstance(obj, (ObjectCode, bytes, str, os.PathLike)):
            raise TypeError(
                f"the first element of a kernel pair must be an ObjectCode (or bytes/path), "
                f"got {type(obj).__name__}"
            )
        key = (id(obj), name)
        hit = self._kernels.get(key)
        if hit is not None and hit[0] is obj:
            return hit[2]
        with self._devices[0].ctx:
            mod = Module.load(obj)
            kern = mod.function(name)
        self._kernels[key] = (obj, mod, kern)
        return kern

    # --- trace ---------------------------------------------------------------------

    def _new_recording(self) -> None:
        old = self._run
        if old is not None:
            self._recycle(old)
            self._run = None
        self._recorder = Recorder() if self.tracing else None

    def _recycle(self, run: Run) -> None:
        by_ordinal = {d.ordinal: d for d in self._devices}
        for ordinal, events in run.taken.items():
            by_ordinal[ordinal].give_back(events)
        run.taken = {}

    # --- helpers -------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError("this Pipeline is closed; create a new one")
        for dev in self._devices:
            if dev.ctx.poisoned:
                self._pins.cache.strand_poisoned()
                try:
                    dev.ctx.check_usable()
                except ContextPoisonedError as exc:
                    raise ContextPoisonedError(
                        f"this Pipeline is unusable: the context of device {dev.ordinal} was "
                        f"poisoned by an earlier fault ({exc}); close() it and restart the "
                        "process (or reset the device) to use the GPU again",
                        exc.code,
                        exc.name,
                    ) from exc


INTERRUPT_POLL_S = 0.05


def _result_interruptibly(f: Future[Any]) -> Any:
    """``f.result()``, with Ctrl-C handled within :data:`INTERRUPT_POLL_S`.

    A signal that arrives just before a thread blocks on a lock without a timeout is only
    handled once the lock is released (CPython checks pending signals between bytecodes,
    not before the wait): ``map`` would run to its end before raising KeyboardInterrupt.
    Short timed waits bound that delay.
    """
    while not f.done():
        wait_futures([f], timeout=INTERRUPT_POLL_S)
    return f.result()


def _stop_and_wait(run: Run, futures: list[Future[Any]]) -> None:
    """Stop *run* and wait until its feeders and drainers have finished, however many
    more Ctrl-C arrive meanwhile (the first one is what ``map`` raises): the arrays must
    not be touched once ``map`` is back in the caller's hands."""
    while True:
        try:
            run.stop.set()
            wait_futures(futures)
            return
        except BaseException:
            continue


def _park_if_exiting() -> None:
    """A daemon thread that cannot start a thread or submit work because the interpreter
    is exiting waits here for the exit instead of printing a traceback (the interpreter
    stops daemon threads; non-daemon ones get the error)."""
    if threading.current_thread().daemon and not threading.main_thread().is_alive():
        threading.Event().wait()
