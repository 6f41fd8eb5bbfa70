"""Pinned memory of scripts/sanitizer_workload.py is freed when its functions return.

compute-sanitizer's leak check reported the ``pinned_empty`` arrays of ``per_device`` and
``threads_and_pipeline`` as allocated at exit, while the same sequence on the CPU fake
(tests/memory/test_host_lifetime_fake.py) frees them. These tests tell the two possible causes
apart on the real driver: the HostMemory still referenced (the message names its
referrers), or a ``cuMemFreeHost`` the driver refused (``ctxkit.lifetime.failed_frees``),
or neither but the driver still knowing the pointer.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import lifetime
from ctxkit._driver import drv
from ctxkit.memory import host as _hostmem
from tests.support.helpers import load_file_module

ROOT = Path(__file__).resolve().parents[2]
INVALID_VALUE = 1


def _workload() -> Any:
    return load_file_module(ROOT / "scripts" / "sanitizer_workload.py", "sanitizer_workload_gpu")


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[weakref.ref[Any], int]]:
    """(weak reference, pointer) of every HostMemory ``pinned_empty`` creates from now."""
    made: list[tuple[weakref.ref[Any], int]] = []
    original = _hostmem.HostMemory.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        if self.owner is None:
            made.append((weakref.ref(self), self.ptr))

    monkeypatch.setattr(_hostmem.HostMemory, "__init__", init)
    monkeypatch.setattr(lifetime, "_failed_frees", [])
    return made


def _referrers(obj: Any) -> list[str]:
    out = []
    for r in gc.get_referrers(obj):
        code = getattr(r, "f_code", None)
        out.append(f"frame {code.co_name}" if code is not None else type(r).__name__)
    return out


def _driver_knows(ptr: int) -> bool:
    with ck.bind(0):
        err, _ = drv.cuPointerGetAttribute(
            drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr
        )
    return int(err) != INVALID_VALUE


def _check_freed(made: list[tuple[weakref.ref[Any], int]], start: int, what: str) -> None:
    gc.collect()
    mine = made[start:]
    assert mine, f"{what} allocated no pinned memory"
    for ref, _ptr in mine:
        mem = ref()
        assert mem is None, f"{what}: {mem!r} is still referenced by {_referrers(mem)}"
    assert lifetime.failed_frees() == [], f"{what}: frees refused: {lifetime.failed_frees()}"
    known = [hex(p) for _r, p in mine if _driver_knows(p)]
    assert not known, f"{what}: collected, no failed free, but the driver still knows {known}"


def _run(made: list[tuple[weakref.ref[Any], int]], what: str, fn: Callable[[], None]) -> None:
    start = len(made)
    fn()
    _check_freed(made, start, what)


def test_workload_pinned_memory_is_freed_when_each_function_returns(pinned):
    wl = _workload()
    ctxs = [ck.registry.context(i) for i in range(ck.device_count())]
    k = wl.load()
    rng = np.random.default_rng(0)
    for ctx in ctxs:
        _run(pinned, f"per_device({ctx!r})", lambda c=ctx: wl.per_device(c, k, rng))
    if len(ctxs) > 1:
        wl.cross_device(ctxs, k)
    _run(pinned, "threads_and_pipeline", lambda: wl.threads_and_pipeline(k))


def test_pinned_array_of_async_copies_is_freed(pinned):
    def use() -> None:
        with ck.registry.context(0):
            s = ck.Stream()
            buf = ck.DeviceBuffer(4096)
            pin = ck.pinned_empty(1024, np.float32)
            pin[:] = np.arange(1024, dtype=np.float32)
            buf.copy_from_host(pin, stream=s)
            buf.copy_to_host(pin, stream=s)
            s.synchronize()
            s.close()
            buf.close()

    _run(pinned, "async copies", use)
