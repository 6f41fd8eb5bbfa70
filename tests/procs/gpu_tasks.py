"""Device work the GPU process tests run in their children (nothing here touches CUDA at
import time: the spawned children import it before they bind a context)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

import ctxkit as ck
from ctxkit.procs import spawn

N = 1 << 20
SPIN_FOREVER = 1 << 62  # clock64 ticks: far longer than any timeout here


def kernel(file: str, name: str) -> ck.Kernel:
    obj = ck.compile(ck.kernel_source(file), name=file)
    return ck.Module.load(obj).function(name)


def scale(n: int, alpha: float, offset: float) -> np.ndarray:
    """``(arange(n) + offset) * alpha`` computed by the ``scale_f32`` kernel."""
    x = np.arange(n, dtype=np.float32) + np.float32(offset)
    d_in, d_out = ck.DeviceBuffer(x.nbytes), ck.DeviceBuffer(x.nbytes)
    grid = max(1, min(65535, (n + 255) // 256))
    d_in.copy_from_host(x)
    kernel("scale.cu", "scale_f32").launch(grid, 256, d_in, d_out, n, np.float32(alpha))
    return d_out.copy_to_host(np.empty_like(x))


def expected(n: int, alpha: float, offset: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) + np.float32(offset)) * np.float32(alpha)


def fault() -> None:
    """An illegal address in the current context (raises ContextPoisonedError)."""
    kernel("fault.cu", "fault").launch(1, 1, 0)
    ctx = ck.current_context()
    assert ctx is not None
    ctx.synchronize()


def spin_forever() -> None:
    """A kernel that never ends, then wait for it (the process must be stopped)."""
    kernel("spin.cu", "spin").launch(1, 1, SPIN_FOREVER, None)
    ctx = ck.current_context()
    assert ctx is not None
    ctx.synchronize()


def bound_ordinal() -> int:
    ctx = ck.current_context()
    assert ctx is not None, "no context is current in this worker"
    return ctx.device.ordinal


def lane_report(n: int, alpha: float) -> tuple[Any, bool, np.ndarray, int]:
    """In a lane's worker: the lane of its current context (as a parent would describe
    that context), whether the registry and ``ck.bind`` of its device give that context,
    a kernel's result computed in it, and the worker's pid."""
    ctx = ck.current_context()
    assert ctx is not None, "no context is current in this worker"
    ordinal = ctx.device.ordinal
    with ck.bind(ordinal) as bound:
        same = bound is ctx and ck.registry.context(ordinal) is ctx
    return spawn.lane_spec(ctx, True), same, scale(n, alpha, 0), os.getpid()


def lane_report_child(ordinal: int, n: int, alpha: float) -> tuple[int, Any, bool, np.ndarray]:
    """:func:`lane_report` in a ``run_per_device`` child (which gets its ordinal)."""
    spec, same, y, _pid = lane_report(n, alpha)
    return ordinal, spec, same, y


def scale_in_place(buf: Any, n: int, alpha: float) -> tuple[str, int]:
    """``buf *= alpha`` (float32, the ``scale_f32`` kernel) in the worker's current context;
    returns that context's kind and SM count."""
    ctx = ck.current_context()
    assert ctx is not None
    grid = max(1, min(65535, (n + 255) // 256))
    kernel("scale.cu", "scale_f32").launch(grid, 256, buf, buf, n, np.float32(alpha))
    return ctx.kind, ctx.sm_count


# --- run_per_device children (tests/procs/test_spawn_gpu.py) ---------------------------


def scale_on_device(ordinal: int, n: int, alpha: float) -> tuple[str, int, np.ndarray, int]:
    ctx = ck.current_context()
    assert ctx is not None, "run_per_device did not bind a context"
    return ctx.device.pci_bus_id, ctx.device.ordinal, scale(n, alpha, ordinal), os.getpid()


def what_the_child_sees(ordinal: int) -> tuple[int, str | None, str, int]:
    ctx = ck.current_context()
    assert ctx is not None
    return ck.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"), ctx.device.pci_bus_id, ordinal


def fault_on(ordinal: int, bad: int, n: int) -> np.ndarray:
    if ordinal == bad:
        fault()
    return scale(n, 2.0, ordinal)


def fault_first_attempt(ordinal: int, marker_dir: str, n: int) -> np.ndarray:
    marker = Path(marker_dir, f"faulted-{ordinal}")
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        fault()
    return scale(n, 2.0, ordinal)


def spin_on(ordinal: int, slow: int, pid_dir: str) -> int:
    Path(pid_dir, f"{ordinal}.pid").write_text(str(os.getpid()))
    if ordinal == slow:
        spin_forever()
    return ordinal


# --- DevicePool workers (tests/procs/test_pool_gpu.py) -----------------------------------


_pool_kernel: list[ck.Kernel] = []


def pool_init() -> None:
    _pool_kernel.append(kernel("scale.cu", "scale_f32"))


def pool_scale(x: np.ndarray, alpha: float) -> tuple[int, np.ndarray, int]:
    ctx = ck.current_context()
    assert ctx is not None and _pool_kernel
    d_in, d_out = ck.DeviceBuffer(x.nbytes), ck.DeviceBuffer(x.nbytes)
    d_in.copy_from_host(x)
    grid = max(1, min(65535, (x.size + 255) // 256))
    _pool_kernel[0].launch(grid, 256, d_in, d_out, x.size, np.float32(alpha))
    return ctx.device.ordinal, d_out.copy_to_host(np.empty_like(x)), os.getpid()
