"""Context push/pop/close logic against a fake of the driver's per-thread stack."""

from __future__ import annotations

import gc
import threading

import pytest

import ctxkit as ck
from ctxkit import context as context_mod
from ctxkit import lifetime
from ctxkit.context import Context, current_context, thread_bindings, thread_state
from tests.support.fakedriver import FakeHandle
from tests.support.helpers import in_thread


def test_create_does_not_stay_current(fake_driver):
    ctx = Context.create(0)
    assert fake_driver.current() == 0
    assert ctx.kind == "owned" and not ctx.is_primary
    assert ctx.device.ordinal == 0


def test_create_rejects_non_int_flags(fake_driver):
    with pytest.raises(TypeError, match="flags"):
        Context.create(0, flags="fast")  # type: ignore[arg-type]


def test_primary_is_one_object_and_retained_once(fake_driver):
    a = Context.primary(0)
    b = Context.primary(ck.Device(0))
    assert a is b and a.is_primary
    assert fake_driver.calls["cuDevicePrimaryCtxRetain"] == 1
    a.close()
    a.close()  # a second release would be CUDA_ERROR_INVALID_CONTEXT: none is made
    assert fake_driver.calls["cuDevicePrimaryCtxRelease"] == 1
    assert fake_driver.primary_refs[0] == 0 and fake_driver.resets[0] == 1
    c = Context.primary(0)
    assert c is not a and c == a  # same driver handle, new retained wrapper
    with c:
        assert fake_driver.current() == c.handle


def test_closing_a_shared_primary_context_releases_only_ctxkits_reference(fake_driver):
    fake_driver.cuDevicePrimaryCtxRetain(fake_driver.cuDeviceGet(0)[1])  # e.g. PyTorch
    ctx = Context.primary(0)
    ctx.close()
    assert fake_driver.primary_refs[0] == 1 and fake_driver.resets[0] == 0


@pytest.mark.parametrize("major", [12, 13])
def test_create_passes_the_arguments_of_each_bindings_major(fake_driver, monkeypatch, major):
    """cuda-bindings 12.x: ``cuCtxCreate(flags, dev)``; 13.x: ``cuCtxCreate(params,
    flags, dev)``. The fake takes only the form of the major it plays."""
    from ctxkit import _driver

    monkeypatch.setattr(_driver, "BINDINGS_VERSION", (major, 9))
    fake_driver.bindings_major = major
    ctx = Context.create(1, flags=4)
    assert ctx.device.ordinal == 1 and fake_driver.ctx_device[ctx.handle] == 1
    assert fake_driver.ctx_flags[ctx.handle] == 4
    assert fake_driver.current() == 0  # created current, popped again
    ctx.close()
    assert ctx.handle in fake_driver.destroyed


def test_equality_hash_repr(fake_driver):
    p0, p1 = Context.primary(0), Context.primary(1)
    assert p0 != p1 and len({p0, p1, Context.primary(0)}) == 2
    r = repr(p0)
    assert "primary" in r and "device=0" in r and f"{p0.handle:#x}" in r


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("fail", [False, True])
def test_nesting_restores_exact_stack(fake_driver, depth, fail):
    ctxs = [
        Context.primary(0),
        Context.create(1),
        Context.primary(1),
        Context.create(0),
        Context.primary(0),
    ][:depth]
    foreign = FakeHandle(0xBEEF)
    fake_driver.stack().append(foreign)  # something else was current before
    before = list(fake_driver.stack())

    def enter(i: int) -> None:
        if i == len(ctxs):
            if fail:
                raise KeyError("boom")
            return
        with ctxs[i]:
            assert fake_driver.current() == ctxs[i].handle
            enter(i + 1)
            assert fake_driver.current() == ctxs[i].handle

    if fail:
        with pytest.raises(KeyError, match="boom"):
            enter(0)
    else:
        enter(0)
    assert fake_driver.stack() == before
    assert thread_state().stack == []


def test_reentry_costs_no_driver_call(fake_driver):
    ctx = Context.primary(0)
    with ctx:
        pushes = fake_driver.calls["cuCtxPushCurrent"]
        for _ in range(100):
            with ctx, ck.bind(ctx):
                pass
        assert fake_driver.calls["cuCtxPushCurrent"] == pushes
    assert fake_driver.current() == 0


