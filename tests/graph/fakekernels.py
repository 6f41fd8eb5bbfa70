"""Kernels for graph tests on the simulated GPU: their PTX signatures (what ctxkit checks
arguments against) and what each does there (numpy over the fake's device memory)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

import ctxkit as ck
from ctxkit.module import Module
from tests.support.fakegpu import FakeGPU

PTX = """.version 8.0
.target sm_90
.address_size 64

.visible .entry saxpy(.param .f32 a, .param .u64 x, .param .u64 y, .param .u64 n)
{
    ret;
}

.visible .entry affine(.param .u64 y, .param .f32 mul, .param .f32 add, .param .u64 n)
{
    ret;
}

.visible .entry countdown(.param .u64 handle, .param .u64 counter, .param .u64 trips)
{
    ret;
}

.visible .entry set_flag(.param .u64 handle, .param .u32 value)
{
    ret;
}
"""


def f32(ptr: int, n: int) -> np.ndarray:
    """*n* floats of fake device memory at *ptr*."""
    return np.frombuffer((ctypes.c_float * n).from_address(ptr), dtype=np.float32)


def i32(ptr: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_int32 * n).from_address(ptr), dtype=np.int32)


def install(gpu: FakeGPU) -> dict[str, ck.Kernel]:
    """Register the kernels' fake implementations; load the module in the current context."""

    def saxpy(grid: Any, block: Any, a: float, x: int, y: int, n: int) -> None:
        yv = f32(y, n)
        yv[:] = a * f32(x, n) + yv

    def affine(grid: Any, block: Any, y: int, mul: float, add: float, n: int) -> None:
        yv = f32(y, n)
        yv[:] = yv * mul + add

    def countdown(grid: Any, block: Any, handle: int, counter: int, trips: int) -> None:
        c, t = i32(counter, 1), i32(trips, 1)
        c[0] -= 1
        t[0] += 1
        gpu.set_conditional(handle, int(c[0] > 0))

    def set_flag(grid: Any, block: Any, handle: int, value: int) -> None:
        gpu.set_conditional(handle, value)

    gpu.kernel_impl("saxpy", ("f", "Q", "Q", "Q"), saxpy)
    gpu.kernel_impl("affine", ("Q", "f", "f", "Q"), affine)
    gpu.kernel_impl("countdown", ("Q", "Q", "Q"), countdown)
    gpu.kernel_impl("set_flag", ("Q", "I"), set_flag)
    mod = Module.load(PTX)
    return {name: mod.function(name) for name in ("saxpy", "affine", "countdown", "set_flag")}
