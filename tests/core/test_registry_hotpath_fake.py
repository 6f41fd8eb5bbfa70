"""The cheap paths of ``bind``, ``bound`` and ``resolve_context`` keep their rules."""

from __future__ import annotations

import pytest

import ctxkit as ck
from ctxkit.binding import resolve_context
from ctxkit.context import Context, thread_state
from tests.support.helpers import in_thread


def test_bind_of_the_current_context_makes_no_driver_call(fake_driver):
    ctx = ck.registry.context(0)
    with ctx:
        pushes = fake_driver.calls["cuCtxPushCurrent"]
        for target in (ctx, 0, ck.Device(0)):
            with ck.bind(target) as got:
                assert got is ctx and fake_driver.current() == ctx.handle
        assert fake_driver.calls["cuCtxPushCurrent"] == pushes
        assert len(thread_state().stack) == 1
    assert fake_driver.current() == 0


def test_bind_hot_nested_inside_other_contexts(fake_driver):
    a, b = ck.registry.context(0), ck.registry.context(1)
    with a, b:
        pushes = fake_driver.calls["cuCtxPushCurrent"]
        with ck.bind(b):  # already on top: a re-entry
            assert fake_driver.calls["cuCtxPushCurrent"] == pushes
            with ck.bind(a):  # current below, not on top: a real push
                assert fake_driver.current() == a.handle
                assert fake_driver.calls["cuCtxPushCurrent"] == pushes + 1
                with ck.bind(0):
                    assert fake_driver.calls["cuCtxPushCurrent"] == pushes + 1
            assert fake_driver.current() == b.handle and thread_state().top is b
        assert thread_state().top is b and fake_driver.current() == b.handle
    assert fake_driver.stack() == [] and thread_state().stack == []


def test_bind_hot_and_an_exception_restore_the_same_state(fake_driver):
    ctx = ck.registry.context(1)
    with ctx:
        before = list(thread_state().stack)
        for target in (ctx, 1):
            with pytest.raises(RuntimeError, match="inside"), ck.bind(target):
                raise RuntimeError("inside")
            assert thread_state().stack == before and thread_state().top is ctx
            assert fake_driver.current() == ctx.handle
    assert fake_driver.current() == 0


def test_bind_resolves_without_binding(fake_driver):
    ctx = ck.bind(1)
    assert isinstance(ctx, Context) and ctx is ck.registry.context(1)
    assert fake_driver.current() == 0 and thread_state().stack == []


def test_bind_rejects_what_is_not_a_device(fake_driver):
    for bad in ("0", 1.0, None, True):
        with pytest.raises(TypeError, match="device ordinal"):
            ck.bind(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("first", ["bind", "resolve_context"])
def test_a_closed_registry_context_is_replaced(fake_driver, first):
    ck.registry.kind = "owned"
    old = ck.bind(0)
    old.close()
    new = ck.bind(0) if first == "bind" else resolve_context(0, "x")
    assert new is not old and not new.closed
    assert ck.bind(0) is new and resolve_context(0, "x") is new
    with ck.bind(0):
        assert fake_driver.current() == new.handle


def test_bound_to_a_context_binds_it_in_any_thread(fake_driver):
    ctx = ck.registry.context(1)

    @ck.bound(ctx)
    def where(fail: bool = False) -> int:
        if fail:
            raise KeyError("boom")
        return fake_driver.current()

    assert where() == ctx.handle and fake_driver.current() == 0
    assert in_thread(where) == ctx.handle
    with pytest.raises(KeyError):
        where(fail=True)
    assert thread_state().stack == [] and fake_driver.current() == 0
    with ck.registry.context(0):
        assert where() == ctx.handle
        assert fake_driver.current() == ck.registry.context(0).handle


def test_bound_to_an_ordinal_follows_the_registry(fake_driver):
    @ck.bound(0)
    def where() -> int:
        return fake_driver.current()

    first = where()
    mine = Context.create(0)
    ck.registry.set(0, mine)
    assert first != mine.handle and where() == mine.handle


def test_resolve_context_of_each_kind_of_target(fake_driver):
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    assert resolve_context(c1, "x") is c1
    assert resolve_context(0, "x") is c0
    assert resolve_context(ck.Device(1), "x") is c1
    with c1:
        assert resolve_context(None, "x") is c1
    with pytest.raises(ck.NoCurrentContextError, match="allocating"):
        resolve_context(None, "allocating")
    with pytest.raises(TypeError, match="device ordinal"):
        resolve_context("1", "x")  # type: ignore[arg-type]


def test_resolve_context_refuses_closed_and_poisoned_contexts(fake_driver):
    owned = Context.create(1)
    owned.close()
    with pytest.raises(ck.ContextClosedError):
        resolve_context(owned, "x")
    ctx = ck.registry.context(0)
    ctx.note_error(700, "cuCtxSynchronize")  # a sticky fault poisons it
    for target in (ctx, 0, ck.Device(0)):
        with pytest.raises(ck.ContextPoisonedError):
            resolve_context(target, "x")
    with pytest.raises(ck.ContextPoisonedError), ck.bind(0):
        pass
