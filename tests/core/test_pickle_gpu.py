"""Pickling and copying ctxkit objects on a real GPU: cuda.bindings' handles refuse
pickling with "no default __reduce__ due to non-trivial __cinit__"; ctxkit's objects say
instead what to send, and device memory is copied on the device by ``copy.deepcopy``."""

from __future__ import annotations

import copy
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.compiler import kernel_source

N = 1 << 20


@pytest.fixture
def fill(ctx0: ck.Context) -> ck.Kernel:
    with ctx0:
        return ck.Module.load(ck.compile(kernel_source("fill.cu"))).function("fill_f32")


def test_handles_refuse_pickling_naming_the_fix(ctx0, fill):
    with ctx0:
        objects = [ctx0, ck.Stream(), ck.Event(), fill.module, fill, ck.to_device(np.ones(4))]
        for obj in objects:
            for dump in (pickle.dumps, ForkingPickler.dumps, copy.copy):
                if isinstance(obj, ck.DeviceArray) and dump is copy.copy:
                    continue
                with pytest.raises(TypeError, match="cannot be pickled") as info:
                    dump(obj)
                assert "valid only in this process" in str(info.value), obj
                assert "__cinit__" not in str(info.value)


def test_deepcopy_of_an_array_copies_it_on_the_device(ctx0, fill):
    with ctx0:
        s = ck.Stream()
        a = ck.device_array(N, np.float32)
        fill.launch(N // 256, 256, a, np.float32(2.5), N, stream=s)
        s.synchronize()  # a copy without stream= runs on the legacy stream, as copy_from does
        dup = copy.deepcopy(a)
        assert dup.ptr != a.ptr and dup.context is ctx0
        a.memset(0)
        host = dup.to_host()
        assert host.shape == (N,) and (host == 2.5).all()
        buf = copy.copy(a.buffer[: 4 * 16])
        assert buf.nbytes == 64 and not buf.copy_to_host().any()
