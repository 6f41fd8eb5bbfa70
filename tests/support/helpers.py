"""Small helpers shared by the CPU and GPU tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_python(
    *args: str, code: str | None = None, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """A child ``python *args`` (or ``python -c code``, dedented) run in the repository,
    with ctxkit importable from it and *env* added to this process's environment; its
    output is captured as text."""
    argv = [*args] if code is None else ["-c", textwrap.dedent(code)]
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        cwd=REPO,
        check=False,
    )


def in_thread(fn: Callable[[], Any], name: str | None = None) -> Any:
    """Run ``fn()`` in a fresh thread (no context current there); return or raise its result."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def in_threads(n: int, fn: Callable[[int], Any], timeout: float = 60.0) -> None:
    """Run ``fn(i)`` in *n* threads at once (i = 0 .. n-1); re-raise the first error of any."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]


def raw_current() -> int:
    """The calling thread's current context handle as the driver reports it (0: none)."""
    from ctxkit._driver import drv

    err, cu = drv.cuCtxGetCurrent()
    assert not err
    return int(cu)


def is_allocated(ptr: int) -> bool:
    """Whether the driver still knows an allocation at device address *ptr*.

    Asked of the allocation itself (``cuMemGetAddressRange``), not of the device's free memory,
    which other processes of a test run change meanwhile. Needs a current context."""
    from ctxkit._driver import drv

    err, _base, _size = drv.cuMemGetAddressRange(ptr)
    return not int(err)


def load_file_module(path: Any, name: str, register: bool = False) -> Any:
    """Import a script (``scripts/*.py``, ``benchmarks/*.py``, ``examples/*.py``) as a module,
    its folder on ``sys.path`` while it loads, as when it runs (its sibling imports work).

    ``register`` puts it in ``sys.modules`` first (needed when it defines dataclasses or
    pickles its own objects).
    """
    import importlib.util
    import os
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(folder)
    return mod


#: The driver's answers that mean "this machine does not offer CUDA IPC / shareable handles"
#: (containers without a shared PID namespace, drivers without the feature). Any other
#: failure is a bug, and the IPC GPU tests fail on it instead of skipping.
IPC_REFUSALS = frozenset(
    {"CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_PERMITTED", "CUDA_ERROR_OPERATING_SYSTEM"}
)


def ipc_refused(exc: BaseException) -> bool:
    """Whether *exc* is the driver refusing IPC here (a documented "not supported" answer)."""
    name = getattr(exc, "name", "") or ""
    return name in IPC_REFUSALS or any(n in str(exc) for n in IPC_REFUSALS)


#: dtypes whose items hold Python objects: what every host memory path refuses
OBJECT_DTYPES = ("object", "f8,O")


def object_array(dtype: str, nbytes: int) -> Any:
    """A numpy array of *dtype* (one of :data:`OBJECT_DTYPES`) filled with live objects,
    *nbytes* bytes long."""
    import numpy as np

    dt = np.dtype(dtype)
    arr = np.empty(nbytes // dt.itemsize, dt)
    field = "f1" if dt.names else None
    for i in range(arr.shape[0]):
        if field:
            arr[i] = (float(i), object())
        else:
            arr[i] = object()
    return arr


def object_dtype_message(dtype: str) -> str:
    """A regex matching a refusal that names *dtype*."""
    import re

    import numpy as np

    return re.escape(f"dtype {np.dtype(dtype)} holds Python objects")


def process_device_memory(pci_bus_id: str) -> int | None:
    """Bytes of device memory this process holds on the device at *pci_bus_id*, as NVML
    reports it per process (``nvmlDeviceGetComputeRunningProcesses``); ``None`` where
    NVML (``cuda.bindings.nvml``) is not available.

    A leak check reads this rather than the device's free memory: the README's test
    command runs GPU tests in several worker processes at once, and their allocations
    change the device's free memory meanwhile."""
    import os

    try:
        from cuda.bindings import nvml
    except ImportError:
        return None
    try:
        nvml.init_v2()
    except Exception:  # no NVML library, or one that refuses: no figure
        return None
    try:
        handle = nvml.device_get_handle_by_pci_bus_id_v2(pci_bus_id)
        infos = nvml.device_get_compute_running_processes_v3(handle)
    except Exception:
        return None
    finally:
        nvml.shutdown()
    pid = os.getpid()
    used = [int(infos[i].used_gpu_memory) for i in range(len(infos)) if int(infos[i].pid) == pid]
    return used[0] if used else 0
