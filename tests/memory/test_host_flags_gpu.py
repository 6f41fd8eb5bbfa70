"""Page-lock flags on the real driver: mapped pinned and registered memory written and read
by kernels in place (zero-copy), write-combined memory, read-only registration, what
host_memory_flags reports, and pageable arrays as kernel arguments where the device
accesses pageable memory (HMM/ATS) and refused where it does not."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.compiler import kernel_source
from ctxkit.errors import CudaError, LaunchArgumentError
from ctxkit.memory import host
from ctxkit.memory.host import device_pointer, host_memory_flags, pageable_arg


@pytest.fixture(scope="module")
def fill() -> Any:
    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("fill.cu"))).function("fill_f32")


@pytest.fixture(scope="module")
def vector_add() -> Any:
    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("vector_add.cu"))).function("vector_add")


def test_mapped_pinned_memory_is_written_by_a_kernel_in_place(ctx0, fill):
    with ctx0:
        h = ck.pinned_empty(1 << 20, np.float32, mapped=True)
        h[:] = 0
        flags = host_memory_flags(h)
        assert flags.kind == "allocated" and flags.pinned
        assert flags.mapped is True and flags.portable is True and flags.write_combined is False
        dptr = device_pointer(h)
        assert dptr and dptr == flags.device_pointer
        fill.launch(256, 256, dptr, np.float32(2.5), h.size)  # by its device address
        ctx0.synchronize()
        assert (h == 2.5).all()
        fill.launch(256, 256, h[1024:], np.float32(7.0), 1024)  # the array, at an offset
        ctx0.synchronize()
    assert (h[1024:2048] == 7.0).all()
    assert (h[:1024] == 2.5).all() and (h[2048:] == 2.5).all()


def test_write_combined_memory_feeds_copies(ctx0):
    with ctx0:
        h = ck.pinned_empty(1 << 16, np.uint8, write_combined=True)
        assert host_memory_flags(h).write_combined is True
        pattern = np.random.default_rng(0).integers(0, 256, h.size, dtype=np.uint8)
        h[:] = pattern  # the host only writes write-combined memory
        d = ck.DeviceBuffer(h.nbytes)
        s = ck.Stream()
        d.copy_from_host(h, stream=s)  # pinned: truly asynchronous, no warning
        s.synchronize()
        np.testing.assert_array_equal(d.copy_to_host(), pattern)


def test_not_portable_memory_is_still_pinned(ctx0):
    with ctx0:
        h = ck.pinned_empty(4096, np.uint8, portable=False)
    assert ck.is_pinned(h) and host_memory_flags(h).kind == "allocated"


def test_mapped_registered_memory_is_written_by_a_kernel_in_place(ctx0, fill):
    arr = np.zeros(1 << 20, np.float32)
    with ctx0:
        with ck.register_host(arr, mapped=True) as a:
            flags = host_memory_flags(a)
            assert flags.kind == "registered" and flags.mapped is True
            assert flags.read_only is False and flags.portable is True
            assert device_pointer(a) == flags.device_pointer
            fill.launch(256, 256, a, np.float32(3.0), a.size)
            ctx0.synchronize()
    assert (arr == 3.0).all()
    assert host_memory_flags(arr).kind == "pageable"


def test_read_only_registered_memory_is_read_by_a_kernel(ctx0, vector_add):
    n = 1 << 18
    src = np.arange(n, dtype=np.float32)
    with ctx0:
        if not ck.Device(0).attribute("read_only_host_register_supported"):
            with pytest.raises(CudaError, match="read-only") as info:
                with ck.register_host(src, read_only=True):
                    pass
            assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
            return
        with ck.register_host(src, read_only=True, mapped=True) as a:
            assert host_memory_flags(a).read_only is True
            out = ck.DeviceBuffer(src.nbytes)
            vector_add.launch(256, 256, a, a, out, n)
            ctx0.synchronize()
            np.testing.assert_array_equal(out.copy_to_host().view(np.float32), 2 * src)


def test_pageable_arrays_as_kernel_arguments(ctx0, fill):
    hmm = bool(ck.Device(0).attribute("pageable_memory_access"))
    assert host.pageable_memory_access(0) is hmm
    x = np.zeros(1 << 16, np.float32)
    before = host.pageable_kernel_args_allowed()
    with ctx0:
        with pytest.raises(LaunchArgumentError, match="pageable"):
            fill.launch(64, 256, x, np.float32(1.0), x.size)
        try:
            if not hmm:
                with pytest.raises(LaunchArgumentError, match="PAGEABLE_MEMORY_ACCESS is 0"):
                    fill.launch(64, 256, pageable_arg(x), np.float32(1.0), x.size)
                host.allow_pageable_kernel_args(True)
                with pytest.raises(LaunchArgumentError, match="pageable"):
                    fill.launch(64, 256, x, np.float32(1.0), x.size)
                assert (x == 0).all()
                return
            fill.launch(64, 256, pageable_arg(x), np.float32(1.5), x.size)
            ctx0.synchronize()
            assert (x == 1.5).all()  # written in place in pageable memory
            host.allow_pageable_kernel_args(True)
            fill.launch(64, 256, x[8:], np.float32(2.5), x.size - 8)
            ctx0.synchronize()
            assert (x[:8] == 1.5).all() and (x[8:] == 2.5).all()
        finally:
            host.allow_pageable_kernel_args(before)