def test_foreign_push_inside_block_raises_and_keeps_foreign(fake_driver):
    ctx = Context.primary(0)
    foreign = FakeHandle(0xF00)
    with pytest.raises(ck.ContextStackError, match="expected to pop") as ei, ctx:
        fake_driver.stack().append(foreign)  # raw push without pop
    assert f"{ctx.handle:#x}" in str(ei.value) and "0xf00" in str(ei.value)
    # ctxkit did not pop the foreign context: it is still on top, ours beneath it
    assert fake_driver.current() == 0xF00
    assert thread_state().top is None
    assert [context_mod.entry_context(e) for e in thread_state().stack] == [ctx]
    fake_driver.stack().pop()  # the foreign code balances its push
    ctx.pop()  # and ctxkit's record completes
    assert fake_driver.current() == 0 and thread_state().stack == []


def test_foreign_pop_inside_block_raises(fake_driver):
    outer, inner = Context.primary(1), Context.primary(0)
    with outer:
        with pytest.raises(ck.ContextStackError), inner:
            fake_driver.stack().pop()  # someone popped our context
        assert fake_driver.current() == outer.handle  # put back, not popped
    assert fake_driver.current() == 0


def test_pop_out_of_order_is_refused(fake_driver):
    a, b = Context.primary(0), Context.primary(1)
    a.push()
    b.push()
    with pytest.raises(ck.ContextStackError, match="innermost"):
        a.pop()
    assert fake_driver.current() == b.handle
    b.pop()
    a.pop()
    assert fake_driver.current() == 0


def test_pop_without_push_is_refused(fake_driver):
    with pytest.raises(ck.ContextStackError, match="pushed nothing"):
        Context.primary(0).pop()


def test_explicit_push_pop(fake_driver):
    ctx = Context.create(0)
    ctx.push()
    assert fake_driver.current() == ctx.handle
    assert current_context() is ctx
    ctx.pop()
    assert current_context() is None


def test_close_rules(fake_driver):
    ctx = Context.create(0)
    with ctx, pytest.raises(ck.ContextInUseError, match="current"):
        ctx.close()
    ctx.close()
    ctx.close()  # idempotent
    assert ctx.closed
    assert fake_driver.calls["cuCtxDestroy"] == 1
    with pytest.raises(ck.ContextClosedError), ctx:
        pass
    with pytest.raises(ck.ContextClosedError):
        ctx.check_usable()


def test_close_refused_while_current_in_other_thread(fake_driver):
    ctx = Context.create(1)
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ctx:
            entered.set()
            release.wait(5)

    t = threading.Thread(target=hold, name="holder")
    t.start()
    entered.wait(5)
    try:
        with pytest.raises(ck.ContextInUseError, match="holder"):
            ctx.close()
        assert any("holder" in k for k in thread_bindings())
    finally:
        release.set()
        t.join()
    ctx.close()


def test_a_context_destroyed_by_foreign_code_inside_a_block_is_reported(fake_driver):
    """``cuCtxDestroy`` of the calling thread's current context pops it: ctxkit's pop
    finds the outer context on top, puts it back and says what happened."""
    outer, doomed = Context.primary(0), Context.create(1)
    with outer:
        with pytest.raises(ck.ContextStackError, match="popped this context"), doomed:
            assert fake_driver.cuCtxDestroy(doomed.cu) == (0,)
        assert fake_driver.current() == outer.handle
    assert fake_driver.current() == 0 and thread_state().stack == []


def test_close_refused_when_current_through_raw_push(fake_driver):
    ctx = Context.create(0)
    fake_driver.stack().append(ctx.cu)
    with pytest.raises(ck.ContextInUseError):
        ctx.close()
    fake_driver.stack().pop()
    ctx.close()


def test_closing_a_primary_another_library_made_current_releases_only_ctxkits_share(
    fake_driver,
):
    torch_ctx = _retained_elsewhere(fake_driver)
    fake_driver.stack().append(torch_ctx)  # as PyTorch leaves it after its first op
    ctx = Context.primary(0)
    ctx.close()
    assert ctx.closed and fake_driver.primary_refs[0] == 1
    assert fake_driver.current() == ctx.handle  # still PyTorch's, current as it left it
    again = Context.primary(0)
    with again:
        assert fake_driver.current() == again.handle
    fake_driver.stack().pop()


