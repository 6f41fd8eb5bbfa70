"""Contexts on real devices: nesting, per-thread stacks, foreign changes, close, fork."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.context import ADOPTED, Context, thread_state
from tests.support.helpers import raw_current


def test_devices_and_properties():
    devs = ck.devices()
    assert len(devs) == ck.device_count() >= 1
    d = devs[0]
    assert d is ck.Device(0)
    assert d.name and d.compute_capability >= (3, 5)
    assert d.total_memory > 1 << 30
    assert d.pci_bus_id.count(":") == 2
    assert d.attribute("max_threads_per_block") >= 512
    assert d.attribute("CU_DEVICE_ATTRIBUTE_WARP_SIZE") == 32
    with pytest.raises(ValueError, match="unknown device attribute"):
        d.attribute("warp_sizes_please")
    with pytest.raises(ValueError, match="out of range"):
        ck.Device(ck.device_count())
    assert d.can_access_peer(d) is False
    assert "Device 0" in repr(d)


@pytest.mark.multigpu
def test_peer_query():
    a, b = ck.Device(0), ck.Device(1)
    assert isinstance(a.can_access_peer(b), bool)


@pytest.mark.multigpu
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("fail", [False, True])
def test_nesting_mixed_owned_and_primary_two_devices(depth, fail):
    owned0, owned1 = Context.create(0), Context.create(1)
    try:
        chain = [
            Context.primary(0),
            owned1,
            Context.primary(1),
            owned0,
            Context.primary(0),
        ][:depth]
        before = raw_current()

        def enter(i: int) -> None:
            if i == len(chain):
                if fail:
                    raise LookupError("inner failure")
                return
            with chain[i]:
                assert raw_current() == chain[i].handle
                enter(i + 1)
                assert raw_current() == chain[i].handle

        if fail:
            with pytest.raises(LookupError, match="inner failure"):
                enter(0)
        else:
            enter(0)
        assert raw_current() == before
    finally:
        owned0.close()
        owned1.close()


def test_create_is_not_left_current():
    before = raw_current()
    ctx = Context.create(0)
    try:
        assert raw_current() == before
        with ctx:
            assert ck.current_context() is ctx
    finally:
        ctx.close()


def test_primary_is_shared_and_identity(ctx0):
    assert Context.primary(0) is ctx0 is ck.registry.context(0)
    err, raw = drv.cuDevicePrimaryCtxRetain(ck.Device(0).handle)
    assert not err and int(raw) == ctx0.handle
    drv.cuDevicePrimaryCtxRelease(ck.Device(0).handle)
    assert hash(ctx0) == hash(ctx0.handle) and ctx0 == Context.primary(0)


def test_worker_thread_invalid_context_bug_and_fix(ctx0):
    """003 section 3.3: a context current in the main thread is not current in a worker."""
    results: dict[str, int] = {}

    def worker() -> None:
        results["current"] = raw_current()
        err, ptr = drv.cuMemAlloc(1024)
        results["raw_alloc"] = int(err)
        with ctx0:  # the fix: bind the shared context in the worker
            err, ptr = drv.cuMemAlloc(1024)
            results["bound_alloc"] = int(err)
            drv.cuMemFree(ptr)

    with ctx0:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert raw_current() == ctx0.handle
    assert results["current"] == 0
    assert results["raw_alloc"] == 201  # CUDA_ERROR_INVALID_CONTEXT
    assert results["bound_alloc"] == 0


@pytest.fixture
def emptied():
    """This thread's driver stack emptied for the test (an earlier test may have left
    torch's or CuPy's context current here) and put back after."""
    assert thread_state().stack == [], "an earlier test left a ctxkit push in this thread"
    saved = []
    while raw_current():
        err, cu = drv.cuCtxPopCurrent()
        assert not err
        saved.append(cu)
    yield
    st = thread_state()
    st.stack.clear()
    st.top = None
    while raw_current():
        drv.cuCtxPopCurrent()
    for cu in reversed(saved):
        drv.cuCtxPushCurrent(cu)


@pytest.mark.parametrize("primary_current", [True, False], ids=["primary current", "nothing"])
def test_foreign_push_inside_block_is_reported_and_recoverable(ctx0, emptied, primary_current):
    """With the primary context already current (a raw push, as torch or CuPy leave it)
    ``with ctx0:`` pushes nothing; with nothing current it pushes: both report a foreign
    push left inside the block, and ``ctx0.pop()`` completes once it is popped."""
    if primary_current:
        (err,) = drv.cuCtxPushCurrent(ctx0.cu)
        assert not err
    below = raw_current()
    other = Context.create(0)
    try:
        with pytest.raises(ck.ContextStackError, match="did not pop it"):
            with ctx0:
                (err,) = drv.cuCtxPushCurrent(other.cu)  # raw push, never popped
                assert not err
        assert raw_current() == other.handle  # ctxkit did not pop it
        err, _ = drv.cuCtxPopCurrent()  # the foreign code balances its push
        assert not err
        assert raw_current() == ctx0.handle
        ctx0.pop()  # ctxkit's record completes
        assert thread_state().stack == []
        assert raw_current() == below
    finally:
        other.close()


@pytest.mark.parametrize("primary_current", [True, False], ids=["primary current", "another"])
def test_foreign_pop_inside_block_leaves_what_was_beneath(ctx0, emptied, primary_current):
    """A foreign pop of the block's context is reported whether the block pushed it or
    found it current, and the context beneath stays current.

    A block finds a context current (and pushes nothing) only in a thread where ctxkit
    has not yet seen an empty driver stack; ``probe`` is set so, whatever ran before in
    this thread. Once ctxkit saw it empty, a block pushes its context again over one
    made current behind its back (balanced, and undetectable by the driver)."""
    outer = Context.create(0)
    thread_state().probe = True
    try:
        (err,) = drv.cuCtxPushCurrent(outer.cu)
        assert not err
        if primary_current:
            (err,) = drv.cuCtxPushCurrent(ctx0.cu)
            assert not err
        with pytest.raises(ck.ContextStackError, match="popped this context"):
            with ctx0:
                drv.cuCtxPopCurrent()
        assert raw_current() == outer.handle and thread_state().stack == []
        drv.cuCtxPopCurrent()
    finally:
        outer.close()


def test_foreign_pop_inside_block_is_reported(ctx0):
    outer = Context.create(0)
    try:
        with outer:
            with pytest.raises(ck.ContextStackError, match="popped this context"):
                with ctx0:
                    drv.cuCtxPopCurrent()
            assert raw_current() == outer.handle
    finally:
        outer.close()


def test_close_rules_on_device():
    ctx = Context.create(0)
    with ctx, pytest.raises(ck.ContextInUseError):
        ctx.close()
    ctx.close()
    ctx.close()
    with pytest.raises(ck.ContextClosedError):
        ctx.push()
    with pytest.raises(ck.ContextClosedError):
        ctx.synchronize()


def test_primary_close_releases_and_reretains():
    p = Context.primary(0)
    assert p.is_primary
    q = ck.registry.context(0)
    assert q is p


def test_synchronize_and_memory_info(ctx0):
    free, total = ctx0.memory_info()
    assert 0 < free <= total
    ctx0.synchronize()


def test_current_context_sees_torch_primary():
    torch = pytest.importorskip("torch")
    out: dict[str, object] = {}

    def worker() -> None:
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda:0")  # torch makes device 0's primary context current
        out["ctx"] = ck.current_context()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out["ctx"] is Context.primary(0)


def test_a_primary_context_torch_made_current_is_used_without_push_or_pop():
    """In a thread where torch made device 0's primary context current, ``with ctx:``
    pushes and pops nothing: a ctxkit kernel reads torch's tensor, and torch's entry on
    the driver's stack is the only one afterwards."""
    torch = pytest.importorskip("torch")
    from ctxkit.compiler import kernel_source

    ctx = ck.registry.context(0)
    with ctx:
        scale = ck.Module.load(ck.compile(kernel_source("scale.cu"))).function("scale_f32")
    out: dict[str, object] = {}

    def worker() -> None:
        torch.cuda.set_device(0)
        t = torch.full((256,), 1.5, dtype=torch.float32, device="cuda:0")
        torch.cuda.synchronize()
        out["current_before"] = raw_current()
        with ctx:
            out["adopted"] = thread_state().stack == [(ctx, ADOPTED)]
            y = ck.DeviceBuffer(256 * 4)
            scale.launch(1, 256, t, y, 256, np.float32(2.0))
            out["y"] = np.frombuffer(y.copy_to_host(), np.float32).copy()
            y.close()
        out["stack_after"] = list(thread_state().stack)
        err, popped = drv.cuCtxPopCurrent()  # torch's entry, the only one
        out["popped"] = (int(err), int(popped))
        out["current_after_pop"] = raw_current()
        drv.cuCtxPushCurrent(popped)  # give torch its context back
        out["torch_after"] = float(t.sum().item())

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert out["current_before"] == ctx.handle and out["adopted"] is True
    assert np.all(out["y"] == 3.0)
    assert out["stack_after"] == []
    assert out["popped"] == (0, ctx.handle) and out["current_after_pop"] == 0
    assert out["torch_after"] == 1.5 * 256


def _child_after_fork(q) -> None:
    t0 = time.perf_counter()
    try:
        ck.device_count()
        with ck.Context.primary(0):
            pass
        q.put(("no error", 0.0))
    except ck.ForkError as exc:
        q.put((f"ForkError: {exc}", time.perf_counter() - t0))
    except BaseException as exc:
        q.put((repr(exc), time.perf_counter() - t0))


def _child_spawned(q) -> None:
    import ctxkit

    with ctxkit.registry.context(0) as ctx:
        q.put(("ok", ctx.device.ordinal))


def test_fork_guard_and_spawn(ctx0):
    ctx0.synchronize()  # CUDA is initialised in this (parent) process
    fctx = mp.get_context("fork")
    q = fctx.Queue()
    p = fctx.Process(target=_child_after_fork, args=(q,))
    p.start()
    msg, took = q.get(timeout=30)
    p.join(30)
    assert msg.startswith("ForkError") and "spawn" in msg, msg
    assert took < 1.0

    sctx = mp.get_context("spawn")
    q2 = sctx.Queue()
    p2 = sctx.Process(target=_child_spawned, args=(q2,))
    p2.start()
    assert q2.get(timeout=120) == ("ok", 0)
    p2.join(30)
    assert p2.exitcode == 0
