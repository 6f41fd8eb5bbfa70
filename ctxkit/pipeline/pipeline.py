"""The :class:`Pipeline` (described in :mod:`ctxkit.pipeline`): its public API
(constructor, properties, ``map``/``map_managed``, cross-device stages, trace, lifetime)
and how it carries out a map call.

For one call it merges the call's options into the pipeline's, tells
:func:`~ctxkit.pipeline.plan.plan_map` what the host memory of both arrays is (claiming
pin on reuse), loads a kernel given as ``(ObjectCode, name)``, then starts a feeder and a
drain thread per active device (:mod:`ctxkit.pipeline.run`) and waits for them in short
timed waits, so that Ctrl-C stops the run promptly, yet never returns while a worker may
still touch the arrays. What a Pipeline is given is turned into what it works on here too:
``devices=`` into contexts, a device argument into an ordinal, an array into the kind of
its host memory and the ``x``/``out`` of ``map_managed`` into numpy views of managed
memory; the checks of a map's host arrays and options are
:func:`~ctxkit.pipeline.plan.prepare_io` and :class:`~ctxkit.pipeline.plan.MapOptions`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from .. import _driver, registry
from .._driver import check_fork, in_forked_child
from ..compiler.objectcode import ObjectCode
from ..context import Context
from ..device import Device, device_count
from ..errors import ContextPoisonedError, CudaError, PipelineError
from ..memory.host import host_pointer_kind, is_pinned
from ..memory.hostpool import pinned_pool
from ..memory.managed import ManagedBuffer
from ..memory.streamcopy import build_streaming_copy
from ..module.kernel import Kernel
from ..module.module import Module
from ..registry import check_devices
from ..stream import Event, Stream
from ..trace import Recorder, Timeline
from .pincache import Held, PinClaims, process_pins
from .plan import (
    DEFAULT_STAGING_BUFFERS,
    MapOptions,
    addr,
    check_host_path,
    default_chunk_bytes,
    plan_map,
    prepare_io,
    row_bytes,
)
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
from .stages import StageHandle, Stages
from .staging import (
    DeviceState,
    HostPool,
    Progress,
    Registrar,
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
        shared context of the device; a Context is used as given.
    chunk_bytes : int, optional
        Default chunk size in bytes (per :meth:`map` overridable). Default: 64 MiB, less
        when a device would get fewer than 8 chunks; a map runs at most 65536 chunks.
    staging_buffers : int
        Slots per device (default 4, at most 64): each has a stream, an input and an output device
        buffer and, for pageable data, pinned staging (or small bounce) buffers. A
        slot's buffers are allocated when a :meth:`map` first uses it (pinned ones come
        from the process's pinned pool), reused, grown when a later call needs bigger
        chunks, freed by :meth:`close` (pinned ones back to the pool). The staged inputs
        of all slots fill at once on the host pool while the GPU works and earlier
        outputs drain. A device keeps at most this many chunks in flight (twice as many
        when they use no slot buffer), which also bounds what an interrupted
        :meth:`map` waits for.
    host_threads : int, optional
        Threads of the host pool (staging copies, page registration), at most 256.
        Default: 16, at most the usable CPUs minus two per device minus one, at least 2.
    host_path : {"auto", "staged", "register", "split"} or (input, output) pair of them
        How pageable arrays reach the devices (pinned arrays are always copied
        directly): ``"staged"`` copies each chunk through pinned staging buffers (two
        host memory copies per byte); ``"register"`` page-locks the chunk's own pages
        just in time (``cuMemHostRegister``, in parallel on the host pool, a few chunks
        ahead) and DMAs straight from/to them, bouncing only the partial pages at the
        array's ends and chunk boundaries; the pages are unregistered once the chunk's
        D2H completed, before :meth:`map` returns. ``"split"`` (input only; the output
        is staged): one host thread registers the input's chunks from the last one
        backwards while the others stage them from the first one forwards, meeting in
        the middle (static schedule; staged under the dynamic one). ``"auto"``:
        staging, and pin on reuse (see *pin_cache_bytes*). Per-call override:
        ``map(host_path=...)``.
    pin_cache_bytes : int, optional
        Pin on reuse, for ``host_path="auto"``: a pageable array (16 MiB or more) that a
        later :meth:`map` call sees again is page-locked once (``cuMemHostRegister``)
        and kept locked while its memory lives, so every further call DMAs it directly,
        as if it were pinned. Only the whole pages inside the array are locked (the
        bytes on its partial end pages are bounced), never memory next to it. This
        bounds the bytes this pipeline keeps locked (least recently used arrays are
        released first); 0 turns it off. Default: the process budget. See
        :meth:`release_pinned`.

        The budget is one per process, shared by every Pipeline (a registration serves
        all of them) and by the pinned pool its staging buffers and pinned outputs come
        from (:func:`ctxkit.pinned_pool`; ``CTXKIT_PINNED_POOL_BYTES``, default a
        quarter of physical memory, at most 64 GiB): an array is held only when the pool
        can make room for it, else it is staged. With several processes per node (MPI
        ranks, ``run_per_device`` workers) each has its own: set
        ``CTXKIT_PINNED_POOL_BYTES`` to about a quarter of the node's memory divided by
        the processes per node.
    schedule : {"static", "dynamic"}
        ``"static"``: an even contiguous share of rows per device. ``"dynamic"``: devices
        take chunks from a shared queue (work stealing; helps unequal devices).
    trace : bool
        Record events around every stage so that :meth:`trace` can show the timeline.

    Raises
    ------
    ValueError
        ``devices=[]``, duplicate devices, or an invalid option.
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
        chunk_bytes: int | None = None,
        staging_buffers: int = DEFAULT_STAGING_BUFFERS,
        host_threads: int | None = None,
        *,
        schedule: str = "static",
        trace: bool = True,
        host_path: str | tuple[str, str] = "auto",
        pin_cache_bytes: int | None = None,
    ) -> None:
        check_fork("Pipeline")
        options = MapOptions(
            chunk_bytes,
            schedule=schedule,
            host_path=check_host_path(host_path),
            staging_buffers=staging_buffers,
            host_threads=1 if host_threads is None else host_threads,
        )
        pins = PinClaims(process_pins(), pin_cache_bytes)
        contexts = _resolve_contexts(check_devices(devices, "Pipeline"))
        threads = host_threads or default_host_threads(len(contexts))
        self._options = dataclasses.replace(options, host_threads=threads)
        self.tracing = bool(trace)
        self._devices = [DeviceState(i, ctx, staging_buffers) for i, ctx in enumerate(contexts)]
        self._host_pool: list[HostPool] = []  # a list: the finalizer sees it filled later
        self._lock = threading.RLock()
        self._run: Run | None = None
        self._recorder: Recorder | None = None
        self._stages = Stages()
        self._kernels: dict[tuple[int, str], tuple[Any, Module, Kernel]] = {}
        self._stats = RunStats()
        self._closed = False
        self._pins = pins
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
    def chunk_bytes(self) -> int | None:
        """The default chunk size (``None``: :func:`~ctxkit.pipeline.default_chunk_bytes`)."""
        return self._options.chunk_bytes

    @property
    def staging_buffers(self) -> int:
        """Slots per device."""
        return self._options.staging_buffers

    @property
    def host_threads(self) -> int:
        """Threads of the host pool."""
        return self._options.host_threads

    @property
    def schedule(self) -> str:
        """The default schedule, ``"static"`` or ``"dynamic"``."""
        return self._options.schedule

    @property
    def host_path(self) -> tuple[str, str]:
        """The default ``(input, output)`` host paths."""
        return self._options.host_path

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
        return self._pins.nbytes

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
        block: int = 256,
        *,
        mode: str = "auto",
        schedule: str | None = None,
        host_path: str | tuple[str, str] | None = None,
        progress: bool = False,
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
            Chunk size for this call (default: the pipeline's).
        block : int
            Threads per block.
        mode : {"auto", "managed"}
            ``"managed"`` runs :meth:`map_managed` (x must be unified memory).
        schedule : {"static", "dynamic"}, optional
            Override the pipeline's schedule for this call.
        host_path : {"auto", "staged", "register", "split"} or (input, output) pair, optional
            Override the pipeline's ``host_path`` for this call.
        progress : bool
            Show a progress bar of the finished chunks: tqdm when installed, else one
            line on stderr. Off by default.

        Raises
        ------
        PipelineError
            A chunk failed: the message names the device, chunk, rows and step.
        ContextPoisonedError
            The pipeline is unusable after an earlier fault.
        CompileError
            A Kernel could not be loaded on one of the devices.

        Notes
        -----
        A Kernel is loaded into every device's context before the first chunk is
        enqueued (:meth:`Kernel.preload`), so no launch waits for lazy loading.
        """
        check_fork("Pipeline.map")
        if mode == "managed":
            return self.map_managed(
                kernel, x, out, args, chunk_bytes, block, schedule=schedule, progress=progress
            )
        if mode != "auto":
            raise ValueError(f"mode must be 'auto' or 'managed', not {mode!r}")
        options = self._options_for(chunk_bytes, block, schedule, host_path=host_path)
        if out is None and options.host_path[1] != "auto":
            out = "pageable"  # the output's host path was asked for: it applies
        new_out = out is None or isinstance(out, str)
        if new_out:
            self._check_usable()  # before anything is allocated for a closed pipeline
        headroom = self._staging_bytes(x, options) if out is None else 0
        x, out = prepare_io(x, out, self._devices[0].ctx, headroom)
        pooled = new_out and out.nbytes > 0 and pinned_pool().owns(out)
        return self._map(kernel, x, out, args, options, progress, pooled)

    def map_managed(
        self,
        kernel: Any,
        x: Any,
        out: Any = None,
        args: Sequence[Any] = (),
        chunk_bytes: int | None = None,
        block: int = 256,
        *,
        dtype: Any = None,
        shape: Sequence[int] | None = None,
        schedule: str | None = None,
        prefetch: bool = True,
        to_host: bool = True,
        progress: bool = False,
    ) -> np.ndarray:
        """The map of :meth:`map` over unified (managed) memory: no staging, no copies.

        Each device prefetches its chunks of *x* and *out* (``cuMemPrefetchAsync``),
        runs the kernel on them in place, and (``to_host``) prefetches the results back
        to host memory.

        Parameters
        ----------
        x : ManagedBuffer or numpy.ndarray
            Managed memory: a :class:`~ctxkit.memory.ManagedBuffer` (give ``dtype`` and
            optionally ``shape``) or a numpy view of one (``buf.as_numpy(dtype)``).
        out : ManagedBuffer, numpy.ndarray or None
            Managed output; default: a new ManagedBuffer shaped like *x*. ``out=x``
            works in place.
        prefetch, to_host : bool
            Prefetch chunks to the device before the kernel / back to the host after.
        progress : bool
            Show a progress bar of the finished chunks (see :meth:`map`).

        Returns
        -------
        numpy.ndarray
            The output as a numpy view of managed memory (it keeps the buffer alive).
        """
        check_fork("Pipeline.map_managed")
        self._check_usable()
        options = self._options_for(
            chunk_bytes, block, schedule, managed=True, prefetch=prefetch, to_host=to_host
        )
        xa = _managed_array(x, dtype, shape, "x")
        if out is None:
            buf = ManagedBuffer(xa.nbytes, context=self._devices[0].ctx)
            oa = buf.as_numpy(xa.dtype, xa.shape)
        else:
            oa = _managed_array(out, dtype or xa.dtype, shape or xa.shape, "out")
        xa, oa = prepare_io(xa, oa)
        with self._devices[0].ctx:
            for arr, what in ((xa, "x"), (oa, "out")):
                if arr.nbytes and host_pointer_kind(addr(arr)) != "managed":
                    raise ValueError(
                        f"map_managed: {what} is not unified (managed) memory; allocate it "
                        "with ctxkit.ManagedBuffer (or use Pipeline.map for host arrays)"
                    )
        self._map(kernel, xa, oa, args, options, progress)
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
                try:
                    self.trace()
                except Exception:  # the timeline is a diagnostic: never block close()
                    pass
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
        for dev in self._devices:
            if dev.ctx == device or dev.ordinal == _ordinal(device):
                return dev
        raise ValueError(
            f"{device!r} is not one of this pipeline's devices {[d.ordinal for d in self._devices]}"
        )

    # --- carrying out a map -------------------------------------------------------

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

    # --- trace recording -------------------------------------------------------------

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


