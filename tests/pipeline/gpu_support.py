"""Kernels and helpers shared by the pipeline GPU tests (test_*_gpu.py here)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit.memory.host import host_pointer_kind
from ctxkit.module import Module

SCALE = {np.float32: ("scale_f32", 2.0), np.float64: ("scale_f64", 2.0), np.int32: ("scale_i32", 3)}
SPIN_CYCLES = 4_000_000  # ~2 ms per kernel at H200 clocks
PATH_NAMES = {"staged": "in=staged, out=staged", "register": "in=registered, out=registered"}
PAGE = 4096


def load_kernels(file: str, arch: str) -> dict[str, ck.Kernel]:
    mod = Module.load(ck.compile(C.kernel_source(file), name=file, arch=arch))
    return {name: mod.function(name) for name in mod.entries or []}


@pytest.fixture(scope="module")
def kern() -> dict[str, ck.Kernel]:
    arch = ck.Device(0).arch
    out: dict[str, ck.Kernel] = {}
    for f in ("scale.cu", "spin.cu", "fill.cu"):
        out.update(load_kernels(f, arch))
    return out


def need_devices(n: int) -> list[int]:
    if ck.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices")
    return list(range(n))


#: The lane parameters of the multi-device tests that one GPU runs too: 2 and 3 green
#: partitions of device 0 (``lanes("green2")``).
GREEN_LANES = ["green2", "green3"]
_green: dict[int, list[ck.Context]] = {}


def lanes(ndev: int | str) -> list[int] | list[ck.Context]:
    """The pipeline devices of a test: the first *ndev* devices, or for ``"green<k>"``
    *k* green contexts splitting device 0 (made once per process and kept: equal shares
    in multiples of 8 SMs, the remainder last)."""
    if isinstance(ndev, int):
        return need_devices(ndev)
    k = int(ndev.removeprefix("green"))
    if k not in _green:
        share = ck.Device(0).multiprocessor_count // k // 8 * 8
        _green[k] = ck.Device(0).partition([share] * (k - 1))
        assert len(_green[k]) == k
    return _green[k]


def lane_count(ndev: int | str) -> int:
    return ndev if isinstance(ndev, int) else int(ndev.removeprefix("green"))


def random_array(n: int, dtype: type, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype is np.int32:
        return rng.integers(-1_000_000, 1_000_000, n, dtype=np.int32)
    return rng.standard_normal(n).astype(dtype)


def scaled(x: np.ndarray, alpha: float) -> np.ndarray:
    return x * x.dtype.type(alpha)


def spin_copy_body(kern: dict[str, ck.Kernel], cycles: int = SPIN_CYCLES):
    """A map body whose kernel busy-waits *cycles*, then copies its chunk (out = in)."""

    def body(ctx, stream, d_in, d_out, n):
        sms = ctx.sm_count  # a green lane's own SMs
        kern["spin_then_copy"].launch(sms, 256, cycles, d_in.ptr, d_out.ptr, n, stream=stream)

    return body


def assert_unregistered(*arrays: np.ndarray) -> None:
    """No page of the arrays is still page-locked (the registered path undid its work)."""
    for a in arrays:
        base = int(a.ctypes.data)
        for ptr in {base, base + a.nbytes // 2, base + max(a.nbytes - 1, 0)}:
            if a.nbytes:
                assert host_pointer_kind(ptr) == "pageable", (hex(ptr), a.nbytes)


def assert_held(*arrays: np.ndarray) -> None:
    """Pin on reuse holds the arrays as it should: every byte of them is page-locked (the
    registration starts at the first one), the byte before each array is not, unless
    it is one of *arrays* too (the neighbour sharing its first page stays pageable)."""
    spans = [(int(a.ctypes.data), int(a.ctypes.data) + a.nbytes) for a in arrays]
    for lo, hi in spans:
        for ptr in (lo, (lo + hi) // 2, hi - 1):
            assert host_pointer_kind(ptr) == "pinned", (hex(ptr), hex(lo), hi - lo)
        if not any(s <= lo - 1 < e for s, e in spans):
            assert host_pointer_kind(lo - 1) == "pageable", hex(lo)


def foreign_buffer(n: int, seed: int) -> tuple[bytearray, np.ndarray]:
    """*n* random float32 at element ``PAGE`` of a float32 view of a bytearray: a new
    array over the same bytes lands at the very address of a dead one (as numpy's
    allocator reuses freed memory)."""
    raw = bytearray((n + 2 * PAGE) * 4)
    over = np.frombuffer(raw, np.float32)
    over[PAGE : PAGE + n] = random_array(n, np.float32, seed)
    return raw, over


def seconds_of(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
