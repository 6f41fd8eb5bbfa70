"""The cheap paths of ``with ctx:``: re-entry, thread-local state, popped-handle checks.

``__enter__``/``__exit__`` take shortcuts (the thread's state read from a plain
``threading.local``, a popped handle compared by value where the bindings allow it, one
"unusable" flag); these tests pin down that the shortcuts keep every rule of a push/pop.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import ctxkit as ck
from ctxkit import context as context_mod
from ctxkit.context import Context, thread_state
from tests.support.fakedriver import FakeDriver, FakeHandle, swap_driver
from tests.support.helpers import in_thread


class IdentityHandle:
    """A handle like cuda-bindings 12.8's ``CUcontext``: ``int()`` gives the value, but
    ``==`` is identity, so two objects for one context never compare equal."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


class FreshHandleDriver(FakeDriver):
    """Answers every call with a new handle object of *handle_type*, as the bindings do."""

    def __init__(self, handle_type: Any) -> None:
        super().__init__(ndev=2)
        self.handle_type = handle_type

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[int, Any]:
        err, h = super().cuDevicePrimaryCtxRetain(dev)
        return err, self.handle_type(int(h))

    def cuCtxPopCurrent(self) -> tuple[int, Any]:
        err, h = super().cuCtxPopCurrent()
        return err, self.handle_type(int(h))

    def cuCtxGetCurrent(self) -> tuple[int, Any]:
        err, h = super().cuCtxGetCurrent()
        return err, self.handle_type(int(h))


def _real_handle_type() -> Any:
    from cuda.bindings import driver

    return driver.CUcontext


@pytest.fixture(params=["identity", "by-value", "cuda-bindings"])
def fresh_driver(request: pytest.FixtureRequest, fake_driver: FakeDriver, monkeypatch):
    """The fake driver, but every popped handle is a new object (three handle kinds)."""
    kinds = {"identity": IdentityHandle, "by-value": FakeHandle}
    handle_type = kinds.get(request.param) or _real_handle_type()
    fake = FreshHandleDriver(handle_type)
    swap_driver(monkeypatch, fake)
    return fake


def test_a_fresh_popped_handle_of_the_same_context_is_accepted(fresh_driver):
    a, b = Context.primary(0), Context.primary(1)
    for _ in range(3):
        with a:
            with b:
                assert fresh_driver.current() == b.handle
            assert fresh_driver.current() == a.handle
    assert fresh_driver.current() == 0 and thread_state().stack == []


def test_a_foreign_push_is_detected_whatever_the_handle_type(fresh_driver):
    ctx = Context.primary(0)
    foreign = fresh_driver.handle_type(0xF00)
    with pytest.raises(ck.ContextStackError, match="expected to pop") as ei, ctx:
        fresh_driver.stack().append(foreign)
    assert "0xf00" in str(ei.value)
    assert fresh_driver.current() == 0xF00  # put back, not popped
    fresh_driver.stack().pop()
    ctx.pop()
    assert fresh_driver.current() == 0 and thread_state().stack == []


def test_a_foreign_pop_is_detected_whatever_the_handle_type(fresh_driver):
    outer, inner = Context.primary(1), Context.primary(0)
    with outer:
        with pytest.raises(ck.ContextStackError, match="popped this context"), inner:
            fresh_driver.stack().pop()
        assert fresh_driver.current() == outer.handle
    assert fresh_driver.current() == 0


def test_reentries_that_raise_leave_one_real_push(fake_driver):
    ctx = Context.primary(0)
    with ctx:
        pushes = fake_driver.calls["cuCtxPushCurrent"]
        for depth in range(1, 4):
            with pytest.raises(KeyError):
                for _ in range(depth):
                    ctx.__enter__()
                try:
                    raise KeyError(depth)
                finally:
                    for _ in range(depth):
                        ctx.__exit__(KeyError, None, None)
            assert len(thread_state().stack) == 1 and thread_state().top is ctx
        with pytest.raises(ValueError), ctx, ctx, ctx:
            raise ValueError
        assert len(thread_state().stack) == 1
        assert fake_driver.calls["cuCtxPushCurrent"] == pushes
        assert fake_driver.current() == ctx.handle
    assert fake_driver.current() == 0 and thread_state().top is None
    assert fake_driver.calls["cuCtxPopCurrent"] == 1


