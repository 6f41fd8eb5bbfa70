"""``ctxkit info``: what this machine offers and whether it fits together.

It prints what it can find on any machine: without cuda-bindings it says that; without a
driver or GPU it still reports the bindings, NVRTC and the architectures NVRTC compiles
for, then a line starting ``no GPU``. It exits 0 in every case: it reports, it does not
judge (``ctxkit demo`` exits 2 without a GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from .. import __version__, _driver
from ..errors import CudaError, DriverNotFoundError
from ..memory.streamcopy import streaming_copy_info

__all__ = ["DISTRIBUTION", "compatibility_line", "install_hint", "print_info"]

#: The name of ctxkit's distribution on the package index (the import name is ``ctxkit``).
DISTRIBUTION = "ctxkit-cuda"


def install_hint(extra: str = "cu13") -> str:
    """The install command for *extra*, from a checkout and from the package index."""
    alt = ' (".[cu12]" for a CUDA 12 driver)' if extra == "cu13" else ""
    return (
        f'pip install -e ".[{extra}]" in a ctxkit checkout{alt}, '
        f'or pip install "{DISTRIBUTION}[{extra}]"'
    )


def _fmt(v: tuple[int, int] | None) -> str:
    return f"{v[0]}.{v[1]}" if v else "not available"


def compatibility_line(nvrtc: tuple[int, int] | None, drv_ver: tuple[int, int] | None) -> str:
    """One sentence on whether code from this NVRTC loads on this driver."""
    if nvrtc is None:
        return f"NVRTC not found: to compile kernels, {install_hint()}"
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


def _bindings_line() -> str:
    if _driver.bindings_available():
        return _fmt(_driver.BINDINGS_VERSION)
    return f"not installed ({_driver.bindings_import_error()!r}); {install_hint()}"


def _nvrtc() -> tuple[tuple[int, int] | None, tuple[int, ...]]:
    """NVRTC's version and real architectures, ``(None, ())`` where NVRTC is missing."""
    from ..compiler.nvrtc import nvrtc_version, supported_archs

    try:
        return nvrtc_version(), supported_archs()
    except CudaError:
        return None, ()


def _nvrtc_line(nvrtc: tuple[int, int] | None) -> str:
    if nvrtc is not None:
        return _fmt(nvrtc)
    return f"not found: the cu13 or cu12 extra installs it; {install_hint()}"


def _archs_line(archs: tuple[int, ...]) -> str:
    return " ".join(f"sm_{a}" for a in archs) if archs else "not available (no NVRTC)"


def _cache_line() -> str:
    from ..compiler.cache import cache_dir, max_bytes

    if (where := cache_dir()) is None:
        return "off (CTXKIT_CACHE_DIR=off)"
    files = [p for p in Path(where).glob("**/*") if p.is_file()] if where.is_dir() else []
    size = sum(p.stat().st_size for p in files)
    try:
        cap = f"at most {max_bytes() / 2**20:.0f} MiB"
    except ValueError as exc:
        cap = str(exc)
    return f"{where} ({len(files)} files, {size / 2**20:.1f} MiB; {cap})"


def _print_devices(w: TextIO) -> int:
    from ..device import devices

    devs = devices()
    print(f"devices       : {len(devs)}", file=w)
    for d in devs:
        cc = "{}.{}".format(*d.compute_capability)
        print(
            f"  [{d.ordinal}] {d.name}  cc {cc}  {d.total_memory / 2**30:.1f} GiB  "
            f"SMs {d.multiprocessor_count}  PCI {d.pci_bus_id}",
            file=w,
        )
    if len(devs) > 1:
        print("peer access (row can access column):", file=w)
        print("      " + " ".join(f"{d.ordinal:>3}" for d in devs), file=w)
        for a in devs:
            cells = " ".join(
                "  -" if a is b else ("yes" if a.can_access_peer(b) else " no") for b in devs
            )
            print(f"  {a.ordinal:>3} {cells}", file=w)
    return len(devs)


def _no_gpu_line(nvrtc: tuple[int, int] | None) -> str:
    if nvrtc is None:
        return "kernels can be neither compiled here (no NVRTC, see above) nor run"
    return "kernels can be compiled here (ctxkit compile --arch sm_90), not run"


def print_info(out: TextIO | None = None) -> int:
    """Print versions, NVRTC's architectures, the cache, devices and peer access; return 0."""
    w = out or sys.stdout
    nvrtc, archs = _nvrtc() if _driver.bindings_available() else (None, ())
    print(f"ctxkit        : {__version__} (distribution {DISTRIBUTION})", file=w)
    print(f"cuda-bindings : {_bindings_line()}", file=w)
    print(f"NVRTC         : {_nvrtc_line(nvrtc)}", file=w)
    print(f"NVRTC targets : {_archs_line(archs)}", file=w)
    print(f"kernel cache  : {_cache_line()}", file=w)
    print(f"host copies   : {streaming_copy_info().reason}", file=w)
    if not _driver.bindings_available():
        print("driver        : not checked (it is reached through cuda-bindings)", file=w)
        print("no GPU        : cuda-bindings is not installed (see above)", file=w)
        return 0
    try:
        _driver.init()
    except DriverNotFoundError as exc:
        print(f"driver        : {exc}", file=w)
        print(f"compatibility : {compatibility_line(nvrtc, None)}", file=w)
        print(f"no GPU        : {_no_gpu_line(nvrtc)}", file=w)
        return 0
    drv_ver = _driver.driver_version()
    print(f"driver (CUDA) : {_fmt(drv_ver)}", file=w)
    n = _print_devices(w)
    print(f"compatibility : {compatibility_line(nvrtc, drv_ver)}", file=w)
    if n == 0:
        print("no GPU        : the driver reports no CUDA device", file=w)
    return 0
