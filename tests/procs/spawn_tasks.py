"""What ``run_per_device``'s children run in tests/procs/test_spawn.py (module level, so
pickled by reference: each child imports this module, which imports no pytest)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import ctxkit.procs as procs
from ctxkit.errors import CudaError
from ctxkit.procs import wire


def report(ordinal, scale=1, *, offset=0):
    time.sleep(0.3 if ordinal == 2 else 0.0)  # device 2 finishes last
    return ordinal * scale + offset, os.getpid(), procs.worker_device()


def fail_on_one(ordinal):
    if ordinal == 1:
        raise ValueError(f"bad input on device {ordinal}")
    return ordinal


def mixed_failures(ordinal):
    if ordinal == 1:
        raise KeyError("missing")
    if ordinal == 2:
        os._exit(3)
    return ordinal


def exit_with(ordinal, code):
    if ordinal == 1:
        os._exit(code)
    return ordinal


def kill_self(ordinal, sig=signal.SIGKILL):
    if ordinal == 0:
        os.kill(os.getpid(), sig)
    return ordinal


def sleep_forever(ordinal):
    time.sleep(600)


def fail_first_attempt(ordinal, marker_dir, how):
    marker = Path(marker_dir, f"attempt-{ordinal}")
    n = int(marker.read_text()) if marker.exists() else 0
    marker.write_text(str(n + 1))
    if n == 0:
        if how == "crash":
            os._exit(7)
        raise RuntimeError("first attempt fails")
    return ordinal, n + 1


def always_fails(ordinal):
    raise RuntimeError(f"never works on {ordinal}")


def return_unpicklable(ordinal):
    return threading.Lock()


def big_result(ordinal, n):
    return np.full(n, ordinal, dtype=np.float32)


def big_result_without_room(ordinal, n):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    os.posix_fallocate = no_room  # this child's /dev/shm is "full"
    a = np.full(n, ordinal, dtype=np.float32)
    return a


def visible_devices(ordinal):
    return ordinal, os.environ.get("CUDA_VISIBLE_DEVICES")


def exit_via_sys_exit(ordinal):
    sys.exit(f"leaving from {ordinal}")


def raise_cuda_error(ordinal):
    raise CudaError("launch failed on purpose", 719, "CUDA_ERROR_LAUNCH_FAILED")


class StrRaises(Exception):
    def __str__(self):
        raise ValueError("no words for this")


def raise_str_raises(ordinal):
    raise StrRaises()


def die_while_sending(ordinal, n):
    """Leave a result block in /dev/shm, then die before the parent could receive it."""
    wire.encode(np.zeros(n), threshold=1)
    os.kill(os.getpid(), signal.SIGKILL)


def _refuse_outside_children():
    if procs.worker_device() is None:
        raise RuntimeError("this object only loads inside a ctxkit child")
    return "loaded"


class ChildOnly:
    def __reduce__(self):
        return (_refuse_outside_children, ())


def child_only_result(*_args):
    return ChildOnly()


def slow_on_one(ordinal):
    if ordinal == 1:
        time.sleep(600)
    return ordinal * 2
