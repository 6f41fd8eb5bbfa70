"""New page-locked memory by ``mmap`` + parallel first touch + ``cuMemHostRegister``
(ctxkit/memory/host.py) on the simulated GPU: alignment, flags, the fallback to
``cuMemHostAlloc``, out-of-memory, release in and after its context, and the pinned pool
drawing its blocks from it."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import OutOfMemoryError
from ctxkit.memory import host
from ctxkit.memory.pinned import PinnedPool
from tests.support.fakedriver import FakeHandle

MiB = 1 << 20
PORTABLE = 1


@pytest.fixture
def registering(gpu, monkeypatch):
    monkeypatch.setenv("CTXKIT_PINNED_ALLOC", "register")
    return gpu


def host_allocs(gpu) -> int:
    return sum(1 for _arr, kind in gpu.mem.values() if kind == "host")


def as_bytes(pages: host.LockedPages) -> np.ndarray:
    return np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * pages.nbytes).from_address(pages.ptr)
    )


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB, 40 * MiB])  # touched in parallel: 40 MiB
def test_register_path_pins_aligned_usable_pages(registering, nbytes):
    ctx = ck.registry.context(0)
    pages = host.lock_new(nbytes, ctx)
    assert pages.mapping is not None and pages.nbytes >= nbytes and pages.ctx is ctx
    assert pages.ptr % (2 * MiB if nbytes >= 2 * MiB else 4096) == 0
    assert registering.register_calls[-1] == (pages.ptr, pages.nbytes, PORTABLE)
    assert registering.page_locked(pages.ptr, nbytes) and host_allocs(registering) == 0
    mem = as_bytes(pages)
    mem[::4096] = 7
    assert int(mem[::4096].sum()) == 7 * (pages.nbytes // 4096)
    pages.release()
    assert pages.ptr not in registering.registered


def test_method_follows_the_environment(gpu, monkeypatch):
    monkeypatch.setenv("CTXKIT_PINNED_ALLOC", "hostalloc")
    assert host.method() == "hostalloc"
    pages = host.lock_new(MiB, ck.registry.context(0))
    assert pages.mapping is None and host_allocs(gpu) == 1 and not gpu.register_calls
    pages.release()
    assert host_allocs(gpu) == 0
    monkeypatch.setenv("CTXKIT_PINNED_ALLOC", "pin-it")
    with pytest.raises(ValueError, match="CTXKIT_PINNED_ALLOC"):
        host.method()


def test_a_refused_registration_falls_back_to_host_alloc_for_good(registering):
    registering.register_error = lambda p, n, f: 801  # CUDA_ERROR_NOT_SUPPORTED
    ctx = ck.registry.context(0)
    pages = host.lock_new(4 * MiB, ctx)
    assert pages.mapping is None and host_allocs(registering) == 1
    assert host.method() == "hostalloc"
    calls = len(registering.register_calls)
    host.lock_new(MiB, ctx).release()
    assert len(registering.register_calls) == calls  # not tried again
    pages.release()


def test_out_of_memory_on_registering_is_typed_and_unmapped(registering):
    registering.register_error = lambda p, n, f: 2  # CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(host.LockFailed) as info:
        host.lock_new(4 * MiB, ck.registry.context(0))
    assert info.value.code == 2 and info.value.call == "cuMemHostRegister"
    assert host.method() == "register"  # memory, not a refusal of the method
    with pytest.raises(OutOfMemoryError, match="CTXKIT_PINNED_POOL_BYTES"):
        PinnedPool(budget=64 * MiB).empty(MiB)


def test_release_after_its_context_closed_only_unmaps(registering):
    ctx = ck.Context.create(0)
    pages = host.lock_new(MiB, ctx)
    ctx.close()  # the driver dropped the registration with the context
    assert pages.ptr not in registering.registered
    unregisters = []
    real = registering.cuMemHostUnregister
    registering.cuMemHostUnregister = lambda p: unregisters.append(p) or real(p)
    pages.release()
    assert unregisters == []


def _unregisters(gpu) -> list[int]:
    calls: list[int] = []
    real = gpu.cuMemHostUnregister
    gpu.cuMemHostUnregister = lambda p: calls.append(p) or real(p)
    return calls


def test_release_after_closing_a_primary_torch_keeps_unregisters_before_unmapping(registering):
    # PyTorch/CuPy hold the primary context: ctxkit's close does not destroy it, so the
    # registration outlives close; unmapping under it would leave the driver a range whose
    # pages are gone (every later cuMemHostAlloc/cuCtxCreate there: ALREADY_MAPPED)
    registering.cuDevicePrimaryCtxRetain(FakeHandle(0))
    ctx = ck.Context.primary(0)
    pages = host.lock_new(MiB, ctx)
    ctx.close()
    calls = _unregisters(registering)
    pages.release()
    assert calls == [pages.ptr] and pages.ptr not in registering.registered
    assert pages.mapping is not None and pages.mapping.closed


def test_release_after_every_retainer_let_go_only_unmaps(registering):
    ctx = ck.Context.primary(0)
    pages = host.lock_new(MiB, ctx)
    ctx.close()  # the last retain: the driver destroyed the context and its registration
    assert pages.ptr not in registering.registered
    ck.Context.primary(0)  # the same handle, a new context
    calls = _unregisters(registering)
    pages.release()
    assert calls == [] and pages.mapping is not None and pages.mapping.closed


def test_pages_no_call_can_unregister_stay_mapped(registering, monkeypatch):
    monkeypatch.setattr(host, "_stranded", [])
    ctx = ck.Context.primary(0)
    poisoned = host.lock_new(MiB, ctx)
    refused = host.lock_new(MiB, ctx)
    real = registering.cuMemHostUnregister
    registering.cuMemHostUnregister = lambda p: (999,) if p == refused.ptr else real(p)
    refused.release()  # the driver refused: the pages are still locked
    ctx.note_error(700, "a kernel")
    poisoned.release()  # a sticky fault: no context can unregister any more
    assert host._stranded == [refused.mapping, poisoned.mapping]
    assert not refused.mapping.closed and not poisoned.mapping.closed
    assert registering.page_locked(poisoned.ptr, MiB)


def test_the_pool_draws_registered_blocks_and_frees_them_on_trim(registering):
    pool = PinnedPool(budget=256 * MiB)
    a = pool.empty(40 * MiB, np.uint8)
    assert ck.is_pinned(a) and host_allocs(registering) == 0
    a[:] = 3
    assert int(a[::MiB].sum()) == 120
    ptr = a.ctypes.data
    del a
    gc.collect()
    assert pool.stats().cached_blocks == 1 and ptr in registering.registered
    b = pool.empty(40 * MiB, np.uint8)
    assert b.ctypes.data == ptr  # reused, not registered again
    del b
    gc.collect()
    assert pool.trim() == 40 * MiB and ptr not in registering.registered


def test_a_forked_child_touches_pages_with_threads_of_its_own(registering):
    """The parent's touch threads do not exist after fork: the child's first big block
    starts a pool of its own instead of queueing work nobody runs."""
    import os

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    host.lock_new(40 * MiB, ck.registry.context(0)).release()  # parent pool started
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        try:
            pages = np.empty(40 * MiB, np.uint8)
            host._touch(-(-pages.ctypes.data // 4096) * 4096, 32 * MiB)
            os._exit(0 if host._touch_pool is not None else 3)
        except BaseException:
            os._exit(4)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung touching pages")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0


def test_register_pages_returns_the_cuda_result(gpu):
    ctx = ck.registry.context(0)
    raw = np.zeros(3 * 4096, np.uint8)
    off = -int(raw.ctypes.data) % 4096
    arr = raw[off : off + 2 * 4096]
    ptr = int(arr.ctypes.data)
    assert host.register_pages(ptr, arr.nbytes, PORTABLE, ctx) == 0
    assert gpu.register_calls[-1] == (ptr, arr.nbytes, PORTABLE)
    assert host.register_pages(ptr, arr.nbytes, PORTABLE, ctx) == 712  # already registered
    with ctx:
        assert host.register_pages(ptr + 1, 4096, PORTABLE) == 712  # overlaps those bytes
        beyond = ptr + arr.nbytes + 10  # unaligned, sharing no byte: accepted
        assert host.register_pages(beyond, 100, PORTABLE) == 0
        assert ck._driver.drv.cuMemHostUnregister(beyond) == (0,)
        (err,) = ck._driver.drv.cuMemHostUnregister(ptr)
    assert not err and ptr not in gpu.registered
