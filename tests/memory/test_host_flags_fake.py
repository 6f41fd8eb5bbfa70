"""Page-lock flags (pinned_empty / register_host), what host_memory_flags reports, device
pointers of pinned arrays, and pageable arrays as kernel arguments (HMM opt-in), against
the fake of tests/support/fakevmm.py. The GPU truth: tests/memory/test_host_flags_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import CudaError, LaunchArgumentError
from ctxkit.memory import host
from ctxkit.memory.host import (
    HostMemoryFlags,
    PageableArg,
    device_pointer,
    host_memory_flags,
    pageable_arg,
)
from ctxkit.module import params as pointers
from tests.support.fakevmm import A
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message

UVA_BIT = 1 << 46  # the fake's device addresses of pinned memory differ from the host's


def host_alloc_flags(fake) -> list[int]:
    return [d[1] for _c, _ctx, d in fake.log if _c == "hostalloc"]


def register_flags(fake) -> list[int]:
    return [d[2] for _c, _ctx, d in fake.log if _c == "register"]


@pytest.mark.parametrize(
    ("options", "bits"),
    [
        ({}, 1),
        ({"mapped": True}, 1 | 2),
        ({"write_combined": True}, 1 | 4),
        ({"portable": False}, 0),
        ({"portable": False, "mapped": True, "write_combined": True}, 2 | 4),
    ],
)
def test_pinned_empty_passes_the_flags_and_reports_them(vfake, vctx0, options, bits):
    with vctx0:
        arr = host.pinned_empty((4, 8), np.float32, **options)
    assert host_alloc_flags(vfake) == [bits]
    flags = host_memory_flags(arr)
    assert flags == HostMemoryFlags(
        "allocated",
        portable=options.get("portable", True),
        mapped=options.get("mapped", False),
        write_combined=options.get("write_combined", False),
        read_only=False,
        device_pointer=flags.device_pointer,
    )
    assert flags.pinned and host.is_pinned(arr)
    assert flags.device_pointer == arr.ctypes.data ^ UVA_BIT


def test_pinned_zeros_takes_the_same_flags(vfake, vctx0):
    arr = host.pinned_zeros(16, np.int32, context=vctx0, mapped=True)
    assert host_alloc_flags(vfake) == [1 | 2] and not arr.any()


def test_flags_must_be_bools(vfake, vctx0):
    with pytest.raises(TypeError, match="mapped must be True or False"):
        host.pinned_empty(4, context=vctx0, mapped=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="read_only"):
        with host.register_host(np.zeros(4), read_only="yes"):  # type: ignore[arg-type]
            pass
    assert not vfake.calls("hostalloc") and not vfake.calls("register")


def test_host_memory_flags_of_other_memory(vfake, vctx0):
    assert host_memory_flags(np.zeros(100)) == HostMemoryFlags("pageable")
    assert host_memory_flags(np.zeros(0)).kind == "pageable"
    assert not host_memory_flags(np.zeros(100)).pinned
    managed = ck.ManagedBuffer(4096, context=vctx0).as_numpy()
    assert host_memory_flags(managed).kind == "managed"


@pytest.mark.parametrize(
    ("options", "bits"),
    [({}, 1), ({"mapped": True}, 1 | 2), ({"read_only": True}, 1 | 8), ({"portable": False}, 0)],
)
def test_register_host_passes_and_records_the_flags(vfake, vctx0, options, bits):
    arr = np.zeros(8192, np.uint8)
    with host.register_host(arr, context=vctx0, **options) as a:
        assert register_flags(vfake) == [bits]
        flags = host_memory_flags(a)
        assert flags.kind == "registered"
        assert flags.mapped is options.get("mapped", False)
        assert flags.read_only is options.get("read_only", False)
        assert flags.portable is options.get("portable", True)
        assert flags.write_combined is False
        assert device_pointer(a) == a.ctypes.data ^ UVA_BIT
        assert device_pointer(a[100:]) == (a.ctypes.data + 100) ^ UVA_BIT
    assert host_memory_flags(arr).kind == "pageable"
    assert vfake.calls("unregister")


def test_memory_registered_by_someone_else_has_unknown_flags(vfake, vctx0):
    arr = np.zeros(4096, np.uint8)
    with vctx0:
        (err,) = vfake.cuMemHostRegister(arr.ctypes.data, arr.nbytes, 0)
    assert not err
    flags = host_memory_flags(arr)
    assert flags.kind == "registered" and flags.mapped is None and flags.portable is None


def test_read_only_register_needs_device_support(vfake, vctx0):
    vfake.attrs[A.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED] = 0
    with pytest.raises(CudaError, match="read-only") as info:
        with host.register_host(np.zeros(64), context=vctx0, read_only=True):
            pass
    assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
    assert not vfake.calls("register")


def test_registering_read_only_pages_says_to_pass_read_only(vfake, vctx0):
    arr = np.zeros(4096, np.uint8)
    arr.flags.writeable = False
    vfake.readonly_pages.add(arr.ctypes.data)
    with pytest.raises(CudaError, match="pass read_only=True"):
        with host.register_host(arr, context=vctx0):
            pass
    with host.register_host(arr, context=vctx0, read_only=True) as a:
        assert host_memory_flags(a).read_only is True


def test_device_pointer_of_pageable_memory_names_the_fix(vfake, vctx0):
    with pytest.raises(ValueError, match=r"pinned_empty\(\.\.\., mapped=True\)"):
        device_pointer(np.zeros(10))
    with pytest.raises(ValueError, match="pageable"):
        device_pointer(np.zeros(0))
    pinned = host.pinned_empty(10, context=vctx0, mapped=True)
    assert device_pointer(pinned) == pinned.ctypes.data ^ UVA_BIT


# --- pageable arrays as kernel arguments ------------------------------------------------


def hmm(fake, on: bool) -> None:
    fake.attrs[A.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS] = int(on)


def test_pageable_arrays_are_refused_unless_allowed(vfake, vctx0):
    hmm(vfake, True)
    arr = np.zeros(16, np.float32)
    with vctx0:
        with pytest.raises(LaunchArgumentError, match="pageable host memory"):
            pointers.device_pointer(arr)
        host.allow_pageable_kernel_args(True)
        assert host.pageable_kernel_args_allowed()
        assert pointers.device_pointer(arr) == arr.ctypes.data
        host.allow_pageable_kernel_args(False)
        with pytest.raises(LaunchArgumentError):
            pointers.device_pointer(arr)


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_arrays_of_python_objects_are_never_kernel_arguments(vfake, vctx0, dtype):
    hmm(vfake, True)
    arr = object_array(dtype, 64)
    host.allow_pageable_kernel_args(True)
    try:
        with vctx0, pytest.raises(TypeError, match=object_dtype_message(dtype)):
            pointers.device_pointer(arr)
    finally:
        host.allow_pageable_kernel_args(False)
    with pytest.raises(TypeError, match=object_dtype_message(dtype)):
        pageable_arg(arr)


def test_allowed_pageable_arrays_are_still_refused_where_the_device_cannot(vfake, vctx0, vctx1):
    host.allow_pageable_kernel_args(True)
    arr = np.zeros(16, np.float32)
    with vctx0:
        with pytest.raises(LaunchArgumentError, match="pageable host memory"):
            pointers.device_pointer(arr)
    assert not host.pageable_memory_access(0) and not host.pageable_memory_access(vctx1)
    pinned = host.pinned_empty(16, context=vctx0)
    with vctx0:
        assert pointers.device_pointer(pinned) == pinned.ctypes.data ^ UVA_BIT


def test_pageable_memory_access_is_per_device_and_needs_a_context_without_one(vfake):
    with pytest.raises(ck.NoCurrentContextError):
        host.pageable_memory_access()
    hmm(vfake, True)
    with ck.bind(1):
        assert host.pageable_memory_access()


def test_pageable_arg_opts_in_for_one_argument(vfake, vctx0):
    arr = np.arange(16, dtype=np.float32)
    arg = pageable_arg(arr)
    assert isinstance(arg, PageableArg) and "PageableArg" in repr(arg)
    with vctx0:
        with pytest.raises(LaunchArgumentError, match="PAGEABLE_MEMORY_ACCESS is 0"):
            pointers.device_pointer(arg)
    hmm(vfake, True)
    host._pageable_access.clear()
    with vctx0:
        assert pointers.device_pointer(arg) == arr.ctypes.data
        assert not host.pageable_kernel_args_allowed()  # nothing process-wide changed
        pinned = host.pinned_empty(16, context=vctx0)
        assert pointers.device_pointer(pageable_arg(pinned)) == pinned.ctypes.data ^ UVA_BIT
    with pytest.raises(ValueError, match="C-contiguous"):
        pageable_arg(np.zeros((4, 4))[:, 1])


@pytest.mark.parametrize(("value", "expected"), [("1", "True"), ("", "False"), ("0", "False")])
def test_pageable_kernel_args_from_the_environment(value, expected):
    env = {**os.environ, "CTXKIT_PAGEABLE_KERNEL_ARGS": value}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ctxkit.memory.host as h; print(h.pageable_kernel_args_allowed())",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == expected
