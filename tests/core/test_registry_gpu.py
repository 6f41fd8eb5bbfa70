"""The registry on real devices: executors, bind in thread pools, stress, cross-thread frees."""

from __future__ import annotations

import gc
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.context import Context, thread_state
from tests.support.helpers import is_allocated, raw_current


def _roundtrip(i: int) -> bool:
    x = np.arange(i % 97 + 1, dtype=np.float32) * i
    buf = ck.DeviceBuffer(x.nbytes)
    try:
        buf.copy_from_host(x)
        return bool(np.array_equal(buf.copy_to_host(np.empty_like(x)), x))
    finally:
        buf.close()


def test_executor_1000_tasks_16_workers(ctx0):
    before = raw_current()
    with ck.ContextExecutor(ctx0, max_workers=16) as ex:
        futs = [ex.submit(lambda i=i: (raw_current(), _roundtrip(i))) for i in range(1000)]
        results = [f.result() for f in futs]
    assert all(cur == ctx0.handle and ok for cur, ok in results)
    assert raw_current() == before


def test_thread_pool_with_bind_and_alternating_devices():
    n = min(2, ck.device_count())
    ctxs = [ck.registry.context(i) for i in range(n)]

    def task(i: int) -> bool:
        with ck.bind(i % n) as ctx:
            ok = raw_current() == ctxs[i % n].handle and ctx is ctxs[i % n]
            return ok and _roundtrip(i)

    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(task, range(400)))


def test_raw_thread_without_binding_gets_typed_error(ctx0):
    out: dict[str, object] = {}

    def worker() -> None:
        err, _ptr = drv.cuMemAlloc(256)
        out["raw"] = int(err)
        try:
            ck.DeviceBuffer(256)
        except ck.NoCurrentContextError as exc:
            out["exc"] = exc

    t = threading.Thread(target=worker, name="flask-handler-7")
    t.start()
    t.join()
    assert out["raw"] == 201  # what the driver says: CUDA_ERROR_INVALID_CONTEXT
    msg = str(out["exc"])
    assert "flask-handler-7" in msg and "ctxkit.bind" in msg and "device 0" in msg


@pytest.mark.multigpu
def test_stress_32_threads_random_nested_binds(ctx0, ctx1):
    owned = Context.create(0)
    pool = [ctx0, ctx1, owned]
    mismatches: list[str] = []
    leftovers: list[str] = []

    def walk(seed: int) -> None:
        rng = random.Random(seed)
        stack: list[Context] = []
        for _ in range(2000):
            if stack and (rng.random() < 0.5 or len(stack) > 6):
                stack.pop().__exit__(None, None, None)
            else:
                c = rng.choice(pool)
                with_bind = rng.random() < 0.5
                (ck.bind(c) if with_bind else c).__enter__()
                stack.append(c)
            want = stack[-1].handle if stack else 0
            got = raw_current()
            if got != want:
                mismatches.append(f"seed {seed}: driver {got:#x} != expected {want:#x}")
        while stack:
            stack.pop().__exit__(None, None, None)
        if raw_current() != 0 or thread_state().stack:
            leftovers.append(f"seed {seed}")

    try:
        threads = [threading.Thread(target=walk, args=(s,)) for s in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        owned.close()
    assert mismatches == []
    assert leftovers == []


def test_buffer_and_stream_dropped_in_thread_without_context(ctx0):
    """Asked of the buffer itself, not the device's free memory (other processes of the
    test run use the GPU meanwhile)."""
    nbytes = 256 << 20
    gc.collect()
    failed = len(ck.lifetime.failed_frees())
    with ctx0:
        holder = {"buf": ck.DeviceBuffer(nbytes), "stream": ck.Stream()}
        ptr = holder["buf"].ptr
        assert is_allocated(ptr)
    errors: list[BaseException] = []

    def drop() -> None:
        try:
            assert raw_current() == 0
            holder.clear()
            gc.collect()
            assert raw_current() == 0
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert errors == []
    assert len(ck.lifetime.failed_frees()) == failed
    with ctx0:
        assert not is_allocated(ptr)


def test_buffer_freed_in_its_own_context_while_another_is_current(ctx0):
    if ck.device_count() < 2:
        pytest.skip("needs two devices")
    ctx1 = ck.registry.context(1)
    with ctx0:
        buf = ck.DeviceBuffer(64 << 20)
        ptr = buf.ptr
    with ctx1:
        del buf
        gc.collect()
        assert raw_current() == ctx1.handle
    with ctx0:
        assert not is_allocated(ptr)