def test_reentry_counts_in_the_stack_and_pops_in_order(fake_driver):
    """Re-entries are recorded like pushes (executors and diagnostics count them)."""
    a, b = Context.primary(0), Context.primary(1)
    a.push()
    a.push()  # re-entry
    b.push()
    assert len(thread_state().stack) == 3
    with pytest.raises(ck.ContextStackError, match="innermost"):
        a.pop()
    assert [context_mod.entry_context(e) for e in thread_state().stack] == [a, a, b]
    b.pop()
    a.pop()
    assert fake_driver.current() == a.handle  # only the re-entry ended
    a.pop()
    assert fake_driver.current() == 0
    with pytest.raises(ck.ContextStackError, match="pushed nothing"):
        a.pop()
    assert thread_state().stack == []


def test_a_refused_pop_leaves_the_record_as_it_was(fake_driver):
    a, b = Context.primary(0), Context.primary(1)
    with a:
        b.push()
        before = list(thread_state().stack)
        with pytest.raises(ck.ContextStackError):
            a.pop()
        assert thread_state().stack == before and thread_state().top is b
        b.pop()
    assert fake_driver.current() == 0


def test_reentry_in_one_thread_is_a_real_push_in_another(fake_driver):
    ctx = Context.primary(0)
    with ctx:
        main_stack = list(thread_state().stack)

        def worker() -> tuple[Any, int, int]:
            top_before = thread_state().top
            with ctx:
                inside = fake_driver.current()
                with ctx:
                    pass
            return top_before, inside, fake_driver.current()

        top_before, inside, after = in_thread(worker, name="other")
        assert top_before is None and inside == ctx.handle and after == 0
        assert fake_driver.pushes_by_thread["other"] == 1  # the re-entry cost nothing
        assert thread_state().stack == main_stack and thread_state().top is ctx
        assert fake_driver.current() == ctx.handle


def test_a_new_thread_has_one_state_whichever_path_builds_it(fake_driver):
    """``with ctx:`` (the push path) and ``thread_state()`` build a new thread's state at
    its first use, whichever comes first, and then share it."""
    ctx = Context.primary(0)

    def push_first() -> bool:
        with ctx:
            st = thread_state()
            return st is thread_state() and st.top is ctx

    def state_first() -> bool:
        st = thread_state()
        with ctx:
            return st is thread_state() and st.top is ctx and len(st.stack) == 1

    assert in_thread(push_first) is True
    assert in_thread(state_first) is True


def test_a_thread_is_listed_once_its_first_push_is_made(fake_driver):
    ctx = Context.primary(0)
    inside = threading.Event()
    leave = threading.Event()

    def worker() -> None:
        with ctx:
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=worker, name="lister")
    t.start()
    try:
        assert inside.wait(10)
        assert any(k.startswith("lister") for k in ck.registry.bindings())
        with pytest.raises(ck.ContextInUseError, match="lister"):
            ctx.close()
    finally:
        leave.set()
        t.join()


def test_closed_and_poisoned_contexts_refuse_a_push(fake_driver):
    owned = Context.create(0)
    owned.close()
    with pytest.raises(ck.ContextClosedError, match="closed"), owned:
        pass
    with pytest.raises(ck.ContextClosedError):
        owned.check_usable()
    ctx = Context.primary(1)
    fake_driver.fault = 700
    with pytest.raises(ck.ContextPoisonedError):
        ctx.synchronize()
    pushes = fake_driver.calls["cuCtxPushCurrent"]
    with pytest.raises(ck.ContextPoisonedError), ctx:
        pass
    assert fake_driver.calls["cuCtxPushCurrent"] == pushes
    with pytest.raises(ck.ContextPoisonedError):
        ctx.check_usable()
    assert thread_state().stack == [] and fake_driver.current() == 0


def test_free_in_the_current_context_makes_no_push(fake_driver):
    ctx = Context.primary(0)
    with ctx:
        pushes = fake_driver.calls["cuCtxPushCurrent"]
        ctx.free(fake_driver.fake_free, 7)
        assert fake_driver.calls["cuCtxPushCurrent"] == pushes
    assert fake_driver.freed_in == [(7, ctx.handle)]


