"""scripts/exit_safety.py's Ledger on the fake driver of tests/support/fakemem.py:
it sees every
allocation and free ctxkit makes (also frees from a thread with no context and from a
thread's teardown), and reports handles never freed, failed frees, frees in the wrong
context or thread, and allocation calls it never saw. The wrong_thread_free scenario
relies on it instead of device-wide free memory."""

from __future__ import annotations

import gc
import itertools
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import _driver
from ctxkit.memory import DeviceBuffer, ManagedBuffer
from ctxkit.stream import Event, Stream
from tests.support.fakedriver import FakeHandle
from tests.support.fakemem import ctx0, ctx1, fake, in_thread  # noqa: F401
from tests.support.helpers import load_file_module

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "exit_safety.py"
MADE = {"cuMemAlloc", "cuStreamCreateWithPriority", "cuEventCreate"}


@pytest.fixture(scope="module")
def es() -> ModuleType:
    return load_file_module(SCRIPT, "exit_safety_under_test", register=True)


class ModuleAndGraphCalls:
    """The module and graph calls the Ledger wraps, which the memory fake lacks."""

    def __init__(self) -> None:
        self.ids = itertools.count(0x9000, 0x10)
        self.unloaded: list[int] = []

    def cuModuleLoadDataEx(self, image: Any, n: int, keys: Any, vals: Any) -> tuple[int, Any]:
        return (0, FakeHandle(next(self.ids)))

    def cuModuleUnload(self, mod: Any) -> tuple[int]:
        self.unloaded.append(int(mod))
        return (0,)

    def cuGraphInstantiate(self, graph: Any, flags: int) -> tuple[int, Any]:
        return (0, FakeHandle(next(self.ids)))

    def cuGraphExecDestroy(self, exec_: Any) -> tuple[int]:
        return (0,)

    def cuGraphCreate(self, flags: int) -> tuple[int, Any]:
        return (0, FakeHandle(next(self.ids)))

    def cuGraphClone(self, graph: Any) -> tuple[int, Any]:
        return (0, FakeHandle(next(self.ids)))

    def cuStreamEndCapture(self, stream: Any) -> tuple[int, Any]:
        return (0, FakeHandle(next(self.ids)))

    def cuGraphDestroy(self, graph: Any) -> tuple[int]:
        return (0,)


