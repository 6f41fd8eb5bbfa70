"""Baselines for benchmarks/bench_pipeline.py, written with plain driver calls.

* :func:`parallel_copy`: ``np.copyto`` split over threads (the host-copy ceiling);
* :class:`RawPinned`: a hand-written pinned copy -> kernel -> copy pipeline, optionally
  recording the same four events per chunk that ctxkit's trace records;
* :func:`time_registration`: ``cuMemHostRegister`` / ``cuMemHostUnregister`` of a range
  split into pieces, from several threads at once (the rate the registered host path
  depends on).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ctxkit._driver import drv
from ctxkit.pipeline.plan import PipelineOptions, grid_size, plan_map

REGISTER_PORTABLE = 1


def ok(res: Any, what: str) -> Any:
    """The value(s) of a driver call's result tuple; RuntimeError on a failure."""
    if res[0]:
        raise RuntimeError(f"{what} failed: {res[0]!r}")
    return res[1] if len(res) == 2 else res[1:]


def parallel_copy(
    dst: np.ndarray,
    src: np.ndarray,
    threads: int,
    copy: Callable[[np.ndarray, np.ndarray], None] = np.copyto,
) -> None:
    """``dst[:] = src`` with *threads* threads (*copy*: np.copyto, or ctxkit's streaming
    copy; both release the GIL)."""
    n = dst.shape[0]
    bounds = [i * n // threads for i in range(threads + 1)]
    workers = [
        threading.Thread(target=copy, args=(dst[a:b], src[a:b]))
        for a, b in itertools.pairwise(bounds)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


class RawPinned:
    """Hand-written pinned pipeline: plain driver calls, one host thread, round-robin
    over devices, chunk k on stream k % slots (like ctxkit's zero-copy path).

    With ``events=True`` it records four timing events per chunk around its copies and
    kernel, as ctxkit does when tracing, to show what those events cost.
    """

    def __init__(
        self,
        image: bytes,
        ordinals: Sequence[int],
        chunk: int,
        alpha: float,
        slots: int = 3,
        events: bool = False,
    ) -> None:
        self.chunk, self.slots, self.alpha, self.events = chunk, slots, alpha, events
        self.devs: list[dict[str, Any]] = []
        for o in ordinals:
            dev = ok(drv.cuDeviceGet(o), "cuDeviceGet")
            ctx = ok(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            ok(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
            mod = ok(drv.cuModuleLoadData(image), "cuModuleLoadData")
            fn = ok(drv.cuModuleGetFunction(mod, b"scale_f32"), "cuModuleGetFunction")
            attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
            sms = ok(drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute")
            bufs = [ok(drv.cuMemAlloc(chunk), "cuMemAlloc") for _ in range(2 * slots)]
            streams = [ok(drv.cuStreamCreate(1), "cuStreamCreate") for _ in range(slots)]
            evs = [ok(drv.cuEventCreate(0), "cuEventCreate") for _ in range(4 * slots)]
            ok(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")
            self.devs.append(
                dict(
                    dev=dev,
                    ctx=ctx,
                    mod=mod,
                    fn=fn,
                    bufs=bufs,
                    streams=streams,
                    events=evs,
                    max_blocks=sms * 2048 // 256,
                )
            )

    def run(self, x: np.ndarray, out: np.ndarray) -> None:
        """``out = alpha * x`` over every device (x and out pinned float32)."""
        plan = plan_map(x.shape[0], (4, 4), len(self.devs), PipelineOptions(chunk_bytes=self.chunk))
        per_dev = [plan.for_part(i) for i in range(len(self.devs))]
        keep = []
        xp, op = int(x.ctypes.data), int(out.ctypes.data)
        for k in range(max(len(c) for c in per_dev)):
            for d, chunks in zip(self.devs, per_dev):
                if k >= len(chunks):
                    continue
                c = chunks[k]
                slot = k % self.slots
                s = d["streams"][slot]
                ev = d["events"][4 * slot : 4 * slot + 4] if self.events else [None] * 4
                d_in, d_out = d["bufs"][2 * slot], d["bufs"][2 * slot + 1]
                nb, off, n = c.rows * 4, c.row0 * 4, c.rows
                ok(drv.cuCtxPushCurrent(d["ctx"]), "push")
                self._record(ev[0], s)
                ok(drv.cuMemcpyHtoDAsync(d_in, xp + off, nb, s), "cuMemcpyHtoDAsync")
                self._record(ev[1], s)
                vals: list[np.ndarray] = [
                    np.array([int(d_in)], np.uint64),
                    np.array([int(d_out)], np.uint64),
                    np.array([n], np.uint64),
                    np.array([self.alpha], np.float32),
                ]
                params = np.array([v.ctypes.data for v in vals], np.uint64)
                keep.append((vals, params))
                grid = grid_size(n, 256, d["max_blocks"])
                ok(
                    drv.cuLaunchKernel(d["fn"], grid, 1, 1, 256, 1, 1, 0, s, params.ctypes.data, 0),
                    "cuLaunchKernel",
                )
                self._record(ev[2], s)
                ok(drv.cuMemcpyDtoHAsync(op + off, d_out, nb, s), "cuMemcpyDtoHAsync")
                self._record(ev[3], s)
                ok(drv.cuCtxPopCurrent(), "pop")
        for d in self.devs:
            ok(drv.cuCtxPushCurrent(d["ctx"]), "push")
            for s in d["streams"]:
                ok(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
            ok(drv.cuCtxPopCurrent(), "pop")

    @staticmethod
    def _record(ev: Any, stream: Any) -> None:
        if ev is not None:
            ok(drv.cuEventRecord(ev, stream), "cuEventRecord")

    def close(self) -> None:
        """Free everything; release the primary contexts."""
        for d in self.devs:
            ok(drv.cuCtxPushCurrent(d["ctx"]), "push")
            for b in d["bufs"]:
                drv.cuMemFree(b)
            for s in d["streams"]:
                drv.cuStreamDestroy(s)
            for e in d["events"]:
                drv.cuEventDestroy(e)
            drv.cuModuleUnload(d["mod"])
            ok(drv.cuCtxPopCurrent(), "pop")
            drv.cuDevicePrimaryCtxRelease(d["dev"])


def _in_threads(ctx: Any, jobs: list[tuple[int, int]], threads: int, register: bool) -> float:
    """Seconds to (un)register every ``(ptr, nbytes)`` of *jobs* from *threads* threads."""
    errors: list[str] = []
    start = threading.Barrier(threads + 1)

    def work(mine: list[tuple[int, int]]) -> None:
        (pushed,) = drv.cuCtxPushCurrent(ctx)
        start.wait()
        if pushed:
            errors.append(f"cuCtxPushCurrent: {pushed!r}")
            return
        for ptr, n in mine:
            if register:
                (err,) = drv.cuMemHostRegister(ptr, n, REGISTER_PORTABLE)
            else:
                (err,) = drv.cuMemHostUnregister(ptr)
            if err:
                errors.append(f"{'cuMemHostRegister' if register else 'unregister'}: {err!r}")
        drv.cuCtxPopCurrent()

    workers = [threading.Thread(target=work, args=(jobs[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    if errors:
        if register:  # undo the registrations that worked: nothing may stay locked
            ok(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
            for ptr, _ in jobs:
                drv.cuMemHostUnregister(ptr)
            drv.cuCtxPopCurrent()
        raise RuntimeError(errors[0])
    return seconds


def time_registration(
    ctx: Any, arr: np.ndarray, piece: int, threads: int, repeats: int
) -> tuple[int, float, float]:
    """``(bytes, best register seconds, best unregister seconds)`` for the page-aligned
    part of *arr* cut into *piece*-byte pieces, registered (then unregistered) by
    *threads* threads."""
    base = int(arr.ctypes.data)
    start = -base % 4096
    piece = max(4096, min(piece, (arr.nbytes - start) // 4096 * 4096))
    n = (arr.nbytes - start) // piece
    jobs = [(base + start + i * piece, piece) for i in range(n)]
    best_r = best_u = float("inf")
    for _ in range(repeats):
        best_r = min(best_r, _in_threads(ctx, jobs, threads, True))
        best_u = min(best_u, _in_threads(ctx, jobs, threads, False))
    return n * piece, best_r, best_u
