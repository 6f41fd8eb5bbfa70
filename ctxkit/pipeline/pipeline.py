"""The :class:`Pipeline` (described in :mod:`ctxkit.pipeline`): its public API
(constructor, properties, ``map``/``map_managed``, cross-device stages, trace, lifetime)
and how it carries out a map call.

For one call it merges the call's options into the pipeline's, tells
:func:`~ctxkit.pipeline.plan.plan_map` what the host memory of both arrays is (claiming
pin on reuse), loads a kernel given as ``(ObjectCode, name)``, then carries out the run
(:meth:`Run.execute <ctxkit.pipeline.run.Run.execute>`: a feeder and a drain thread per
active device) and reports its first failure. What a Pipeline is given is turned into
what it works on here too:
``devices=`` into contexts, a device argument into an ordinal, an array into the kind of
its host memory and the ``x``/``out`` of ``map_managed`` into numpy views of managed
memory; the checks of a map's host arrays and options are
:func:`~ctxkit.pipeline.plan.prepare_io` and :class:`~ctxkit.pipeline.plan.PipelineOptions`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from .. import _driver
from .._driver import check_fork, in_forked_child
from ..binding import check_devices, registry
from ..compiler.objectcode import ObjectCode
from ..context import Context
from ..device import Device, device_count
from ..errors import CUDA_ERROR_NO_DEVICE, ContextPoisonedError, CudaError, PipelineError
from ..memory.host import host_pointer_kind, is_pinned
from ..memory.managed import ManagedBuffer
from ..memory.pinned import pinned_pool
from ..memory.streamcopy import build_streaming_copy
from ..module.kernel import Kernel
from ..module.module import Module
from ..stream import Event, Stream
from ..trace import Recorder, Timeline
from .pincache import Held, PinClaims, process_pins
from .plan import (
    PIPELINE_FIELDS,
    PipelineOptions,
    addr,
    default_chunk_bytes,
    plan_map,
    prepare_io,
    row_bytes,
)
from .run import Run, RunStats, make_launcher, run_stats
from .stages import StageHandle, Stages
from .staging import (
    DeviceState,
    HostPool,
    default_host_threads,
    give_back_host_pool,
    quiet_sync,
    shutdown_all,
    take_host_pool,
)

__all__ = ["Pipeline"]


class Pipeline:
    """Copy -> kernel -> copy over every GPU at once, from host numpy arrays.

    Parameters
    ----------
    devices : sequence of int, Device or Context, optional
        The devices to use (default: all visible). Ints and Devices use the registry's
        shared context of the device; a Context is used as given. Distinct contexts of
        one device (green partitions, ``ck.Device(0).partition([16])``, or owned
        contexts) are separate lanes, each with its own streams and staging; stats and
        trace rows then go by lane position instead of device ordinal.
    options : PipelineOptions, optional
        Chunk size, block, schedule, host paths, slots per device, host threads, pin on
        reuse and tracing (:class:`~ctxkit.pipeline.PipelineOptions`); the defaults of
        every :meth:`map` (a call may pass its own).

    Raises
    ------
    ValueError
        ``devices=[]``, a device or context listed twice, or an invalid option.
    TypeError
        *options* is not a :class:`~ctxkit.pipeline.PipelineOptions`.
    DriverNotFoundError, CudaError
        No driver, or no CUDA device (with ``devices=None``).

    Notes
    -----
    Kernel calling convention of :meth:`map`: ``kernel(d_in, d_out, n, *args)`` with
    device pointers to the chunk's input and output and ``n`` (``size_t``) the element
    count of the input chunk; launched with ``grid = min(ceil(n / block), device
    capacity)`` blocks, so kernels must use a grid-stride loop.

    What ``"auto"`` does and why, measured on 2x H200 with 32 CPUs
    (``benchmarks/bench_pipeline.py``, 2 GiB float32 pageable in and out): arrays seen
    for the first time are staged (14.5-21 GB/s on 1 GPU; two host copies per byte, and
    ``np.copyto`` peaks near 50 GB/s there, so staging is capped near 25 GB/s of input);
    registering each chunk just in time reached only 6.9 GB/s (page-locking plus
    unlocking runs at ~26 GB/s, for input and output, and slows the DMA running beside
    it). Arrays seen again are locked once (the registering call ran at ~9.5 GB/s) and
    then DMAed directly: 46.7 GB/s on 1 GPU and 64.5 GB/s on 2, 0.97x and 0.96x a
    hand-written pinned pipeline in the same run. Staging copies use non-temporal stores
    where :func:`ctxkit.memory.copy_streaming` can (llvmlite, x86-64).
    """

    def __init__(
        self,
        devices: Sequence[int | Device | Context] | None = None,
        options: PipelineOptions | None = None,
    ) -> None:
        check_fork("Pipeline")
        options = _check_options(options)
        self._pins = PinClaims(process_pins(), options.pin_cache_bytes)
        contexts = _resolve_contexts(check_devices(devices, "Pipeline", lanes=True))
        threads = options.host_threads or default_host_threads(len(contexts))
        self._options = dataclasses.replace(options.over(), host_threads=threads)
        self.tracing = bool(self._options.trace)
        ordinals = [c.device.ordinal for c in contexts]
        lanes = ordinals if len(set(ordinals)) == len(ordinals) else range(len(contexts))
        self._devices = [
            DeviceState(i, ctx, options.slots, lane)
            for i, (ctx, lane) in enumerate(zip(contexts, lanes, strict=True))
        ]
        self._host_pool: list[HostPool] = []  # a list: the finalizer sees it filled later
        self._lock = threading.RLock()
        self._run: Run | None = None
        self._recorder: Recorder | None = None
        self._stages = Stages()
        self._kernels: dict[tuple[int, str], tuple[Any, Module, Kernel]] = {}
        self._stats = RunStats()
        self._closed = False
        self._fin = weakref.finalize(self, shutdown_all, self._devices, self._host_pool, self._pins)
        self._fin.atexit = False
        build_streaming_copy()  # in the background: a staging copy never waits for it
        try:
            for dev in self._devices:
                dev.start_threads()
        except RuntimeError:
            _park_if_exiting()
            raise

    # --- properties ----------------------------------------------------------------

    @property
    def devices(self) -> list[Device]:
        """The devices, in the order work is split over them."""
        return [d.ctx.device for d in self._devices]

    @property
    def contexts(self) -> list[Context]:
        """The context used on each device."""
        return [d.ctx for d in self._devices]

    @property
    def options(self) -> PipelineOptions:
        """The pipeline's options, defaults filled in: what a :meth:`map` takes for every
        option its own *options* leave ``None``."""
        return self._options

    @property
    def poisoned(self) -> bool:
        """True when a device's context was poisoned by a fault (the pipeline is unusable)."""
        return any(d.ctx.poisoned for d in self._devices)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the user's pageable arrays kept page-locked for this pipeline by pin
        on reuse."""
        return self._pins.cache.claimed_bytes(self._pins)

    def release_pinned(self) -> int:
        """Stop keeping arrays page-locked for this pipeline; return the bytes it kept.

        Arrays no other Pipeline keeps are unregistered. Later calls start over (an
        array is staged, then locked when seen again).
        """
        check_fork("Pipeline.release_pinned")
        with self._lock:
            return self._pins.release()

    @property
    def last_stats(self) -> RunStats:
        """Bytes, seconds and per-device breakdown of the last :meth:`map`."""
        return self._stats

    def __repr__(self) -> str:
        state = " closed" if self._closed else (" poisoned" if self.poisoned else "")
        return f"<Pipeline devices={[d.ordinal for d in self._devices]}{state}>"

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- map -----------------------------------------------------------------------

    def map(
        self,
        kernel: Any,
        x: Any,
        out: np.ndarray | str | None = None,
        args: Sequence[Any] = (),
        chunk_bytes: int | None = None,
        *,
        progress: bool = False,
        options: PipelineOptions | None = None,
    ) -> np.ndarray:
        """Run ``kernel`` over *x* chunk by chunk on every device; return *out*.

        Parameters
        ----------
        kernel : Kernel, (ObjectCode, entry name) or callable
            A :class:`~ctxkit.module.Kernel` (loaded in any context: it runs on every
            device), a compiled object and the entry to load from it, or a callable
            ``body(ctx, stream, d_in, d_out, n, *args)`` that enqueues arbitrary work on
            ``stream`` (``d_in``/``d_out`` are :class:`ChunkView`).
        x : numpy.ndarray
            Input; split along the first axis. Pinned (``ctxkit.pinned_empty``) input is
            copied directly; pageable input takes the pipeline's ``host_path``.
        out : numpy.ndarray, "pinned" or "pageable", optional
            Output. It may differ from *x* in dtype and row shape (same number of rows);
            each chunk's kernel writes the matching rows. ``out=x`` works in place.
            ``out="pinned"``: a new array shaped like *x* in page-locked memory of the
            process's pinned pool (:func:`ctxkit.pinned_pool`), written by DMA directly
            (no staging copy, no first touch of fresh pages); its block goes back to the
            pool when the caller drops the array (and every view of it), and a later map
            reuses it. Default (``None``): the same when *x* has at least 4 MiB, the
            pool has room without waiting (its budget, ``CTXKIT_PINNED_POOL_BYTES``) and
            the output's ``host_path`` is ``"auto"``, else ``np.empty_like(x)``;
            ``out="pageable"`` always takes the latter.
        args : sequence
            Extra kernel (or body) arguments after ``(d_in, d_out, n)``.
        chunk_bytes : int, optional
            Chunk size for this call (default: the options').
        progress : bool
            Show a progress bar of the finished chunks: tqdm when installed, else one
            line on stderr. Off by default.
        options : PipelineOptions, optional
            How this call runs (block, schedule, host path, ...): each field left ``None``
            is the pipeline's (:attr:`options`). Its ``staging_buffers``,
            ``host_threads``, ``pin_cache_bytes`` and ``trace`` must be ``None`` or the
            pipeline's.

        Raises
        ------
        PipelineError
            A chunk failed: the message names the device, chunk, rows and step.
        ContextPoisonedError
            The pipeline is unusable after an earlier fault.
        CompileError
            A Kernel could not be loaded on one of the devices.
        ValueError
            *options* sets up the pipeline differently (see above).

        Notes
        -----
        A Kernel is loaded into every device's context before the first chunk is
        enqueued (:meth:`Kernel.preload`), so no launch waits for lazy loading.
        """
        check_fork("Pipeline.map")
        options = self._call_options(options, chunk_bytes)
        if out is None and options.paths[1] != "auto":
            out = "pageable"  # the output's host path was asked for: it applies
        new_out = out is None or isinstance(out, str)
        if new_out:
            self._check_usable()  # before anything is allocated for a closed pipeline
        headroom = self._staging_bytes(x, options) if out is None else 0
        x, out = prepare_io(x, out, self._devices[0].ctx, headroom)
        pooled = new_out and out.nbytes > 0 and pinned_pool().owns(out)
        made = "pooled" if pooled else "fresh" if new_out else ""
        return self._map(kernel, x, out, args, options, progress, made)

    def map_managed(
        self,
        kernel: Any,
        x: Any,
        out: Any = None,
        args: Sequence[Any] = (),
        *,
        dtype: Any = None,
        progress: bool = False,
        options: PipelineOptions | None = None,
    ) -> np.ndarray:
        """The map of :meth:`map` over unified (managed) memory: no staging, no copies.

        Each device prefetches its chunks of *x* and *out* (``cuMemPrefetchAsync``),
        runs the kernel on them in place, and (``options.to_host``) prefetches the results
        back to host memory.

        Parameters
        ----------
        x : ManagedBuffer or numpy.ndarray
            Managed memory: a :class:`~ctxkit.memory.ManagedBuffer` (give ``dtype``; it
            is viewed as one dimension) or a numpy view of one
            (``buf.as_numpy(dtype, shape)``).
        out : ManagedBuffer, numpy.ndarray or None
            Managed output; default: a new ManagedBuffer shaped like *x*. ``out=x``
            works in place.
        dtype : numpy dtype, optional
            The element type to view a ManagedBuffer *x* (and *out*) as.
        progress : bool
            Show a progress bar of the finished chunks (see :meth:`map`).
        options : PipelineOptions, optional
            As for :meth:`map`; ``prefetch`` and ``to_host`` say whether chunks are
            prefetched to the device before the kernel / back to the host after.

        Returns
        -------
        numpy.ndarray
            The output as a numpy view of managed memory (it keeps the buffer alive).
        """
        check_fork("Pipeline.map_managed")
        self._check_usable()
        options = self._call_options(options)
        xa = _managed_array(x, dtype, "x")
        if out is None:
            buf = ManagedBuffer(xa.nbytes, context=self._devices[0].ctx)
            oa = buf.as_numpy(xa.dtype, xa.shape)
        else:
            oa = _managed_array(out, dtype or xa.dtype, "out", xa.shape)
        xa, oa = prepare_io(xa, oa)
        with self._devices[0].ctx:
            for arr, what in ((xa, "x"), (oa, "out")):
                if arr.nbytes and host_pointer_kind(addr(arr)) != "managed":
                    raise ValueError(
                        f"map_managed: {what} is not unified (managed) memory; allocate it "
                        "with ctxkit.ManagedBuffer (or use Pipeline.map for host arrays)"
                    )
        self._map(kernel, xa, oa, args, options, progress, managed=True)
        return oa

    # --- cross-device stages ----------------------------------------------------------

    def stream(self, device: int | Device | Context) -> Stream:
        """The stream :meth:`submit` stages of *device* run on."""
        return self._device_for(device).stage_stream

    def submit(
        self,
        device: int | Device | Context,
        fn: Callable[[Context, Stream], Any],
        after: Iterable[StageHandle | Event] = (),
        *,
        name: str | None = None,
    ) -> StageHandle:
        """Enqueue ``fn(ctx, stream)`` on *device* after the stages in *after* completed.

        ``fn`` runs on the device's worker thread with its context current and enqueues
        work on ``stream`` (:meth:`stream`); an event recorded after it completes the
        returned handle. The device's stream waits for every handle (or Event) in
        *after* on the GPU (``cuStreamWaitEvent``, across devices), without blocking
        the host. Stages on one device run in submission order. The pipeline forgets a
        stage once its work completed: keep the handle to use it later.

        Load the kernels ``fn`` launches beforehand (:meth:`Kernel.preload`): under
        lazy loading the first launch of a kernel may wait until the context is idle,
        which delays the stage's event and with it every stage waiting for it.
        """
        check_fork("Pipeline.submit")
        self._check_usable()
        dev = self._device_for(device)
        with self._lock:
            if self._recorder is None and self.tracing:
                self._recorder = Recorder()
            rec = self._recorder
        return self._stages.submit(dev, fn, after, name, rec)

    def wait(self, handles: Iterable[StageHandle] | None = None) -> None:
        """Wait for the GPU work of *handles* (default: every stage submitted so far).

        Raises
        ------
        PipelineError
            A stage failed; the message names its device and name.
        """
        check_fork("Pipeline.wait")
        self._stages.wait(handles)

    # --- trace ---------------------------------------------------------------------

    def trace(self) -> Timeline:
        """The timeline of the last :meth:`map` (and the stages submitted since); still
        available after :meth:`close`.

        Intervals: ``h2d``/``kernel``/``d2h`` per chunk on ``"stream <slot>"``,
        ``fill``/``drain`` staging copies and ``register``/``unregister`` page locking
        on ``"host <thread>"``, ``prefetch`` in managed mode, and
        ``wait``/``stage:<name>`` on ``"stage"``. Empty when tracing is off.
        """
        rec = self._recorder
        if rec is None:
            return Timeline()
        check_fork("Pipeline.trace")
        if self._closed:
            return rec.timeline()  # resolved by close() while the events existed
        with self._lock:
            self._stages.settle()
            with self._devices[0].ctx:
                return rec.timeline()

    # --- lifetime ------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for all work the pipeline enqueued, on every device."""
        check_fork("Pipeline.synchronize")
        for dev in self._devices:
            for s in dev.streams():
                s.synchronize()

    def close(self) -> None:
        """Stop the device worker threads and free every buffer, stream and event; the
        host copy threads are left idle for the next Pipeline
        (:func:`~ctxkit.pipeline.close_idle_host_threads`). Idempotent; in a forked child
        it only marks the pipeline closed (its threads and memory are the parent's)."""
        if in_forked_child():
            self._closed = True
            self._fin.detach()
            return
        with self._lock:
            if self._closed:
                return
            self._stages.join()
            if self._recorder is not None and not self.poisoned:
                with suppress(Exception):  # the timeline is a diagnostic: never block close()
                    self.trace()
            self._closed = True
            self._fin.detach()
            for dev in self._devices:
                quiet_sync(dev)
                dev.release()
            self._pins.release()
            for p in self._host_pool:
                give_back_host_pool(p)
            self._host_pool.clear()
            self._kernels.clear()
            self._stages.clear()
            self._run = None

    # --- helpers -------------------------------------------------------------------

    def _device_for(self, device: int | Device | Context) -> DeviceState:
        ordinal = device.ordinal if isinstance(device, Device) else device
        for dev in self._devices:
            if dev.ctx == device or (type(ordinal) is int and dev.ordinal == ordinal):
                return dev
        raise ValueError(
            f"{device!r} is not one of this pipeline's devices {[d.ordinal for d in self._devices]}"
        )

    # --- carrying out a map -------------------------------------------------------

    def _staging_bytes(self, x: Any, opts: PipelineOptions) -> int:
        """Bytes of input and output staging buffers a map of *x* may use on every device:
        the headroom a pooled default output leaves in the pool's budget (so the
        staging of this map, or of a later pageable output, still fits)."""
        nbytes = getattr(x, "nbytes", 0)
        chunk = opts.chunk_bytes or default_chunk_bytes(nbytes, len(self._devices))
        return 2 * len(self._devices) * opts.slots * min(chunk, nbytes)

    def _call_options(
        self, options: PipelineOptions | None, chunk_bytes: int | None = None
    ) -> PipelineOptions:
        """The options of one call: *options* over the pipeline's, *chunk_bytes* over
        both (the pipeline's own object when the call changes nothing, as most do)."""
        base = self._options
        if options is not None:
            options = _check_options(options)
            for name in PIPELINE_FIELDS:
                mine, theirs = getattr(base, name), getattr(options, name)
                if theirs is not None and theirs != mine:
                    raise ValueError(
                        f"options.{name}={theirs!r} differs from the pipeline's ({mine!r}): "
                        "it is set when the Pipeline is made; leave it None in a call's options"
                    )
            merged = options.over(base)
            base = base if merged == base else merged
        if chunk_bytes is not None and chunk_bytes != base.chunk_bytes:
            base = dataclasses.replace(base, chunk_bytes=chunk_bytes)
        return base

    def _map(
        self,
        kernel: Any,
        x: np.ndarray,
        out: np.ndarray,
        args: Sequence[Any],
        opts: PipelineOptions,
        progress: bool = False,
        made_out: str = "",
        managed: bool = False,
    ) -> np.ndarray:
        """The map behind :meth:`map` and :meth:`map_managed`, its input checked already.
        *made_out*: ``"pooled"`` or ``"fresh"`` when :meth:`map` made *out* (in the
        pinned pool, or with ``np.empty_like``), ``""`` when the caller gave it."""
        self._check_usable()
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple of extra kernel arguments, not {type(args)}")
        try:
            with self._lock:
                if isinstance(kernel, tuple):
                    kernel = self._load(kernel)
                launch = make_launcher(kernel, x, out, tuple(args), opts.block or 256)
                self._check_usable()
                if isinstance(kernel, Kernel):
                    for dev in self._devices:
                        kernel.preload(dev.ctx)
                self._new_recording()
                t0 = time.perf_counter()
                held: list[Held] = []
                try:
                    host = ("managed", "managed")
                    if not managed:
                        host = self._host_kinds(x, out, opts.paths, held, made_out == "pooled")
                    rows = (row_bytes(x), row_bytes(out))
                    plan = plan_map(x.shape[0], rows, len(self._devices), opts, host)
                    run = Run(x, out, plan, launch, self._recorder, made_out == "fresh")
                    if not plan.empty:
                        self._execute(run, progress)
                finally:
                    self._pins.cache.done(held)
                self._stats = run_stats(run, time.perf_counter() - t0, x.nbytes)
        except RuntimeError:
            _park_if_exiting()
            raise
        return out

    def _execute(self, run: Run, progress: bool = False) -> None:
        plan = run.plan
        if plan.needs_pool and not self._host_pool:
            self._host_pool.append(take_host_pool(self._options.host_threads or 2))
        self._run = run
        run.execute(
            [self._devices[part] for part in plan.active],
            self._host_pool[0] if plan.needs_pool else None,
            progress,
        )
        if not self.tracing:
            for dev in self._devices:
                dev.recycle()
        if run.errors:
            if self.poisoned:
                self._pins.cache.strand_poisoned()
            first = run.errors[0]
            if isinstance(first, PipelineError) and len(run.errors) > 1:
                first.args = (f"{first} (+{len(run.errors) - 1} more errors in this run)",)
            raise first

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

        def kind(a: np.ndarray, path: str, read_only: bool) -> str:
            pins = self._pins
            h = pins.cache.acquire(a, ctxs, read_only, pins) if path == "auto" else None
            if h is None:
                return "pinned" if a.nbytes and is_pinned(a) else "pageable"
            held.append(h)
            return "held"

        if pooled_out:
            return kind(x, paths[0], True), "pinned"
        if x.nbytes and x.nbytes == out.nbytes and addr(x) == addr(out):  # in place
            both = kind(x, "auto" if "auto" in paths else paths[0], False)
            return both, both
        return kind(x, paths[0], True), kind(out, paths[1], False)

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
        if (hit := self._kernels.get(key)) is not None and hit[0] is obj:
            return hit[2]
        with self._devices[0].ctx:
            mod = Module.load(obj)
            kern = mod.function(name)
        self._kernels[key] = (obj, mod, kern)
        return kern

    # --- trace recording -------------------------------------------------------------

    def _new_recording(self) -> None:
        for dev in self._devices:
            dev.recycle()  # the last run's trace is dropped with its recorder
        self._recorder = Recorder() if self.tracing else None

    # --- checks -------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError("this Pipeline is closed; create a new one")
        for dev in self._devices:
            if dev.ctx.poisoned:
                self._pins.cache.strand_poisoned()
                try:
                    dev.ctx.check_usable()
                except ContextPoisonedError as exc:
                    msg = (
                        f"this Pipeline is unusable: the context of device {dev.ordinal} was "
                        f"poisoned by an earlier fault ({exc}); close() it and restart the "
                        "process (or reset the device) to use the GPU again"
                    )
                    raise ContextPoisonedError(msg, exc.code, exc.name) from exc


def _park_if_exiting() -> None:
    """A daemon thread that cannot start a thread or submit work because the interpreter
    is exiting waits here for the exit instead of printing a traceback (the interpreter
    stops daemon threads; non-daemon ones get the error)."""
    if threading.current_thread().daemon and not threading.main_thread().is_alive():
        threading.Event().wait()


def _resolve_contexts(specs: list[int | Device | Context] | None) -> list[Context]:
    if specs is None:
        if (n := device_count()) == 0:
            _driver.init()
            msg = (
                "Pipeline(devices=None): no CUDA device is visible (the driver reports "
                "none); check nvidia-smi and CUDA_VISIBLE_DEVICES"
            )
            raise CudaError(msg, CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE")
        specs = list(range(n))
    contexts = [registry.resolve(d) for d in specs]
    for i, ctx in enumerate(contexts):
        ctx.check_usable()
        if ctx in contexts[:i]:
            raise ValueError(f"Pipeline: {ctx!r} is listed twice in devices={specs!r}")
    return contexts


def _managed_array(
    obj: Any, dtype: Any, what: str, shape: tuple[int, ...] | None = None
) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, ManagedBuffer):
        if dtype is None:
            raise TypeError(f"map_managed: pass dtype= to view the ManagedBuffer {what} as")
        return obj.as_numpy(dtype) if shape is None else obj.as_numpy(dtype, shape)
    raise TypeError(
        f"map_managed: {what} must be a ManagedBuffer or a numpy view of one, "
        f"got {type(obj).__name__}"
    )


def _check_options(options: PipelineOptions | None) -> PipelineOptions:
    if options is None:
        return PipelineOptions()
    if not isinstance(options, PipelineOptions):
        raise TypeError(
            "options must be a ctxkit.PipelineOptions (e.g. "
            f"PipelineOptions(schedule='dynamic')), not {type(options).__name__}"
        )
    return options
