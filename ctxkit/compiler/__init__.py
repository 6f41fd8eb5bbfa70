"""Run-time compilation: NVRTC programs, the on-disk kernel cache, nvJitLink, ``ptx/``.

``compile(source)`` turns CUDA C++ into an :class:`ObjectCode` for the device of the
current context: a cubin by default (loads with no JIT, whatever the NVRTC/driver
versions), PTX when asked for. Results are cached on disk (see
:mod:`ctxkit.compiler.cache`) and in memory, so a second process gets the compiled
kernel without loading NVRTC at all.
"""

from __future__ import annotations

from ..errors import KernelCacheWarning, PtxVersionWarning
from .cache import cache_dir, clear_cache
from .nvrtc import cuda_include_dirs, link_ptx, normalize_arch, nvrtc_version, supported_archs
from .objectcode import ObjectCode, detect_target
from .program import Program, compile, kernel_names, kernel_path, kernel_source

__all__ = [
    "KernelCacheWarning",
    "ObjectCode",
    "Program",
    "PtxVersionWarning",
    "cache_dir",
    "clear_cache",
    "compile",
    "cuda_include_dirs",
    "detect_target",
    "kernel_names",
    "kernel_path",
    "kernel_source",
    "link_ptx",
    "normalize_arch",
    "nvrtc_version",
    "supported_archs",
]
