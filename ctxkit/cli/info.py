"""``python -m ctxkit info``: what this machine offers and whether it fits together."""

from __future__ import annotations

import sys
from typing import TextIO

from .. import _driver
from ..errors import DriverNotFoundError

EXIT_NO_GPU = 2


def _fmt(v: tuple[int, int] | None) -> str:
    return f"{v[0]}.{v[1]}" if v else "not available"


def compatibility_line(nvrtc: tuple[int, int] | None, drv_ver: tuple[int, int] | None) -> str:
    """One sentence on whether code from this NVRTC loads on this driver."""
    if nvrtc is None:
        return "NVRTC not found: install ctxkit[cu13] (or [cu12]) to compile kernels"
    if drv_ver is None:
        return (
            f"NVRTC {_fmt(nvrtc)}; no driver here: compile with --arch "
            "(the cubin/PTX files load on a GPU machine)"
        )
    if nvrtc > drv_ver:
        return (
            f"NVRTC {_fmt(nvrtc)} is newer than the driver's CUDA {_fmt(drv_ver)}: PTX from it "
            "will NOT load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION); cubin will, and "
            "target='auto' compiles cubin"
        )
    if nvrtc[0] < drv_ver[0]:
        return (
            f"NVRTC {_fmt(nvrtc)} is older than the driver's CUDA {_fmt(drv_ver)}: both PTX "
            "and cubin load (the driver is backward compatible)"
        )
    return f"NVRTC {_fmt(nvrtc)} matches the driver's CUDA {_fmt(drv_ver)}: PTX and cubin both load"


def print_info(out: TextIO | None = None) -> int:
    """Print versions, devices and the peer matrix; return the CLI exit code."""
    from ..compiler.nvrtc import nvrtc_version
    from ..device import Device, device_count

    w = out or sys.stdout
    bv = _driver.BINDINGS_VERSION if _driver.bindings_available() else None
    try:
        nvrtc = nvrtc_version()
    except Exception:
        nvrtc = None
    print(f"cuda-bindings : {_fmt(bv)}", file=w)
    print(f"NVRTC         : {_fmt(nvrtc)}", file=w)
    try:
        _driver.init()
    except DriverNotFoundError as exc:
        print(f"driver        : {exc}", file=w)
        print(f"compatibility : {compatibility_line(nvrtc, None)}", file=w)
        print("ctxkit: no GPU: no NVIDIA driver on this machine", file=sys.stderr)
        return EXIT_NO_GPU
    drv_ver = _driver.driver_version()
    print(f"driver (CUDA) : {_fmt(drv_ver)}", file=w)
    n = device_count()
    print(f"devices       : {n}", file=w)
    devs = [Device(i) for i in range(n)]
    for d in devs:
        cc = "{}.{}".format(*d.compute_capability)
        print(
            f"  [{d.ordinal}] {d.name}  cc {cc}  {d.total_memory / 2**30:.1f} GiB  "
            f"SMs {d.multiprocessor_count}  PCI {d.pci_bus_id}",
            file=w,
        )
    if n > 1:
        print("peer access (row can access column):", file=w)
        print("      " + " ".join(f"{j:>3}" for j in range(n)), file=w)
        for a in devs:
            cells = " ".join(
                "  -" if a is b else ("yes" if a.can_access_peer(b) else " no") for b in devs
            )
            print(f"  {a.ordinal:>3} {cells}", file=w)
    print(f"compatibility : {compatibility_line(nvrtc, drv_ver)}", file=w)
    if n == 0:
        print("ctxkit: no GPU: the driver reports no CUDA device", file=sys.stderr)
        return EXIT_NO_GPU
    return 0