_NO_DEVICE = 100


def _ordinal(device: object) -> int | None:
    if isinstance(device, Device):
        return device.ordinal
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    return None


def _resolve_contexts(specs: list[int | Device | Context] | None) -> list[Context]:
    if specs is None:
        n = device_count()
        if n == 0:
            _driver.init()
            raise CudaError(
                "Pipeline(devices=None): no CUDA device is visible (the driver reports "
                "none); check nvidia-smi and CUDA_VISIBLE_DEVICES",
                _NO_DEVICE,
                "CUDA_ERROR_NO_DEVICE",
            )
        specs = list(range(n))
    contexts = [registry.default.resolve(d) for d in specs]
    for ctx in contexts:
        ctx.check_usable()
    return contexts


def _memory_kind(a: np.ndarray) -> str:
    return "pinned" if a.nbytes and is_pinned(a) else "pageable"


def _managed_array(obj: Any, dtype: Any, shape: Sequence[int] | None, what: str) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, ManagedBuffer):
        if dtype is None:
            raise TypeError(f"map_managed: pass dtype= to view the ManagedBuffer {what} as")
        if shape is None:
            return obj.as_numpy(dtype)
        return obj.as_numpy(dtype, tuple(shape))
    raise TypeError(
        f"map_managed: {what} must be a ManagedBuffer or a numpy view of one, "
        f"got {type(obj).__name__}"
    )