def test_closing_a_primary_ctxkit_has_current_is_refused(fake_driver):
    ctx = Context.primary(0)
    with ctx, pytest.raises(ck.ContextInUseError, match="current"):
        ctx.close()
    ctx.close()


def test_current_context_recognises_foreign_primary(fake_driver):
    fake_driver.stack().append(fake_driver.primary[1])  # e.g. PyTorch made it current
    ctx = current_context()
    assert ctx is Context.primary(1)
    fake_driver.stack().pop()


def test_current_context_wraps_unknown_context(fake_driver):
    h = FakeHandle(0x7777)
    fake_driver.ctx_device[0x7777] = 0
    fake_driver.stack().append(h)
    ctx = current_context()
    assert ctx is not None and ctx.kind == "foreign" and ctx.handle == 0x7777
    assert current_context() is ctx
    fake_driver.stack().pop()
    ctx.close()  # a foreign context is never destroyed by ctxkit
    assert ctx.closed and 0x7777 not in fake_driver.destroyed


def test_context_is_per_thread(fake_driver):
    ctx = Context.primary(0)
    seen: list[int] = []
    with ctx:
        t = threading.Thread(target=lambda: seen.append(fake_driver.current()))
        t.start()
        t.join()
    assert seen == [0]


def test_free_runs_inside_owner_context(fake_driver):
    a, b = Context.primary(0), Context.primary(1)
    with b:
        a.free(fake_driver.fake_free, 1)
        assert fake_driver.current() == b.handle
    a.free(fake_driver.fake_free, 2)  # nothing current
    with a:
        a.free(fake_driver.fake_free, 3)  # already current: no push
    assert fake_driver.freed_in == [(1, a.handle), (2, a.handle), (3, a.handle)]


def test_free_skips_closed_context(fake_driver):
    ctx = Context.create(0)
    ctx.close()
    ctx.free(fake_driver.fake_free, 1)
    assert fake_driver.calls["fake_free"] == 0


def _retained_elsewhere(fake_driver, ordinal: int = 0) -> FakeHandle:
    """Device *ordinal*'s primary context retained as PyTorch or CuPy would."""
    err, cu = fake_driver.cuDevicePrimaryCtxRetain(FakeHandle(ordinal))
    assert not err
    return cu


def test_free_after_close_runs_in_a_primary_another_library_keeps(fake_driver):
    _retained_elsewhere(fake_driver)
    ctx = Context.primary(0)
    ctx.close()
    assert ctx.resources_alive()
    ctx.free(fake_driver.fake_free, 1)
    assert fake_driver.freed_in == [(1, ctx.handle)]
    assert fake_driver.current() == 0 and fake_driver.primary_refs[0] == 1  # as found


def test_free_after_close_skips_a_primary_released_by_everyone(fake_driver):
    ctx = Context.primary(0)
    ctx.close()  # the last retain: the driver destroyed it with what it held
    again = Context.primary(0)  # a new context at the same handle
    assert again.handle == ctx.handle and not ctx.resources_alive()
    ctx.free(fake_driver.fake_free, 1)
    assert fake_driver.calls["fake_free"] == 0
    assert again.resources_alive()


def test_freeing_a_poisoned_context_binds_nothing(fake_driver):
    ctx = Context.primary(0)
    ctx.note_error(700, "a kernel")  # CUDA_ERROR_ILLEGAL_ADDRESS: sticky
    with ctx.freeing() as live:
        assert not live
    assert ctx.resources_alive()  # they exist; nothing can free them


def test_free_raises_on_failure_and_free_quietly_does_not(fake_driver, monkeypatch):
    ctx = Context.primary(0)

    def bad(_h: int) -> tuple[int]:
        return (1,)

    with pytest.raises(ck.CudaError):
        ctx.free(bad, 1)
    monkeypatch.setattr(lifetime, "_warned_failed_free", False)
    before = len(lifetime.failed_frees())
    with pytest.warns(ResourceWarning, match="failed while a finalizer freed a resource"):
        lifetime.free_quietly(ctx, bad, 1)
    assert [f.context for f in lifetime.failed_frees()[before:]] == [ctx.handle]


