"""CUDA IPC between real processes on one GPU: a 1 GiB buffer handed to a spawned child
that reads and rewrites it in place (ordered by an IPC event), a slice written by a child
and seen after it exits, VMM memory through POSIX file descriptors, and the refusals.

Containers sometimes forbid CUDA IPC: where the driver refuses, the tests skip with the
driver's exact error (a ctxkit-side error fails them). The functions the children run
are at module level (spawned children import them by name) and touch CUDA only when run.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.errors import CudaError
from ctxkit.memory import ipc
from ctxkit.memory.vmm import VirtualBuffer
from tests.support.helpers import ipc_refused

SOURCE = r"""
extern "C" __global__ void iota_u32(unsigned int* x, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = (unsigned int)i;
}

// Count the elements that are not x[i] == i, then x[i] = 3 x[i] + 1.
extern "C" __global__ void check_and_bump(unsigned int* x, size_t n, unsigned long long* bad)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    unsigned long long mine = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int v = x[i];
        mine += v != (unsigned int)i;
        x[i] = v * 3u + 1u;
    }
    if (mine) atomicAdd(bad, mine);
}
"""
GIB = 1 << 30
TIMEOUT = 180


def _kernels() -> ck.Module:
    return ck.Module.load(ck.compile(SOURCE, name="ipc_test.cu"))


def _refused(exc: BaseException) -> bool:
    """The driver's "not supported here" answer, not a bug of ctxkit or of the test."""
    return isinstance(exc, CudaError) and ipc_refused(exc)


