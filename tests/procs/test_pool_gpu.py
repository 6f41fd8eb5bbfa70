"""``DevicePool`` on real devices: kernels in long-lived workers, a faulted worker replaced,
a worker stuck in a kernel stopped by the task's timeout, tasks sent by value.

The functions the workers run live in tests/procs/gpu_tasks.py and do not touch CUDA
at import time.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.procs import DevicePool, DeviceTaskError, TaskOptions
from tests.procs.gpu_tasks import (
    N,
    bound_ordinal,
    expected,
    fault,
    pool_init,
    pool_scale,
    scale,
    spin_forever,
)
from tests.procs.proctools import alive


def test_pool_runs_kernels_and_replaces_a_faulted_worker():
    devices = list(range(min(2, ck.device_count())))
    x = np.arange(N, dtype=np.float32)  # 4 MiB: through shared memory
    with DevicePool(devices, initializer=pool_init) as pool:
        futures = {d: pool.submit_to(d, pool_scale, x, 2.0) for d in devices}
        first_pid = {}
        for d, f in futures.items():
            ordinal, y, pid = f.result(120)
            assert ordinal == d
            np.testing.assert_array_equal(y, x * 2)
            first_pid[d] = pid
        err = pool.submit_to(devices[-1], fault).exception(120)
        assert isinstance(err, DeviceTaskError) and err.code == 700
        ordinal, y, pid = pool.submit_to(devices[-1], pool_scale, x, 3.0).result(120)
        assert ordinal == devices[-1] and pid != first_pid[devices[-1]]
        np.testing.assert_array_equal(y, x * 3)
        pids = [p for p in pool.pids.values() if p]
    assert not any(alive(p) for p in pids)


def test_pool_timeout_stops_a_worker_stuck_in_a_kernel():
    with DevicePool([0]) as pool:
        pid = pool.submit(os.getpid).result(120)
        stuck = pool.submit_to(TaskOptions(device=0, timeout=8), spin_forever)
        queued = pool.submit(scale, 1024, 2.0, 1)
        err = stuck.exception(120)
        assert isinstance(err, DeviceTaskError) and err.kind == "timeout"
        assert err.pid == pid and "did not finish within 8 s" in str(err)
        # the replacement worker has a healthy context on the same GPU
        np.testing.assert_array_equal(queued.result(120), expected(1024, 2.0, 1))
        assert pool.submit(os.getpid).result(120) != pid
    assert not alive(pid)


def test_pool_runs_a_lambda_with_the_context_bound():
    pytest.importorskip("cloudpickle")
    with DevicePool([0]) as pool:
        x = np.arange(N, dtype=np.float32)
        ordinal, total = pool.submit(lambda a: (bound_ordinal(), float(a.sum())), x).result(120)
        assert ordinal == 0 and total == float(x.sum())
        assert list(pool.map(lambda k: bound_ordinal() + k, range(3))) == [0, 1, 2]