def _foreign_made_current(driver: FakeDriver, ctx: Context) -> None:
    """What PyTorch or CuPy leave behind: *ctx* current in the driver, nothing in ctxkit."""
    driver.stack().append(FakeHandle(ctx.handle))


def test_a_context_another_library_made_current_is_used_without_push_or_pop(fresh_driver):
    ctx = Context.primary(0)
    fresh_driver.stack().append(fresh_driver.handle_type(ctx.handle))
    pushes, pops = fresh_driver.calls["cuCtxPushCurrent"], fresh_driver.calls["cuCtxPopCurrent"]
    for _ in range(3):
        with ctx as entered:
            assert entered is ctx and thread_state().top is ctx
            assert ck.current_context() is ctx
            with ctx:  # a re-entry inside it: no driver call either
                assert len(thread_state().stack) == 2
        assert thread_state().top is None and thread_state().stack == []
    assert fresh_driver.calls["cuCtxPushCurrent"] == pushes
    assert fresh_driver.calls["cuCtxPopCurrent"] == pops
    assert fresh_driver.current() == ctx.handle  # still the other library's


def test_a_thread_found_with_nothing_current_stops_asking(fake_driver):
    """Nothing current in the driver: the first outermost block asks (one
    cuCtxGetCurrent); later ones push and pop without asking, the raw pair's two calls."""
    ctx = Context.primary(0)

    def blocks() -> tuple[int, int]:
        with ctx:
            pass
        first = fake_driver.calls["cuCtxGetCurrent"]
        for _ in range(5):
            with ctx:
                assert fake_driver.current() == ctx.handle
        return first, fake_driver.calls["cuCtxGetCurrent"]

    assert in_thread(blocks) == (1, 1)
    assert fake_driver.calls["cuCtxPushCurrent"] == fake_driver.calls["cuCtxPopCurrent"] == 6


def test_a_thread_another_library_keeps_current_is_asked_at_every_outermost_block(fake_driver):
    ctx = Context.primary(0)

    def blocks() -> None:
        _foreign_made_current(fake_driver, ctx)
        for _ in range(3):
            with ctx:
                assert thread_state().stack == [(ctx, context_mod.ADOPTED)]

    in_thread(blocks)
    assert fake_driver.calls["cuCtxGetCurrent"] == 6  # one at each end of each block
    assert fake_driver.calls["cuCtxPushCurrent"] == fake_driver.calls["cuCtxPopCurrent"] == 0


def test_a_context_made_current_after_ctxkit_stopped_asking_is_pushed_over(fake_driver):
    """Once a thread is found with nothing current, a context another library makes
    current there later is pushed again and popped back: its stack is as it was."""
    ctx = Context.primary(0)

    def blocks() -> list[int]:
        with ctx:
            pass
        _foreign_made_current(fake_driver, ctx)  # e.g. torch ran its first op
        with ctx:
            assert [int(h) for h in fake_driver.stack()] == [ctx.handle, ctx.handle]
        return [int(h) for h in fake_driver.stack()]

    assert in_thread(blocks) == [ctx.handle]


def test_another_context_current_in_the_driver_is_pushed_over_and_restored(fake_driver):
    a, b = Context.primary(0), Context.primary(1)
    _foreign_made_current(fake_driver, b)
    with a:
        assert fake_driver.current() == a.handle
    assert fake_driver.current() == b.handle
    assert fake_driver.calls["cuCtxPushCurrent"] == 1 and fake_driver.calls["cuCtxPopCurrent"] == 1


def test_switching_inside_an_adopted_block_pushes_and_comes_back(fake_driver):
    a, b = Context.primary(0), Context.primary(1)
    _foreign_made_current(fake_driver, a)
    with a:
        with b:
            assert fake_driver.current() == b.handle and thread_state().top is b
            with a:  # ctxkit has b on top: a real push again
                assert fake_driver.current() == a.handle
        assert fake_driver.current() == a.handle and thread_state().top is a
    assert fake_driver.stack() == [FakeHandle(a.handle)]
    assert fake_driver.calls["cuCtxPushCurrent"] == 2 and fake_driver.calls["cuCtxPopCurrent"] == 2