def test_finalizer_frees_in_owner_context_from_other_thread(fake_driver):
    ctx = Context.primary(1)

    class Res:
        pass

    holder = {"r": Res()}
    lifetime.finalizer(holder["r"], ctx, fake_driver.fake_free, 42)

    def drop() -> None:
        holder.clear()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert fake_driver.freed_in == [(42, ctx.handle)]
    assert fake_driver.current() == 0


def test_synchronize_and_memory_info_run_in_their_own_context(fake_driver):
    c0, c1 = Context.primary(0), Context.primary(1)
    with c1:
        on_1 = fake_driver.cuMemGetInfo()[1:]
    with c0:
        assert c1.memory_info() == on_1  # answered by device 1, not by the current one
        assert c0.memory_info() != on_1
        c1.synchronize()
        assert fake_driver.current() == c0.handle
    assert fake_driver.current() == 0
    free, total = c1.memory_info()
    assert 0 < free <= total


def test_synchronize_reports_a_fault_and_poisons_the_context(fake_driver):
    ctx = Context.primary(0)
    fake_driver.fault = 700  # a kernel hit an illegal address
    with pytest.raises(ck.ContextPoisonedError, match="ILLEGAL_ADDRESS"):
        ctx.synchronize()
    assert ctx.poisoned


def test_run_in(fake_driver):
    ctx = Context.primary(1)
    assert ctx.run_in(fake_driver.current) == ctx.handle


def test_sticky_error_poisons_context(fake_driver):
    ctx = Context.primary(0)
    exc = ctx.note_error(700, "cuCtxSynchronize")
    assert isinstance(exc, ck.ContextPoisonedError)
    assert ctx.poisoned and "poisoned" in repr(ctx)
    pushes = fake_driver.calls["cuCtxPushCurrent"]
    with pytest.raises(ck.ContextPoisonedError), ctx:
        pass
    assert fake_driver.calls["cuCtxPushCurrent"] == pushes  # failed fast, no driver call


@pytest.mark.parametrize("kind", ["primary", "owned"])
def test_a_fault_poisons_every_context_of_the_process(fake_driver, kind):
    """On current drivers a sticky fault on one device fails every context, on every
    device: a second context (even an owned one, on another device) does not isolate
    it, so the error says to use a process per device."""
    faulting = Context.primary(0)
    other = Context.primary(1) if kind == "primary" else Context.create(1)
    fake_driver.fault = 700
    with pytest.raises(ck.ContextPoisonedError):
        faulting.synchronize()
    with pytest.raises(ck.ContextPoisonedError, match="separate processes") as info:
        other.synchronize()
    assert other.poisoned and info.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    fresh = Context.create(0)
    with pytest.raises(ck.ContextPoisonedError):
        fresh.synchronize()


def test_require_current(fake_driver):
    with pytest.raises(ck.NoCurrentContextError, match="ctxkit.bind"):
        context_mod.require_current("allocating")
    ctx = Context.primary(0)
    with ctx:
        assert context_mod.require_current("x") is ctx
    fake_driver.stack().append(ctx.cu)
    assert context_mod.require_current("x") is ctx
    fake_driver.stack().pop()


def test_synchronize_waits_for_queued_work_and_query_sees_it(gpu):
    from ctxkit.stream import Stream

    ctx = Context.primary(0)
    started, release, ran = threading.Event(), threading.Event(), []

    def kernel() -> None:
        started.set()
        release.wait(10)
        ran.append(1)

    with ctx:
        s = Stream()
        gpu.launch(s, kernel)
        assert started.wait(10)
        assert s.query() is False  # CUDA_ERROR_NOT_READY: work is queued
        threading.Timer(0.05, release.set).start()
        ctx.synchronize()
        assert ran == [1] and s.query() is True


def test_closing_a_primary_another_library_keeps_waits_for_its_work(gpu):
    """Release leaves the context alive in PyTorch's hands, so close() waits: the pinned
    pages and cached blocks freed after it may be what a queued copy still reads."""
    from ctxkit.stream import Stream

    err, _ = gpu.cuDevicePrimaryCtxRetain(FakeHandle(0))  # as PyTorch or CuPy would
    assert not err
    ctx = Context.primary(0)
    started, release, ran = threading.Event(), threading.Event(), []

    def copy() -> None:
        started.set()
        release.wait(10)
        ran.append(1)

    with ctx:
        s = Stream()
        gpu.launch(s, copy)
    assert started.wait(10)
    threading.Timer(0.05, release.set).start()
    ctx.close()
    assert ran == [1] and ctx.closed and ctx.resources_alive()
    s.close()  # freed in the context PyTorch keeps