def _report(q: Any, fn: Any) -> None:
    try:
        q.put(("ok", fn()))
    except BaseException as exc:  # sent to the parent, which fails or skips
        kind = "refused" if _refused(exc) else "error"
        q.put((kind, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# --- functions run in the children ------------------------------------------------------


def child_check_and_bump(handle: Any, event_handle: Any, q: Any, go: Any) -> None:
    """Import the buffer and the event, read and rewrite every element in place on a
    stream, record the parent's event after it, report, and keep the mapping until told."""

    def work() -> int:
        buf = ipc.import_buffer(handle)
        ev = ipc.import_event(event_handle)
        with buf.context:
            k = _kernels().function("check_and_bump")
            bad = ck.DeviceBuffer(8)
            bad.memset(0)
            s = ck.Stream()
            k.launch(65535, 256, buf, buf.nbytes // 4, bad, stream=s)
            ev.record(s)
            q.put(("recorded", buf.ptr))
            s.synchronize()
            nbad = int(bad.copy_to_host().view(np.uint64)[0])
            go.wait(TIMEOUT)
            buf.close()
            ev.close()
        return nbad

    _report(q, work)


def child_memset(handle: Any, value: int, q: Any) -> None:
    def work() -> int:
        buf = ipc.import_buffer(handle)
        buf.memset(value)  # complete when it returns
        buf.close()
        return buf.nbytes

    _report(q, work)


def child_virtual(handle: Any, seed: int, q: Any) -> None:
    """Open a VirtualBuffer from its file descriptors, check it, overwrite its first page."""

    def work() -> bool:
        vb = ipc.import_buffer(handle)
        assert isinstance(vb, VirtualBuffer)
        want = np.random.default_rng(seed).integers(0, 256, vb.nbytes, dtype=np.uint8)
        same = bool(np.array_equal(vb.copy_to_host(), want))
        vb[:4096].memset(0x77)
        vb.close()
        return same

    _report(q, work)


# --- helpers ----------------------------------------------------------------------------


def _spawn(target: Any, *args: Any) -> tuple[Any, Any, Any]:
    mp = multiprocessing.get_context("spawn")
    q, go = mp.Queue(), mp.Event()
    extra = (go,) if target is child_check_and_bump else ()
    p = mp.Process(target=target, args=(*args, q, *extra), daemon=True)
    p.start()
    return p, q, go


def _get(p: Any, q: Any) -> tuple[str, Any]:
    try:
        return q.get(timeout=TIMEOUT)  # type: ignore[no-any-return]
    except Exception:
        p.join(5)
        pytest.fail(f"the child sent nothing (exit code {p.exitcode})")


def _outcome(p: Any, q: Any) -> Any:
    kind, value = _get(p, q)
    if kind == "refused":
        p.join(TIMEOUT)
        pytest.skip(f"the driver refuses CUDA IPC here (in the child): {value}")
    assert kind == "ok", value
    p.join(TIMEOUT)
    assert p.exitcode == 0
    return value


def _export(obj: Any) -> Any:
    try:
        return ipc.export_buffer(obj)
    except CudaError as exc:
        if ipc_refused(exc):
            pytest.skip(f"the driver refuses CUDA IPC here: {exc}")
        raise


# --- tests ------------------------------------------------------------------------------


def test_a_gib_buffer_is_read_and_rewritten_in_place_by_another_process(ctx0):
    with ctx0:
        buf = ck.DeviceBuffer(GIB)
        n = GIB // 4
        _kernels().function("iota_u32").launch(65535, 256, buf, n)
        ctx0.synchronize()
        try:
            ev = ipc.ipc_event()
            event_handle = ipc.export_event(ev)
        except CudaError as exc:
            if ipc_refused(exc):
                pytest.skip(f"the driver refuses IPC events here: {exc}")
            raise
    handle = _export(buf)
    assert len(pickle.dumps(handle)) + len(pickle.dumps(event_handle)) < 2048  # no data
    p, q, go = _spawn(child_check_and_bump, handle, event_handle)
    try:
        kind, value = _get(p, q)
        if kind == "refused":
            pytest.skip(f"the driver refuses CUDA IPC here (in the child): {value}")
        assert kind == "recorded", value
        ev.synchronize()  # the child's kernel, recorded on the child's stream, is done
        got = buf.copy_to_host().view(np.uint32)
        want = np.arange(n, dtype=np.uint32)
        want *= 3
        want += 1
        assert np.array_equal(got, want)
    finally:
        go.set()
    assert _outcome(p, q) == 0  # the child read x[i] == i everywhere


def test_a_slice_written_by_a_child_is_seen_after_it_exits(ctx0):
    n = 64 << 20
    with ctx0:
        buf = ck.DeviceBuffer(n)
        buf.memset(0x11)
    handle = _export(buf[4096 : 4096 + (1 << 20)])
    p, q, _go = _spawn(child_memset, handle, 0x5A)
    assert _outcome(p, q) == 1 << 20
    out = buf.copy_to_host()
    assert (out[4096 : 4096 + (1 << 20)] == 0x5A).all()
    assert (out[:4096] == 0x11).all() and (out[4096 + (1 << 20) :] == 0x11).all()


def test_a_shareable_virtual_buffer_is_shared_through_file_descriptors(ctx0):
    seed = 5
    with ctx0:
        try:
            vb = VirtualBuffer(48 << 20, shareable=True)
        except CudaError as exc:
            if ipc_refused(exc):
                pytest.skip(f"no POSIX file-descriptor VMM handles here: {exc}")
            raise
        data = np.random.default_rng(seed).integers(0, 256, vb.nbytes, dtype=np.uint8)
        vb.copy_from_host(data)
    handle = _export(vb)
    assert isinstance(handle, ipc.IpcVirtualBufferHandle)
    p, q, _go = _spawn(child_virtual, handle, seed)
    assert _outcome(p, q) is True
    out = vb.copy_to_host()
    assert (out[:4096] == 0x77).all()
    np.testing.assert_array_equal(out[4096:], data[4096:])
    vb.close()


def test_importing_in_the_exporting_process_is_refused(ctx0):
    buf = ck.DeviceBuffer(4096, context=ctx0)
    handle = _export(buf)
    with pytest.raises(ValueError, match="exported by this process"):
        ipc.import_buffer(handle)


def test_memory_legacy_ipc_cannot_share_is_refused_before_the_driver(ctx0):
    with pytest.raises(ValueError, match="managed"):
        ipc.export_buffer(ck.ManagedBuffer(4096, context=ctx0))
    vb = VirtualBuffer(4096, context=ctx0)
    with pytest.raises(ValueError, match="not created shareable"):
        ipc.export_buffer(vb)
    with pytest.raises(ValueError, match="VMM"):
        ipc.export_buffer(vb.as_buffer())
    with ctx0:
        err, ptr = drv.cuMemAllocAsync(4096, drv.CUstream(0))
        assert not err
        try:
            pooled = ck.DeviceBuffer.from_pointer(int(ptr), 4096, ctx0)
            with pytest.raises(ValueError, match="stream-ordered pool allocation"):
                ipc.export_buffer(pooled)
        finally:
            drv.cuMemFreeAsync(ptr, drv.CUstream(0))
            ctx0.synchronize()


def test_timing_events_cannot_be_exported(ctx0):
    with pytest.raises(ValueError, match="timestamps"):
        ipc.export_event(ck.Event(context=ctx0))