def test_an_adopted_context_is_in_use_and_pops_in_order(fake_driver):
    a, b = Context.primary(0), Context.primary(1)
    _foreign_made_current(fake_driver, a)
    a.push()
    assert thread_bindings_of_this_thread() == [a]
    with pytest.raises(ck.ContextInUseError, match="current in thread"):
        a.close()
    b.push()
    with pytest.raises(ck.ContextStackError, match="reverse order"):
        a.pop()
    b.pop()
    a.pop()
    assert thread_state().stack == [] and fake_driver.current() == a.handle


def test_an_adopted_closed_context_still_refuses(fake_driver):
    ctx = Context.primary(0)
    handle = ctx.handle
    ctx.close()
    fake_driver.stack().append(FakeHandle(handle))
    with pytest.raises(ck.ContextClosedError), ctx:
        pass
    assert thread_state().stack == []


def thread_bindings_of_this_thread() -> list[Context]:
    me = threading.current_thread()
    return next(v for k, v in ck.context.thread_bindings().items() if k.startswith(me.name))


@pytest.fixture(params=["made current by another library", "nothing current"])
def before(request: pytest.FixtureRequest, fresh_driver: FreshHandleDriver) -> str:
    """The driver's stack in this thread before ``with ctx:``: ctx already current (the
    block pushes nothing), or empty (the block pushes)."""
    if request.param != "nothing current":
        fresh_driver.stack().append(fresh_driver.handle_type(Context.primary(0).handle))
    return str(request.param)


def test_a_foreign_push_inside_a_block_is_reported_and_recoverable(fresh_driver, before):
    ctx = Context.primary(0)
    below = list(fresh_driver.stack())
    with pytest.raises(ck.ContextStackError, match="did not pop it") as ei, ctx:
        fresh_driver.stack().append(fresh_driver.handle_type(0xF00))  # raw push, never popped
    assert f"{ctx.handle:#x}" in str(ei.value) and "0xf00" in str(ei.value)
    assert fresh_driver.current() == 0xF00  # ctxkit popped nothing of it
    assert thread_state().top is None
    assert [context_mod.entry_context(e) for e in thread_state().stack] == [ctx]
    fresh_driver.stack().pop()  # the foreign code balances its push
    ctx.pop()  # ctxkit's record completes
    assert thread_state().stack == [] and thread_state().top is None
    assert [int(h) for h in fresh_driver.stack()] == [int(h) for h in below]


def test_a_foreign_pop_inside_a_block_is_reported(fresh_driver, before):
    """Foreign code pops the context of the block; what was beneath stays current."""
    ctx, other = Context.primary(0), Context.primary(1)
    fresh_driver.stack().insert(0, fresh_driver.handle_type(other.handle))
    with pytest.raises(ck.ContextStackError, match="popped this context"), ctx:
        fresh_driver.stack().pop()
    assert thread_state().stack == [] and thread_state().top is None
    assert [int(h) for h in fresh_driver.stack()] == [other.handle]
    with ctx:  # the thread's state is sound: a push and a pop
        assert fresh_driver.current() == ctx.handle
    assert [int(h) for h in fresh_driver.stack()] == [other.handle]


def test_a_foreign_pop_of_the_only_context_inside_a_block_that_pushed_nothing(fresh_driver):
    ctx = Context.primary(0)
    fresh_driver.stack().append(fresh_driver.handle_type(ctx.handle))
    with pytest.raises(ck.ContextStackError, match="popped this context"), ctx:
        fresh_driver.stack().pop()
    assert thread_state().stack == [] and fresh_driver.stack() == []


def test_a_block_that_pushed_nothing_costs_one_driver_call_at_each_end(fake_driver):
    ctx = Context.primary(0)
    _foreign_made_current(fake_driver, ctx)
    with ctx:
        assert fake_driver.calls["cuCtxGetCurrent"] == 1
    assert fake_driver.calls["cuCtxGetCurrent"] == 2
    assert fake_driver.calls["cuCtxPushCurrent"] == fake_driver.calls["cuCtxPopCurrent"] == 0
