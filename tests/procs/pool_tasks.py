"""What ``DevicePool``'s workers run in tests/procs/test_pool.py and
tests/procs/test_pool_devmem_fake.py (module level, so pickled by reference: each worker
imports this module, which imports no pytest)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import ctxkit.procs as procs
from ctxkit.errors import ContextPoisonedError
from ctxkit.procs import wire
from tests.procs.proctools import gate_open, transport
from tests.procs.spawn_tasks import StrRaises

MiB = 1 << 20


def echo(x):
    return x


def add(a, b):
    return a + b


def call(f, *args):
    return f(*args)


def device_and_pid(delay=0.0):
    time.sleep(delay)
    return procs.worker_device(), os.getpid()


def wait_for_gate(gate, value=None):
    gate_open(gate)
    return procs.worker_device(), value


def transports(*arrays):
    return [transport(a) for a in arrays], [float(a.sum()) for a in arrays]


def takes_device(x, device=None):
    return x, device


def takes_anything(**kwargs):
    return sorted(kwargs.items())


def poison():
    raise ContextPoisonedError("fake fault", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")


def crash_task():
    os._exit(5)


def kill_self(sig):
    os.kill(os.getpid(), sig)


def raise_str_raises():
    raise StrRaises()


def sleep_forever():
    time.sleep(600)


def ignore_term_and_sleep():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def leave_a_block_and(how):
    """Put a result block in /dev/shm, then die or hang before it is sent."""
    wire.encode(np.zeros(MiB // 8), threshold=1)
    if how == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def ones_without_room(n):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    os.posix_fallocate = no_room  # this worker's /dev/shm is "full" from now on
    return np.ones(n)


def sleep_and_record(seconds, pid_dir):
    Path(pid_dir, "running.pid").write_text(str(os.getpid()))
    time.sleep(seconds)


def failing_initializer(msg):
    raise OSError(msg)


_initialised: list[str] = []


def remember(tag):
    _initialised.append(tag)


def initialised():
    return list(_initialised)


def exit_at_start(code):
    os._exit(code)


def where_am_i(*args: Any) -> int | None:
    return procs.worker_device()
