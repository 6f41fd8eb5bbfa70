"""Context push/pop/close logic against a fake of the driver's per-thread stack."""

from __future__ import annotations

import threading

import pytest

import ctxkit as ck
from ctxkit import context as context_mod
from ctxkit import lifetime
from ctxkit.context import Context, current_context, thread_bindings, thread_state
from tests.support.fakedriver import FakeHandle


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
    assert fake_driver.primary_refs[0] == 0
    c = Context.primary(0)
    assert c is not a and c == a  # same driver handle, new retained wrapper


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


def test_close_refused_when_current_through_raw_push(fake_driver):
    ctx = Context.create(0)
    fake_driver.stack().append(ctx._cu)
    with pytest.raises(ck.ContextInUseError):
        ctx.close()
    fake_driver.stack().pop()
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


def test_free_raises_on_failure_and_free_quietly_does_not(fake_driver):
    ctx = Context.primary(0)

    def bad(_h: int) -> tuple[int]:
        return (1,)

    with pytest.raises(ck.CudaError):
        ctx.free(bad, 1)
    lifetime.free_quietly(ctx, bad, 1)


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


def test_synchronize_and_memory_info(fake_driver):
    ctx = Context.primary(0)
    ctx.synchronize()
    assert ctx.memory_info() == (1 << 30, 2 << 30)
    assert fake_driver.current() == 0


def test_run_in(fake_driver):
    ctx = Context.primary(1)
    assert ctx.run_in(fake_driver.current) == ctx.handle


def test_sticky_error_poisons_context(fake_driver):
    ctx = Context.primary(0)
    exc = ctx.note_error(700, "cuCtxSynchronize")
    assert isinstance(exc, ck.ContextPoisonedError)
    assert ctx.poisoned and "poisoned" in repr(ctx)
    with pytest.raises(ck.ContextPoisonedError), ctx:
        pass
    # other contexts are unaffected
    with Context.primary(1):
        pass


def test_require_current(fake_driver):
    with pytest.raises(ck.NoCurrentContextError, match="ctxkit.bind"):
        context_mod.require_current("allocating")
    ctx = Context.primary(0)
    with ctx:
        assert context_mod.require_current("x") is ctx
    fake_driver.stack().append(ctx._cu)
    assert context_mod.require_current("x") is ctx
    fake_driver.stack().pop()


class _Recorder:
    """Stands in for a Context in free_quietly: records the frees that ran."""

    def __init__(self) -> None:
        self.freed: list[tuple[str, int]] = []
        self.handle = 0

    def free(self, fn, *args) -> None:
        self.freed.append((threading.current_thread().name, *args))


def _free_in_thread(rec: _Recorder, value: int) -> None:
    t = threading.Thread(target=lifetime.free_quietly, args=(rec, None, value), name="other")
    t.start()
    t.join()


@pytest.mark.parametrize("global_mode", [False, True])
def test_frees_wait_for_the_end_of_a_capture_they_would_invalidate(global_mode):
    rec = _Recorder()
    lifetime.capture_begins(global_mode)
    try:
        lifetime.free_quietly(rec, None, 1)  # e.g. garbage collected inside the block
        _free_in_thread(rec, 2)
        assert rec.freed == ([] if global_mode else [("other", 2)])
    finally:
        lifetime.capture_ends(global_mode)
    main = threading.current_thread().name
    # Held-back frees run in the thread that ends the capture.
    assert sorted(v for _t, v in rec.freed) == [1, 2]
    assert (main, 1) in rec.freed
    lifetime.free_quietly(rec, None, 3)  # no capture: at once
    assert rec.freed[-1] == (main, 3)


def test_nested_captures_in_one_thread_release_frees_at_the_outer_end():
    rec = _Recorder()
    lifetime.capture_begins(False)
    lifetime.capture_begins(False)
    lifetime.free_quietly(rec, None, 1)
    lifetime.capture_ends(False)
    assert rec.freed == []
    lifetime.capture_ends(False)
    assert [v for _t, v in rec.freed] == [1]
