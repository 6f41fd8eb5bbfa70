"""ck.LaunchQueue on a real device: launches that many threads hand one launching thread
all run, each thread's in its order on its stream, and a refused launch comes back to the
thread that submitted it."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.memory import to_device
from tests.support.helpers import in_threads

SOURCE = r"""
extern "C" __global__ void add_one(unsigned long long* counter) { atomicAdd(counter, 1ull); }

// the value of the last launch on the stream stays: issued in order, it is n - 1
extern "C" __global__ void set_slot(int* slots, int slot, int v) { slots[slot] = v; }
"""

THREADS = 4
PER_THREAD = 250


@pytest.fixture
def kernels(ctx0):
    with ctx0:
        module = ck.Module.load(ck.compile(SOURCE, name="launchqueue.cu"))
    return module.function("add_one"), module.function("set_slot")


def test_every_launch_of_every_thread_runs(ctx0, kernels):
    add_one, _ = kernels
    with ctx0:
        counter = to_device(np.zeros(1, np.uint64))
    with ck.LaunchQueue(ctx0) as q:

        def producer(_: int) -> None:
            with ck.bind(ctx0):
                s = ck.Stream()
                launch = add_one.prepare(1, 1, counter, stream=s)
                for _ in range(PER_THREAD):
                    q.submit(launch)
                q.flush()
                s.synchronize()
                s.close()

        in_threads(THREADS, producer)
    with ctx0:
        assert int(counter.to_host()[0]) == THREADS * PER_THREAD


def test_each_threads_launches_run_in_its_order_on_its_stream(ctx0, kernels):
    _, set_slot = kernels
    with ctx0:
        slots = to_device(np.full(THREADS, -1, np.int32))
    with ck.LaunchQueue(ctx0) as q:

        def producer(t: int) -> None:
            with ck.bind(ctx0):
                s = ck.Stream()
                for v in range(PER_THREAD):
                    q.submit(functools.partial(set_slot.launch, 1, 1, slots, t, v, stream=s))
                q.flush()
                s.synchronize()
                s.close()

        in_threads(THREADS, producer)
    with ctx0:
        assert slots.to_host().tolist() == [PER_THREAD - 1] * THREADS


def test_a_refused_launch_comes_back_to_its_thread(ctx0, kernels):
    add_one, _ = kernels
    with ctx0:
        counter = to_device(np.zeros(1, np.uint64))
    with ck.LaunchQueue(ctx0) as q:
        q.submit(functools.partial(add_one.launch, 1, 1 << 20, counter))  # block too large
        with pytest.raises(ck.LaunchQueueError) as info:
            q.flush()
    assert isinstance(info.value.__cause__, (ck.CudaError, ValueError))
    with ctx0:
        assert int(counter.to_host()[0]) == 0  # the context is fine, nothing ran
