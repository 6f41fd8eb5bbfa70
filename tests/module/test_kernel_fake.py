"""Checked and prepared launches on CPU, against the module fake of tests/module/fakemodule.py:
context routing, argument packing, error mapping, preloading (``cuFuncLoad``: a kernel is
loaded into a context once, when it is resolved there, so a later launch never waits for
CUDA's lazy loading). Launch attributes and argument refusals: test_launch_fake.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.context import thread_state
from ctxkit.module import kernel as _kernel
from tests.module.fakemodule import (  # noqa: F401
    FakeBuffer,
    FakeStream,
    ModuleDriver,
    as_u64,
    fake,
    load,
)
from tests.support.helpers import in_thread


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


# --- launching (fake driver) ------------------------------------------------------------


def test_one_kernel_launches_in_each_context_with_a_cached_function(fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    a, b, c = FakeBuffer(0x1000), FakeBuffer(0x2000), FakeBuffer(0x3000)
    with c0:
        k.launch(4, 256, a, b, c, 1000)
        k.launch((4, 2), (32, 8), a, b, c, np.uint64(5))
    with c1:
        k.launch(1, 1, a, b, c, 3)
    assert fake.base.calls["cuKernelGetFunction"] == 2  # once per context
    l0, l1, l2 = fake.launches
    assert (l0["ctx"], l1["ctx"], l2["ctx"]) == (c0.handle, c0.handle, c1.handle)
    assert [as_u64(v) for v in l0["values"]] == [0x1000, 0x2000, 0x3000, 1000]
    assert (l0["grid"], l0["block"], l0["shm"], l0["stream"]) == ((4, 1, 1), (256, 1, 1), 0, 0)
    assert (l1["grid"], l1["block"]) == ((4, 2, 1), (32, 8, 1))
    assert as_u64(l1["values"][3]) == 5


def test_float_parameter_is_packed_as_f32(fake):
    k = load().function("saxpy")
    with ck.registry.context(0):
        k.launch(1, 32, 2.5, FakeBuffer(8), FakeBuffer(16), 4)
    vals = fake.launches[-1]["values"]
    assert np.frombuffer(vals[0], np.float32)[0] == 2.5
    assert [as_u64(v) for v in vals[1:]] == [8, 16, 4]


def test_no_current_context_in_a_worker_thread(fake):
    k = load().function("vector_add")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            k.launch(1, 1, 0, 0, 0, 0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker, name="no-ctx-worker")
    t.start()
    t.join()
    assert isinstance(errors[0], ck.NoCurrentContextError)
    assert "launching kernel 'vector_add'" in str(errors[0]) and "no-ctx-worker" in str(errors[0])
    assert fake.launches == []


def test_a_thread_with_nothing_current_binds_what_the_launch_uses(fake):
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    k = load(context=c0).function("vector_add")
    out: dict[str, Any] = {}

    def worker() -> None:
        k.launch(1, 1, 0, 0, 0, 0)  # the module's context
        k.launch(1, 1, 0, 0, 0, 0, stream=FakeStream(c0, 0x77))  # the stream's
        out["after"] = fake.base.current()
        fake.fail_next = 1  # CUDA_ERROR_INVALID_VALUE
        with pytest.raises(ck.CudaError):
            k.launch(1, 1, 0, 0, 0, 0)
        out["after_error"] = fake.base.current()
        out["stack"] = list(thread_state().stack)

    in_thread(worker)
    assert [(x["ctx"], x["stream"]) for x in fake.launches] == [(c0.handle, 0), (c0.handle, 0x77)]
    assert out == {"after": 0, "after_error": 0, "stack": []}  # bound for the launch only
    assert c1.handle not in [x["ctx"] for x in fake.launches]


def test_bad_arguments_never_reach_the_driver(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        with pytest.raises(ck.LaunchArgumentError, match=r"parameter 3 'n' \(.u64\)"):
            k.launch(1, 1, FakeBuffer(1), FakeBuffer(2), FakeBuffer(3), 2.5)
        with pytest.raises(ck.LaunchArgumentError, match="takes 4 arguments but 2"):
            k.launch(1, 1, FakeBuffer(1), FakeBuffer(2))
        with pytest.raises(ck.LaunchArgumentError, match="pageable host memory"):
            k.launch(1, 1, np.zeros(4), FakeBuffer(2), FakeBuffer(3), 4)
        with pytest.raises(ValueError, match="block dimensions must be positive"):
            k.launch(1, 0, FakeBuffer(1), FakeBuffer(2), FakeBuffer(3), 4)
        with pytest.raises(TypeError, match="grid must be an int or a tuple"):
            k.launch(1.5, 1, FakeBuffer(1), FakeBuffer(2), FakeBuffer(3), 4)  # type: ignore[arg-type]
    assert fake.launches == []


def test_launch_config_error_is_explained_with_limits(fake):
    k = load().function("vector_add")
    fake.attrs["MAX_THREADS_PER_BLOCK"] = 512
    with ck.registry.context(0), pytest.raises(ck.CudaError) as info:
        k.launch(1, 1024, 0, 0, 0, 0)
    msg = str(info.value)
    assert "CUDA_ERROR_INVALID_VALUE" in msg
    assert "1024 threads, more than this kernel's limit of 512" in msg
    assert not isinstance(info.value, ck.ContextPoisonedError)


def test_sticky_launch_error_poisons_the_context(fake):
    k = load().function("vector_add")
    ctx = ck.registry.context(0)
    fake.fail_next = 700
    with ctx, pytest.raises(ck.ContextPoisonedError, match="ILLEGAL_ADDRESS"):
        k.launch(1, 1, 0, 0, 0, 0)
    assert ctx.poisoned
    with pytest.raises(ck.ContextPoisonedError):
        ctx.check_usable()


def test_bound_module_refuses_other_contexts_naming_both(fake):
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    mod = load(context=c0)
    assert mod.context is c0 and fake.module_ctx == c0.handle
    ck.registry.strict = True  # strict mode: no implicit bind in a thread without a context
    with pytest.raises(ck.NoCurrentContextError, match="Module.function"):
        mod.function("vector_add")
    ck.registry.strict = False
    assert mod.function("vector_add").module is mod  # the module binds its own context
    with c1:
        k = mod.function("vector_add")  # looked up in the module's own context
    with c0:
        k.launch(1, 1, 0, 0, 0, 0)
    with c1, pytest.raises(ck.CudaError) as info:
        k.launch(1, 1, 0, 0, 0, 0)
    msg = str(info.value)
    assert repr(c0) in msg and repr(c1) in msg and "context=" in msg
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE"
    assert len(fake.launches) == 1
    mod.close()
    assert fake.unloaded == [int(mod._handle)]


def test_stream_of_another_context_is_refused(fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    with c0:
        k.launch(1, 1, 0, 0, 0, 0, stream=FakeStream(c0, 0x55))
        with pytest.raises(ck.CudaError, match="belongs to"):
            k.launch(1, 1, 0, 0, 0, 0, stream=FakeStream(c1))
    assert [launch["stream"] for launch in fake.launches] == [0x55]


def test_attributes_and_occupancy(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        attrs = k.attributes
        assert attrs["max_threads_per_block"] == 1024 and "num_regs" in attrs
        assert "max" not in attrs
        assert k.attribute("max_threads_per_block") == 1024
        k.set_attribute("max_dynamic_shared_size_bytes", 100_000)
        assert k.attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES") == 100_000
        assert k.max_block_size() == 768
        assert k.max_block_size(block_size_limit=256) == 256
        assert k.occupancy(256) == 8
        assert k.launch_config(10_000) == (14, 768)
        assert k.launch_config(0) == (1, 768)
    with pytest.raises(ck.NoCurrentContextError):
        k.max_block_size()


# --- PreparedLaunch (fake driver) -------------------------------------------------------


def test_prepared_launch_and_set_arg(fake):
    k = load().function("vector_add")
    ctx = ck.registry.context(0)
    a, b, c = FakeBuffer(0x10), FakeBuffer(0x20), FakeBuffer(0x30)
    with ctx:
        pl = k.prepare(2, 64, a, b, c, 100, stream=FakeStream(ctx, 0x99))
        pl()
        pl.set_arg(3, 50)
        pl.set_arg("c", FakeBuffer(0x40))
        pl()
        with pytest.raises(ck.LaunchArgumentError, match="parameter 3"):
            pl.set_arg("n", -1.5)
        with pytest.raises(KeyError, match="no parameter 'z'"):
            pl.set_arg("z", 1)
    first, second = fake.launches
    assert [as_u64(v) for v in first["values"]] == [0x10, 0x20, 0x30, 100]
    assert [as_u64(v) for v in second["values"]] == [0x10, 0x20, 0x40, 50]
    assert first["stream"] == 0x99 and first["grid"] == (2, 1, 1)
    assert pl.args[2].ptr == 0x40 and pl.context is ctx
    assert "vector_add" in repr(pl)


def test_prepared_launch_binds_its_context_or_needs_one(fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    with c0:
        pl = k.prepare(1, 1, 0, 0, 0, 0)
    with c1:
        pl()  # another context is current: the launch's own context is bound for it
    assert fake.launches[-1]["ctx"] == c0.handle
    assert fake.base.current() == 0
    pl()  # no context current: bound for the call too
    assert fake.launches[-1]["ctx"] == c0.handle and fake.base.current() == 0
    ck.registry.strict = True
    with pytest.raises(ck.NoCurrentContextError):
        pl()
    ck.registry.strict = False
    with pytest.raises(ValueError, match="shared_mem"):
        with c0:
            k.prepare(1, 1, 0, 0, 0, 0, shared_mem=-1)


def test_every_use_of_a_closed_module_says_it_is_closed(fake):
    mod = load()
    k = mod.function("vector_add")
    c0 = ck.registry.context(0)
    with c0:
        k.launch(1, 1, 0, 0, 0, 0)
    mod.close()
    with pytest.raises(ck.CudaError, match="is closed"):
        mod.function("vector_add")  # cached kernels are refused too
    with pytest.raises(ck.CudaError, match="is closed"):
        k.launch(1, 1, 0, 0, 0, 0)  # no context at all: still the closed module first
    fake.base.cuCtxPushCurrent(c0.cu)  # a raw push ctxkit does not know about
    try:
        with pytest.raises(ck.CudaError, match="is closed"):
            k.launch(1, 1, 0, 0, 0, 0)
    finally:
        fake.base.cuCtxPopCurrent()
    with c0:
        for use in (
            lambda: k.launch(1, 1, 0, 0, 0, 0),
            lambda: k.prepare(1, 1, 0, 0, 0, 0),
            lambda: k.attributes,
            lambda: k.max_block_size(),
        ):
            with pytest.raises(ck.CudaError, match="is closed"):
                use()
    assert len(fake.launches) == 1


def test_prepared_launch_of_a_closed_module_fails_clearly(fake):
    mod = load()
    k = mod.function("vector_add")
    with ck.registry.context(0):
        pl = k.prepare(1, 1, 0, 0, 0, 0)
        mod.close()
        with pytest.raises(ck.CudaError, match="is closed"):
            pl()
        with pytest.raises(ck.CudaError, match="is closed"):
            k.launch(1, 1, 0, 0, 0, 0)
    assert fake.launches == []
