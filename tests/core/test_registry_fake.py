"""Registry, bind/bound, guard and ContextExecutor against the fake driver stack."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import ctxkit as ck
from ctxkit.binding import ContextRegistry, guard
from ctxkit.context import Context, thread_state
from ctxkit.executor import ContextExecutor
from tests.support.helpers import in_thread


def _reg() -> ContextRegistry:
    return ck.registry


def test_registry_context_created_once_across_threads(fake_driver):
    reg = _reg()
    barrier = threading.Barrier(32)

    def get() -> Context:
        barrier.wait()
        return reg.context(1)

    with ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda _: get(), range(32)))
    assert all(c is got[0] for c in got)
    assert got[0].is_primary and got[0].device.ordinal == 1
    assert fake_driver.calls["cuDevicePrimaryCtxRetain"] == 1


def test_registry_owned_kind_and_close(fake_driver):
    reg = ContextRegistry(kind="owned")
    a, b = reg.context(0), reg.context(ck.Device(1))
    assert a.kind == b.kind == "owned"
    assert reg.contexts() == {0: a, 1: b}
    reg.close()
    assert a.closed and b.closed
    assert fake_driver.calls["cuCtxDestroy"] == 2
    reg.close()
    c = reg.context(0)  # a fresh one after close
    assert c is not a and not c.closed


def test_registry_rejects_bad_kind_and_targets(fake_driver):
    with pytest.raises(ValueError, match="kind"):
        ContextRegistry(kind="green")
    with pytest.raises(TypeError, match="Context, ctxkit.Device or device ordinal"):
        _reg().resolve("gpu0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        _reg().context(7)


def test_registry_set_user_context(fake_driver):
    reg = _reg()
    mine = Context.create(1)
    reg.set(1, mine)
    assert reg.context(1) is mine
    with pytest.raises(ValueError, match="belongs to device 1"):
        reg.set(0, mine)
    with pytest.raises(TypeError):
        reg.set(0, "ctx")  # type: ignore[arg-type]
    reg.close()
    assert not mine.closed  # user-made contexts are the user's to close


def test_bind_device_ordinal_and_context(fake_driver):
    with ck.bind(0) as ctx:
        assert fake_driver.current() == ctx.handle
        with ck.bind(1) as c1:
            assert fake_driver.current() == c1.handle
            with ck.bind(ctx):
                assert fake_driver.current() == ctx.handle
        assert fake_driver.current() == ctx.handle
    assert fake_driver.current() == 0


def test_bound_decorator_resolves_per_call(fake_driver):
    @ck.bound(1)
    def where() -> int:
        return fake_driver.current()

    assert where() == _reg().context(1).handle
    assert fake_driver.current() == 0
    assert where.__name__ == "where"


def test_bindings_introspection(fake_driver):
    ctx = _reg().context(0)
    with ctx:
        names = _reg().bindings()
        assert any(ctx in v for v in names.values())
    assert not any(ctx in v for v in _reg().bindings().values())


def test_guard_in_a_thread_without_context_binds_the_owner(fake_driver):
    owner = _reg().context(0)
    assert in_thread(lambda: guard(owner, "DeviceBuffer.copy_to_host")) is owner


def test_strict_guard_without_context_names_thread_and_fix(fake_driver):
    owner = _reg().context(0)
    _reg().strict = True
    with pytest.raises(ck.NoCurrentContextError) as info:
        in_thread(lambda: guard(owner, "DeviceBuffer.copy_to_host"), name="request-handler-3")
    msg = str(info.value)
    assert "request-handler-3" in msg and "ctxkit.bind" in msg
    assert "DeviceBuffer.copy_to_host" in msg and "device 0" in msg
    assert info.value.name == "CUDA_ERROR_INVALID_CONTEXT"
    with owner:
        assert guard(owner, "x") is owner  # a thread with a context is never refused


def test_guard_binds_owner_when_other_context_current(fake_driver):
    owner = _reg().context(0)
    with _reg().context(1):
        assert guard(owner, "x") is owner
    fake_driver.stack().append(FakeRaw := fake_driver.primary[1])
    assert guard(owner, "x") is owner  # a raw (foreign) push counts as a context
    fake_driver.stack().remove(FakeRaw)


def test_strict_mode_refuses_the_implicit_bind_of_a_thread_with_no_context(fake_driver):
    reg = _reg()
    owner = reg.context(0)
    reg.strict = True
    with pytest.raises(ck.NoCurrentContextError):
        in_thread(lambda: guard(owner, "x"))
    reg.strict = False
    assert in_thread(lambda: guard(owner, "x")) is owner


def test_executor_runs_every_task_with_context_current(fake_driver):
    ctx = _reg().context(1)
    before = fake_driver.current()
    with ContextExecutor(ctx, max_workers=16, thread_name_prefix="exec-1000") as ex:
        currents = list(ex.map(lambda _: fake_driver.current(), range(1000)))
    assert set(currents) == {ctx.handle}
    assert fake_driver.current() == before
    assert all(not st for st in fake_driver.stacks.values())  # workers popped on exit
    # one push per worker, not per task
    worker_pushes = {
        k: v for k, v in fake_driver.pushes_by_thread.items() if k.startswith("exec-1000")
    }
    assert 1 <= len(worker_pushes) <= 16 and set(worker_pushes.values()) == {1}


def test_executor_repairs_task_that_leaks_a_push(fake_driver):
    ctx, other = _reg().context(0), _reg().context(1)
    with ContextExecutor(ctx, max_workers=1) as ex:
        ex.submit(other.push).result()
        assert ex.submit(fake_driver.current).result() == ctx.handle
    assert all(not st for st in fake_driver.stacks.values())


def test_executor_exceptions_cancel_and_shutdown(fake_driver):
    ex = ContextExecutor(0, max_workers=2)
    fut = ex.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result()
    ex.shutdown(cancel_futures=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(int)
    ex.shutdown()  # twice is fine


def test_executor_closed_context_fails_fast(fake_driver):
    ctx = Context.create(0)
    ctx.close()
    with pytest.raises(ck.ContextClosedError):
        ContextExecutor(ctx)


def test_executor_argument_validation(fake_driver):
    with pytest.raises(ValueError, match="max_workers"):
        ContextExecutor(0, max_workers=0)
    with pytest.raises(ValueError, match="blas_threads"):
        ContextExecutor(0, blas_threads=0)
    with pytest.raises(ValueError, match="blas_threads"):
        ContextExecutor(0, blas_threads="many")


def test_executor_blas_limits_apply_and_restore(fake_driver):
    import numpy  # noqa: F401  (loads the BLAS library threadpoolctl controls)
    from threadpoolctl import threadpool_info

    def blas_threads() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    original = blas_threads()
    if not original:
        pytest.skip("numpy has no BLAS threadpool that threadpoolctl can see")
    ex = ContextExecutor(0, max_workers=2, blas_threads=1)
    ex2 = ContextExecutor(0, max_workers=2, blas_threads="auto")
    assert ex.submit(blas_threads).result() == [1] * len(original)
    ex.shutdown()
    assert blas_threads() == [1] * len(original)  # still held by ex2
    ex2.shutdown()
    assert blas_threads() == original


def test_thread_pool_tasks_wrapped_in_bind_alternating_devices(fake_driver):
    reg = _reg()

    def task(i: int) -> bool:
        ctx = reg.context(i % 2)
        with ck.bind(i % 2):
            return fake_driver.current() == ctx.handle

    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(task, range(400)))
    assert all(not st for st in fake_driver.stacks.values())


def test_stress_random_nested_binds_match_driver(fake_driver):
    reg = _reg()
    pool = [reg.context(0), reg.context(1), Context.create(0)]
    mismatches: list[str] = []

    def walk(seed: int) -> None:
        rng = random.Random(seed)
        expected: list[int] = []
        stack: list[Context] = []
        for _ in range(2000):
            if stack and (rng.random() < 0.5 or len(stack) > 8):
                stack.pop().__exit__(None, None, None)
                expected.pop()
            else:
                c = rng.choice(pool)
                c.__enter__()
                stack.append(c)
                expected.append(c.handle)
            want = expected[-1] if expected else 0
            if fake_driver.current() != want:
                mismatches.append(f"seed {seed}: {fake_driver.current():#x} != {want:#x}")
        while stack:
            stack.pop().__exit__(None, None, None)
        if fake_driver.stack() or thread_state().stack:
            mismatches.append(f"seed {seed}: leftover pushes")

    threads = [threading.Thread(target=walk, args=(s,)) for s in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mismatches == []


def test_at_exit_releases_registry_contexts_when_no_worker_is_alive(fake_driver, monkeypatch):
    import ctxkit.executor as reg_mod
    from ctxkit import context as context_mod

    monkeypatch.setattr(context_mod, "_shutting_down", False)
    monkeypatch.setattr(reg_mod, "_live_executors", reg_mod.weakref.WeakSet())
    reg = _reg()
    c0, c1 = reg.context(0), reg.context(1)
    with ContextExecutor(c0, max_workers=2) as ex:
        ex.submit(int).result()
    c1.push()  # still current in this thread at exit: left to the process teardown
    reg_mod._at_exit()
    assert c0.closed and not c1.closed
    assert context_mod._shutting_down
    c1.pop()


def test_at_exit_leaves_busy_executors_and_contexts_alone(fake_driver, monkeypatch):
    import ctxkit.executor as reg_mod
    from ctxkit import context as context_mod

    monkeypatch.setattr(context_mod, "_shutting_down", False)
    monkeypatch.setattr(reg_mod, "_live_executors", reg_mod.weakref.WeakSet())
    c0 = _reg().context(0)
    ex = ContextExecutor(c0, max_workers=1)
    started, release = threading.Event(), threading.Event()

    def busy() -> int:
        started.set()
        release.wait(5)
        return 7

    fut = ex.submit(busy)
    started.wait(5)
    reg_mod._at_exit()  # must not wait for the busy task nor shut its executor down
    assert not c0.closed and not ex._shutdown
    release.set()
    assert fut.result(5) == 7
    ex.shutdown()
