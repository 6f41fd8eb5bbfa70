"""Numba shares ctxkit's primary context (README: "Primary contexts are shared with
PyTorch, CuPy and Numba"): one CUcontext, memory used by both without a copy, a Numba
kernel on a ctxkit stream, and a context Numba made current is ctxkit's primary one.
Skipped when numba-cuda is not installed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.memory import device_array, to_device
from tests.support.helpers import in_thread, raw_current

numba_cuda = pytest.importorskip("numba.cuda")

N = 10_007


def _handle(h: Any) -> int:
    """A Numba context handle as an int (ctypes ``c_void_p`` or cuda.bindings object)."""
    value = getattr(h, "value", None)
    return int(value if value is not None else h)


@pytest.fixture(autouse=True)
def _numba_leaves_nothing_current():
    """Numba pushes the primary context on first use and keeps it current in the thread
    (CUDA-runtime style): pop what it left so later tests start with nothing current."""
    yield
    while raw_current():
        (err, _) = drv.cuCtxPopCurrent()
        if err:
            break


def _handle(h: Any) -> int:
    """A Numba context handle as an int (ctypes ``c_void_p`` or cuda.bindings object)."""
    value = getattr(h, "value", None)
    return int(value if value is not None else h)


def test_numba_uses_ctxkits_primary_context(ctx0):
    assert ctx0.is_primary
    with ctx0:
        nctx = numba_cuda.current_context()
        assert _handle(nctx.handle) == ctx0.handle
        assert raw_current() == ctx0.handle  # the same CUcontext, not one of Numba's own


def test_memory_moves_between_numba_and_ctxkit_without_a_copy(ctx0):
    x = np.arange(N, dtype=np.float32)
    with ctx0:
        mine = to_device(x)
        view = numba_cuda.as_cuda_array(mine)
        assert view.__cuda_array_interface__["data"][0] == mine.ptr
        np.testing.assert_array_equal(view.copy_to_host(), x)
        theirs = numba_cuda.to_device(2 * x)
        back = device_array(N, np.float32)
        back.copy_from(theirs)
        np.testing.assert_array_equal(back.to_host(), 2 * x)


def test_a_numba_kernel_on_a_ctxkit_stream_writes_ctxkit_memory(ctx0):
    @numba_cuda.jit
    def double(a):
        i = numba_cuda.grid(1)
        if i < a.size:
            a[i] *= 2

    x = np.arange(N, dtype=np.float32)
    with ctx0:
        s = ck.Stream()
        mine = to_device(x)
        stream = numba_cuda.external_stream(s.ptr)
        try:
            double[(N + 255) // 256, 256, stream](numba_cuda.as_cuda_array(mine))
        except Exception as exc:
            text = f"{type(exc).__name__} {exc}"
            if "nvvm" in text.lower() or "row_stack" in text:  # no libNVVM / numba vs numpy 2
                pytest.skip(f"numba-cuda cannot compile kernels in this environment: {text}")
            raise
        s.synchronize()
        np.testing.assert_array_equal(mine.to_host(), 2 * x)


def test_the_context_numba_makes_current_is_ctxkits_primary(ctx0):
    def work() -> tuple[bool, np.ndarray, int]:
        numba_cuda.select_device(0)  # Numba pushes device 0's primary context
        same = ck.current_context() is ctx0
        arr = to_device(np.arange(8, dtype=np.float32))  # no bind: the current context
        host = arr.to_host()
        del arr
        err, popped = drv.cuCtxPopCurrent()
        assert not err
        return same, host, int(popped)

    same, host, popped = in_thread(work)
    assert same and popped == ctx0.handle
    np.testing.assert_array_equal(host, np.arange(8, dtype=np.float32))
