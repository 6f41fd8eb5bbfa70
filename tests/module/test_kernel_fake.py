"""Kernel.preload and cuFuncLoad on CPU (the module-layer fake driver of
tests/module/test_module_fake.py): a kernel is loaded into a context when it is resolved there,
once, so a later launch never waits for CUDA's lazy loading."""

from __future__ import annotations

import gc

import pytest

import ctxkit as ck
from ctxkit import stream as stream_mod
from ctxkit.module import kernel as _kernel
from tests.module.test_module_fake import FakeBuffer, ModuleDriver, load
from tests.support.fakedriver import swap_driver


@pytest.fixture(name="fake")
def fake_fixture(fake_driver, monkeypatch: pytest.MonkeyPatch) -> ModuleDriver:
    """The module-layer fake of tests/module/test_module_fake.py in every module that calls it."""
    gc.collect()
    drv = ModuleDriver(fake_driver)
    swap_driver(monkeypatch, drv)
    monkeypatch.setattr(stream_mod, "_foreign_stream_int", lambda s: s.handle)
    return drv


@pytest.fixture
def loads(fake: ModuleDriver, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Give the fake driver cuFuncLoad; returns its (function, current context) calls."""
    calls: list[tuple[int, int]] = []

    def cu_func_load(func):
        calls.append((int(func), fake.base.current()))
        return (0,)

    monkeypatch.setattr(fake, "cuFuncLoad", cu_func_load, raising=False)
    return calls


def test_preload_loads_once_per_context_before_any_launch(fake, loads):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    k.preload(c0)
    k.preload(c0)
    assert [ctx for _, ctx in loads] == [c0.handle]
    with c1:
        k.preload()  # the current context
        k.launch(1, 32, FakeBuffer(8), FakeBuffer(16), FakeBuffer(24), 4)
    assert [ctx for _, ctx in loads] == [c0.handle, c1.handle]
    assert fake.base.calls["cuKernelGetFunction"] == 2
    with c0:
        k.launch(1, 32, FakeBuffer(8), FakeBuffer(16), FakeBuffer(24), 4)
    assert len(loads) == 2  # the launch reused the loaded function


def test_first_launch_loads_the_function_too(fake, loads):
    k = load().function("saxpy")
    with ck.registry.context(0):
        k.launch(1, 32, 2.0, FakeBuffer(8), FakeBuffer(16), 4)
    assert len(loads) == 1 and loads[0][1] == ck.registry.context(0).handle


def test_preload_of_a_context_bound_module(fake, loads):
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    with c0:
        mod = load(context=c0)
        k = mod.function("vector_add")
    with c1:
        k.preload()  # the module's own context, bound for the call
    assert loads[-1][1] == c0.handle
    with pytest.raises(ck.CudaError, match="bound to"):
        k.preload(c1)


def test_preload_without_a_context_is_a_clear_error(fake, loads):
    k = load().function("vector_add")
    with pytest.raises(ck.NoCurrentContextError):
        k.preload()


def test_load_failure_names_cu_func_load(fake, monkeypatch):
    monkeypatch.setattr(fake, "cuFuncLoad", lambda func: (2,), raising=False)
    k = load().function("vector_add")
    with pytest.raises(ck.OutOfMemoryError, match=r"cuFuncLoad\('vector_add'\)"):
        k.preload(ck.registry.context(0))


def test_load_function_without_cu_func_load(fake, monkeypatch):
    assert _kernel.load_function(object()) == 0  # the fake predates cuFuncLoad

    def missing(func):
        raise RuntimeError('Function "cuFuncLoad" not found')

    monkeypatch.setattr(fake, "cuFuncLoad", missing, raising=False)
    assert _kernel.load_function(object()) == 0
    k = load().function("vector_add")
    k.preload(ck.registry.context(0))  # old driver: the launch will load it, as before