def test_closing_a_poisoned_primary_waits_for_nothing(fake_driver):
    ctx = Context.primary(0)
    ctx._poison = "a fault"
    ctx._unusable = True
    ctx.close()
    assert ctx.closed and fake_driver.calls["cuCtxSynchronize"] == 0


def test_resources_of_a_reset_primary_context_are_not_freed_again(gpu):
    """The release that drops the last reference resets the primary context, which frees
    its memory: the buffer's finalizer must not free it a second time."""
    from ctxkit.memory import DeviceBuffer

    ctx = Context.primary(0)
    with ctx:
        buf = DeviceBuffer(64)
    ptr = buf.ptr
    ctx.close()
    assert gpu.resets[0] == 1 and gpu.allocation(ptr) is None
    gc.collect()  # garbage of earlier tests first: its frees are not this test's
    before = len(lifetime.failed_frees())
    del buf
    gc.collect()
    assert [f for f in lifetime.failed_frees()[before:] if f.context == ctx.handle] == []


class _Res:
    """Stands for a buffer: its finalizer frees it in its context."""


def _collected_while_state_is_built(monkeypatch, fake_driver, ctx, handle):
    """A resource whose last reference goes while a thread builds its ctxkit state (as
    the collector may free it at that allocation); returns what keeps it until then."""
    held = [_Res()]
    lifetime.finalizer(held[0], ctx, fake_driver.fake_free, handle)

    class CollectingState(context_mod._ThreadState):
        __slots__ = ()

        def __init__(self) -> None:
            held.clear()
            super().__init__()

    monkeypatch.setattr(context_mod, "_ThreadState", CollectingState)
    return held


def _fresh_thread_drops(res: list) -> None:
    """A thread that never used ctxkit drops the last reference to a resource."""
    in_thread(res.clear, name="never-used-ctxkit")


def _ctxkit_worker_starts(ctx: Context) -> None:
    """A ctxkit worker thread binds its context for its whole life at start."""
    with ck.ContextExecutor(ctx, max_workers=1) as ex:
        ex.submit(int).result()


@pytest.mark.parametrize("where", ["a thread that never used ctxkit", "a ctxkit worker"])
def test_a_free_run_while_a_thread_builds_its_state_is_made(fake_driver, monkeypatch, where):
    """The collector may run a finalizer at any allocation, also while a thread builds
    its context state (a new pipeline or executor thread, or a free that is the thread's
    first use of ctxkit): the free is made in its context, none fails."""
    ctx = Context.primary(1)
    failed = len(lifetime.failed_frees())
    _collected_while_state_is_built(monkeypatch, fake_driver, ctx, 7)
    if where == "a ctxkit worker":
        _ctxkit_worker_starts(ctx)
        expected = [(7, ctx.handle)]
    else:
        first = [_Res()]
        lifetime.finalizer(first[0], ctx, fake_driver.fake_free, 8)
        _fresh_thread_drops(first)
        expected = [(7, ctx.handle), (8, ctx.handle)]
    assert lifetime.failed_frees()[failed:] == []
    assert sorted(fake_driver.freed_in) == expected
    assert fake_driver.current() == 0


def test_a_free_run_while_a_new_thread_lists_the_bindings_is_made(fake_driver, monkeypatch):
    """A finalizer that runs while a thread reads the bindings of all threads (under
    their lock) may be that thread's first use of ctxkit, which lists the thread."""
    ctx = Context.primary(0)
    held = [_Res()]
    lifetime.finalizer(held[0], ctx, fake_driver.fake_free, 9)

    class CollectingDict(dict):
        def copy(self) -> dict:
            held.clear()
            return dict(self)

    monkeypatch.setattr(context_mod, "_all_threads", CollectingDict(context_mod._all_threads))
    t = threading.Thread(target=thread_bindings, name="lists-bindings", daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the thread waits for the lock it holds"
    assert fake_driver.freed_in == [(9, ctx.handle)]
