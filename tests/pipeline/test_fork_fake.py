"""A child forked while other threads hold ctxkit's locks (a map in progress, the pin
cache, the registry, the block cache, ...) gets ForkError at once from every entry point,
and never waits on a lock it inherited held (issue 27, item 3)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import _driver, context, executor, lifetime, registry
from ctxkit.memory import alloc, pinned
from ctxkit.pipeline import Pipeline, pincache
from tests.support.fakegpu import scale_body

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

CHILD_LIMIT_S = 2.0


def in_child(fn: Callable[[], str]) -> str:
    """Fork; the child runs *fn* and reports its string. A child that does not exit
    within CHILD_LIMIT_S is killed and the test fails (instead of hanging)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, fn().encode())
        except BaseException as exc:
            os.write(w, f"child raised {exc!r}".encode())
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + CHILD_LIMIT_S
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        pytest.fail(f"the forked child hung (killed after {CHILD_LIMIT_S} s)")
    with os.fdopen(r, "rb") as f:
        return f.read().decode()


def outcomes(calls: dict[str, Callable[[], Any]]) -> str:
    """``name=ExceptionType`` for each call (``name=returned`` when it returned)."""
    got = []
    for name, fn in calls.items():
        try:
            fn()
            got.append(f"{name}=returned")
        except Exception as exc:
            got.append(f"{name}={type(exc).__name__}")
    return " ".join(got)


@pytest.fixture
def hold() -> Iterator[Callable[..., Callable[[], None]]]:
    """``hold(*locks)``: a thread takes every lock and keeps it until the test ends or
    calls the function returned."""
    release = threading.Event()
    threads: list[threading.Thread] = []

    def let_go() -> None:
        release.set()
        for t in threads:
            t.join(5)

    def take(*locks: Any) -> Callable[[], None]:
        taken = threading.Event()

        def run() -> None:
            for lock in locks:
                lock.acquire()
            taken.set()
            release.wait()
            for lock in reversed(locks):
                lock.release()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        assert taken.wait(5)
        return let_go

    yield take
    let_go()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_child_forked_during_a_map_gets_fork_error_at_once(gpu):
    inside, leave = threading.Event(), threading.Event()

    def blocking_body(ctx: Any, stream: Any, d_in: Any, d_out: Any, n: int) -> None:
        inside.set()
        leave.wait(10)

    x = np.arange(64 * 1024, dtype=np.float32)
    p = Pipeline([0], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2))
    t = threading.Thread(target=p.map, args=(blocking_body, x), daemon=True)
    t.start()
    try:
        assert inside.wait(5)
        ctx = p.contexts[0]

        def child() -> str:
            def enter() -> None:
                with ctx:
                    pass

            return outcomes(
                {
                    "map": lambda: p.map(scale_body(gpu, 2.0), x[:1024]),
                    "Pipeline": lambda: Pipeline([0]),
                    "release_pinned": p.release_pinned,
                    "submit": lambda: p.submit(0, lambda c, s: None),
                    "DeviceBuffer": lambda: ck.DeviceBuffer(1024, context=ctx),
                    "with_ctx": enter,
                    "close": p.close,
                }
            )

        got = in_child(child)
    finally:
        leave.set()
        t.join(10)
        p.close()
    assert got == (
        "map=ForkError Pipeline=ForkError release_pinned=ForkError submit=ForkError "
        "DeviceBuffer=ForkError with_ctx=ForkError close=returned"
    ), got


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_child_forked_while_process_wide_locks_are_held_gets_fork_error(gpu, hold):
    x = np.arange(64 * 1024, dtype=np.float32)
    p = Pipeline([0], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2))
    ctx = ck.registry.context(0)
    buf = ck.DeviceBuffer(4096, context=ctx)
    pins = pincache.process_pins()
    pool = pinned.pinned_pool()
    let_go = hold(
        p._lock,
        pins._lock,
        pool._lock,
        registry._lock,
        alloc._lock,
        context.Context._class_lock,
        context._all_lock,
        lifetime._capture_cond,
        pinned._process_lock,
        pincache._process_lock,
    )

    def child() -> str:
        def enter() -> None:
            with ctx:
                pass

        def collect_buffer() -> None:
            nonlocal buf
            del buf  # its finalizer runs here: it must neither hang nor reach the driver

        report = outcomes(
            {
                "map": lambda: p.map(scale_body(gpu, 2.0), x),
                "Pipeline": lambda: Pipeline([0]),
                "registry_new_device": lambda: ck.registry.context(1),
                "DeviceBuffer": lambda: ck.DeviceBuffer(1024, context=ctx),
                "with_ctx": enter,
                "ctx_close": ctx.close,
                "collect_buffer": collect_buffer,
                "executor_at_exit": executor._at_exit,
                "blockcache_at_exit": alloc._at_exit,
            }
        )
        return report

    got = in_child(child)
    let_go()
    p.close()
    assert got == (
        "map=ForkError Pipeline=ForkError registry_new_device=ForkError "
        "DeviceBuffer=ForkError with_ctx=ForkError ctx_close=ForkError "
        "collect_buffer=returned executor_at_exit=returned blockcache_at_exit=returned"
    ), got


def _lock_types() -> tuple[type, ...]:
    return (
        type(threading.Lock()),
        type(threading.RLock()),
        threading.Condition,
        threading.Semaphore,
    )


def _module_level_locks() -> list[tuple[Any, str]]:
    """``(owner, name)`` of every lock held by a ctxkit module or class attribute."""
    found = []
    for info in pkgutil.walk_packages(ck.__path__, "ctxkit."):
        try:
            mod = importlib.import_module(info.name)
        except ImportError:
            continue
        for owner in [mod, *(v for v in vars(mod).values() if isinstance(v, type))]:
            if isinstance(owner, type) and owner.__module__ != mod.__name__:
                continue
            for name, value in list(vars(owner).items()):
                if isinstance(value, _lock_types()):
                    found.append((owner, name))
    return found


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_every_module_and_class_level_lock_is_renewed_in_a_forked_child(hold):
    locks = _module_level_locks()
    names = {f"{getattr(o, '__module__', o.__name__)}.{o.__name__}.{n}" for o, n in locks}
    assert any("_driver" in n and "_init_lock" in n for n in names), names
    assert len(locks) >= 15, names
    hold(*(getattr(owner, name) for owner, name in locks))

    def child() -> str:
        stuck = []
        for owner, name in locks:
            lock = getattr(owner, name)
            if not lock.acquire(blocking=False):
                stuck.append(f"{owner.__name__}.{name}")
            else:
                lock.release()
        return " ".join(stuck) or "none"

    assert in_child(child) == "none"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_child_forked_during_cuda_initialisation_is_a_forked_child(hold, monkeypatch):
    monkeypatch.setattr(_driver, "_init_pid", None)
    monkeypatch.setattr(_driver, "_parent_initialized_pid", None)
    monkeypatch.setattr(_driver, "_no_device", False)  # a machine whose driver sees none
    hold(_driver._init_lock)  # cuInit under way in another thread

    def child() -> str:
        return outcomes({"init": _driver.init})

    assert in_child(child) == "init=ForkError"