@pytest.fixture
def env(fake: Any, ctx0: Any, ctx1: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The memory fake plus module/graph calls, and a context on each fake device."""
    extra = ModuleAndGraphCalls()
    for name in (
        "cuModuleLoadDataEx",
        "cuModuleUnload",
        "cuGraphInstantiate",
        "cuGraphExecDestroy",
        "cuGraphCreate",
        "cuGraphClone",
        "cuStreamEndCapture",
        "cuGraphDestroy",
    ):
        monkeypatch.setattr(fake, name, getattr(extra, name), raising=False)
    return SimpleNamespace(drv=fake, c0=ctx0, c1=ctx1)


@pytest.fixture
def ledger(es: ModuleType, env: Any) -> Any:
    led = es.Ledger(_driver.drv).install()
    yield led
    led.uninstall()


def make_in(ctx: Any) -> list[Any]:
    with ctx:
        return [DeviceBuffer(64), Stream(), Event()]


def test_frees_from_a_thread_without_context_are_clean(ledger, env):
    ledger.phase = "dropped"
    made = make_in(env.c0) + make_in(env.c1)

    def drop() -> None:
        made.clear()
        gc.collect()

    t = threading.Thread(target=drop, name="dropper")
    t.start()
    t.join()
    assert ledger.problems("dropped", [env.c0, env.c1], MADE, thread="dropper") == []
    assert len(ledger.done) == 6 and not ledger.live
    assert {h.freed[1] for h in ledger.done} == {"dropper"}
    assert {(h.context, h.freed[0]) for h in ledger.done} == {
        (env.c0.handle, env.c0.handle),
        (env.c1.handle, env.c1.handle),
    }


def test_thread_locals_are_freed_in_their_context_at_thread_exit(ledger, env):
    ledger.phase = "thread-local"

    def owner(ctx: Any) -> None:
        local = threading.local()
        with ck.bind(ctx):
            local.buf = DeviceBuffer(64)
            local.stream = Stream()

    for ctx in (env.c0, env.c1):
        t = threading.Thread(target=owner, args=(ctx,))
        t.start()
        t.join()
    gc.collect()
    calls = {"cuMemAlloc", "cuStreamCreateWithPriority"}
    assert ledger.problems("thread-local", [env.c0, env.c1], calls) == []
    assert len(ledger.done) == 4


def test_a_handle_kept_alive_is_reported(ledger, env):
    ledger.phase = "leak"
    kept = make_in(env.c0)
    gc.collect()
    problems = ledger.problems("leak", [env.c0], MADE)
    assert len(problems) == 3
    assert all("was never freed" in p for p in problems)
    assert any(f"cuMemAlloc handle {kept[0].ptr:#x}" in p for p in problems)


def test_a_free_in_the_wrong_context_and_its_error_are_reported(ledger, env):
    ledger.phase = "wrong"
    with env.c1:
        buf = DeviceBuffer(64)
    with env.c0:
        _driver.drv.cuMemFree(buf.ptr)  # the fake refuses: INVALID_CONTEXT
    problems = ledger.problems("wrong", [env.c1], {"cuMemAlloc"})
    assert any("free failed with CUresult 201" in p for p in problems), problems
    assert any(f"freed with context {env.c0.handle:#x} current" in p for p in problems), problems
    buf.close()
    assert not env.drv.allocs


def test_a_free_in_another_thread_than_expected_is_reported(ledger, env):
    ledger.phase = "thread"
    made = make_in(env.c0)
    in_thread(lambda: (made.clear(), gc.collect()))
    problems = ledger.problems("thread", [env.c0], MADE, thread="MainThread")
    assert len(problems) == 3 and all("not 'MainThread'" in p for p in problems)


def test_calls_it_never_saw_are_reported(ledger, env):
    ledger.phase = "partial"
    with env.c0:
        managed = ManagedBuffer(64)
        managed.as_numpy(np.uint8)[:] = 1
    managed.close()
    problems = ledger.problems("partial", [env.c0, env.c1], {"cuMemAllocManaged", "cuEventCreate"})
    assert sorted(problems) == sorted(
        [
            f"partial: no cuEventCreate in context {env.c0.handle:#x} was seen (the ledger "
            "missed it)",
            f"partial: no cuEventCreate in context {env.c1.handle:#x} was seen (the ledger "
            "missed it)",
            f"partial: no cuMemAllocManaged in context {env.c1.handle:#x} was seen (the ledger "
            "missed it)",
        ]
    )


def test_phases_are_kept_apart(ledger, env):
    ledger.phase = "first"
    first = make_in(env.c0)
    ledger.phase = "second"
    second = make_in(env.c0)
    del first
    gc.collect()
    assert ledger.problems("first", [env.c0], MADE) == []
    assert len(ledger.problems("second", [env.c0], MADE)) == 3
    del second


def test_module_and_graph_handles_are_paired(ledger, env):
    ledger.phase = "raw"
    with env.c0:
        mod = env.drv.cuModuleLoadDataEx(b"", 0, [], [])[1]
        exe = env.drv.cuGraphInstantiate(object(), 0)[1]
        env.drv.cuModuleUnload(mod)
    calls = {"cuModuleLoadDataEx", "cuGraphInstantiate"}
    assert ledger.problems("raw", [env.c0], calls) == [
        f"raw: cuGraphInstantiate handle {int(exe):#x} of context {env.c0.handle:#x} was "
        "never freed"
    ]
    with env.c0:
        env.drv.cuGraphExecDestroy(exe)
    assert ledger.problems("raw", [env.c0], calls) == []


def test_uninstall_restores_the_driver_functions(es, env):
    drv = env.drv
    before = {name: getattr(drv, name) for pair in es.Ledger.PAIRS.items() for name in pair}
    led = es.Ledger(drv).install()
    assert all(getattr(drv, name).__wrapped__ == fn for name, fn in before.items())
    assert drv.cuMemFree.__name__ == "cuMemFree"
    led.uninstall()
    assert all(getattr(drv, name) == fn for name, fn in before.items())
