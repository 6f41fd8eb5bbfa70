"""Memory freed after ctxkit closed a primary context that another library keeps alive
(PyTorch, CuPy: the runtime never lets go of it): it is still the driver's, so it is freed
there. Page-locked pool pages unmapped under a registration that outlived ``close`` made
every later host allocation of the process there fail with ``CUDA_ERROR_ALREADY_MAPPED``
(``cuCtxCreate``, ``cuMemHostAlloc``, PyTorch's pinned tensors alike). Each case runs in
a child process: it closes and re-retains device 0's primary context."""

from __future__ import annotations

import pytest

from tests.support.helpers import run_python

pytestmark = pytest.mark.gpu

PRELUDE = """
import gc
import threading
import numpy as np
import ctxkit as ck
from cuda.bindings import driver as drv

N = 64 << 20
dev = ck.Device(0).handle
"""

CHECK = """
drv.cuCtxPushCurrent(other)
err, _flags = drv.cuMemHostGetFlags(ptr)
print("still registered:", err == drv.CUresult.CUDA_SUCCESS)
err, p = drv.cuMemHostAlloc(N, 0)
print("cuMemHostAlloc:", err.name)
if not err:
    drv.cuMemFreeHost(p)
print("Context.create:", ck.Context.create(0).handle != 0)
"""


def _python(code: str) -> str:
    res = run_python(code=code, CTXKIT_PINNED_ALLOC="register")
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


EXPECTED = "still registered: False\ncuMemHostAlloc: CUDA_SUCCESS\nContext.create: True\n"


def test_pinned_array_freed_after_closing_a_primary_another_library_holds():
    out = _python(
        PRELUDE
        + """
err, other = drv.cuDevicePrimaryCtxRetain(dev)  # what PyTorch's runtime holds
ctx = ck.Context.primary(0)
a = ck.pinned_empty(N, np.uint8, context=ctx)
a[:] = 1
ptr = a.ctypes.data
ctx.close()
del a
gc.collect()
"""
        + CHECK
    )
    assert out == EXPECTED


def test_pinned_array_freed_after_closing_a_primary_torch_holds():
    pytest.importorskip("torch")
    out = _python(
        PRELUDE
        + """
import torch
torch.zeros(1, device="cuda")  # torch's runtime retains the primary context
ctx = ck.Context.primary(0)
a = ck.pinned_empty(N, np.uint8, context=ctx)
ptr = a.ctypes.data
closer = threading.Thread(target=ctx.close)  # torch left it current in this thread
closer.start()
closer.join()
assert ctx.closed
del a
gc.collect()
err, other = drv.cuDevicePrimaryCtxRetain(dev)
"""
        + CHECK
        + """
pinned = torch.empty(N, dtype=torch.uint8, pin_memory=True)  # may land where `a` was
print("torch pinned:", pinned.is_pinned())
"""
    )
    assert out == EXPECTED + "torch pinned: True\n"


def test_closing_a_primary_another_library_holds_waits_for_queued_copies():
    """Release leaves the context alive, so close() waits for its work, as destroying a
    context does: the copy's results are in host memory when it returns."""
    out = _python(
        PRELUDE
        + """
from ctxkit.compiler import kernel_source
err, other = drv.cuDevicePrimaryCtxRetain(dev)  # what PyTorch's runtime holds
ctx = ck.Context.primary(0)
with ctx:
    spin = ck.Module.load(ck.compile(kernel_source("spin.cu"))).function("spin")
    s = ck.Stream()
    src = ck.to_device(np.full(1 << 20, 7, np.uint8))
    host = ck.pinned_empty(1 << 20, np.uint8, context=ctx)
    host[:] = 0
    spin.launch(1, 1, 400_000_000, 0, stream=s)  # ~0.2 s
    src.copy_to_host(host, stream=s)
ctx.close()
print("copied:", bool((host == 7).all()))
"""
    )
    assert out == "copied: True\n"
