"""Streaming host copies: non-temporal stores for big copies into memory the CPU will not
read again soon (:func:`copy_streaming`).

Why: a staging copy into pinned memory is read next by a DMA engine, not by a CPU. An
ordinary ``memcpy`` (glibc switches to non-temporal stores only for a single copy larger
than about 3/4 of the L3 cache, far more than one staging piece) first reads every
destination line into the cache (read for ownership) and evicts useful lines on its way:
three bytes of memory traffic per byte copied instead of two, on the bandwidth the DMA
needs too. Measured on an H200 host with 16 CPUs (1 GiB, populated source and
destination): ``np.copyto`` 36-41 GB/s on 8-16 threads, non-temporal stores 49-64 GB/s.

The copy loop is compiled once per process for the host CPU with llvmlite (the optional
extra ``ctxkit-cuda[fastcopy]``), on x86-64 only, where a non-temporal store followed by
``sfence`` is visible to every later reader, a DMA engine included. Anywhere else,
without llvmlite, for small, overlapping, strided or object arrays, or after
:func:`set_streaming_copy` ``(False)`` (or ``CTXKIT_STREAMING_COPY=0`` in the
environment), the copy is ``np.copyto``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import os
import platform
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .. import _driver
from .._env import streaming_copy
from .host import host_address

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "MIN_STREAMING_BYTES",
    "StreamingCopyInfo",
    "build_streaming_copy",
    "copy_streaming",
    "last_level_cache_bytes",
    "set_streaming_copy",
    "streaming_copy_info",
    "streaming_pays",
]


MIN_STREAMING_BYTES = 256 << 10
"""Smaller copies take ``np.copyto``: their destination may well be read from the cache
soon, and the call overhead is not worth it."""

DEFAULT_CACHE_BYTES = 32 << 20
"""The last-level cache size assumed when the system does not say."""

_ALIGN = 64  # the loop's stores are aligned to a cache line
_STEP = 256  # bytes per loop iteration (four 64-byte vectors)
_ENTRY = "ctxkit_stream_copy"
_X86_64 = ("x86_64", "amd64")

_CopyFn = Callable[[int, int, int], None]


@dataclasses.dataclass(frozen=True)
class StreamingCopyInfo:
    """Whether :func:`copy_streaming` uses non-temporal stores, and why not."""

    enabled: bool
    """Switched on (:func:`set_streaming_copy`; ``CTXKIT_STREAMING_COPY``)."""
    available: bool
    """The compiled loop exists on this machine."""
    reason: str
    """What the copies use, in words."""

    @property
    def active(self) -> bool:
        """True when big copies use non-temporal stores."""
        return self.enabled and self.available


class _State:
    lock = threading.Lock()
    enabled = streaming_copy()
    loaded = False
    building = False
    fn: _CopyFn | None = None
    reason = "not loaded yet"
    keep: ClassVar[list[Any]] = []  # the JIT engine and the ctypes wrapper must outlive fn


def _ir(opaque_pointers: bool) -> str:
    """LLVM IR of ``copy(dst, src, n)``: *n* a multiple of 256, *dst* 64-byte aligned."""
    p8 = "ptr" if opaque_pointers else "i8*"
    pv = "ptr" if opaque_pointers else "<8 x i64>*"
    lines = [
        "declare void @llvm.x86.sse.sfence()",
        f"define void @{_ENTRY}({p8} %dst, {p8} %src, i64 %n) {{",
        "entry:",
        "  %empty = icmp eq i64 %n, 0",
        "  br i1 %empty, label %done, label %loop",
        "loop:",
        "  %off = phi i64 [ 0, %entry ], [ %next, %loop ]",
    ]
    vectors = range(_STEP // 64)
    sv, dv = ("%s", "%d") if opaque_pointers else ("%sv", "%dv")  # the <8 x i64> pointers
    for k in vectors:
        lines += [
            f"  %o{k} = add i64 %off, {64 * k}",
            f"  %s{k} = getelementptr i8, {p8} %src, i64 %o{k}",
            f"  %d{k} = getelementptr i8, {p8} %dst, i64 %o{k}",
        ]
        if not opaque_pointers:
            lines += [
                f"  %sv{k} = bitcast i8* %s{k} to {pv}",
                f"  %dv{k} = bitcast i8* %d{k} to {pv}",
            ]
    lines += [f"  %v{k} = load <8 x i64>, {pv} {sv}{k}, align 1" for k in vectors]
    lines += [f"  store <8 x i64> %v{k}, {pv} {dv}{k}, align 64, !nontemporal !0" for k in vectors]
    lines += [
        f"  %next = add i64 %off, {_STEP}",
        "  %more = icmp ult i64 %next, %n",
        "  br i1 %more, label %loop, label %done",
        "done:",
        "  call void @llvm.x86.sse.sfence()",
        "  ret void",
        "}",
        "!0 = !{i32 1}",
    ]
    return "\n".join(lines) + "\n"


def _compile() -> tuple[_CopyFn | None, str]:
    """Compile the loop for the host CPU: ``(function, description)`` or
    ``(None, why not)``."""
    if platform.machine().lower() not in _X86_64:
        why = f"non-temporal copies are built for x86-64 only, not {platform.machine()}"
        return None, f"np.copyto ({why})"
    try:
        import llvmlite.binding as llvm
    except ImportError:
        why = "install llvmlite, the extra ctxkit-cuda[fastcopy], for streaming copies"
        return None, f"np.copyto ({why})"
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        try:
            features = llvm.get_host_cpu_features().flatten()
        except RuntimeError:
            features = ""
        cpu = llvm.get_host_cpu_name()
        tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=cpu, features=features, opt=3
        )
        module = llvm.parse_assembly(_ir(llvm.llvm_version_info[0] >= 15))
        module.verify()
        engine = llvm.create_mcjit_compiler(module, tm)
        engine.finalize_object()
        address = engine.get_function_address(_ENTRY)
    except Exception as exc:  # an LLVM that cannot build it: plain copies, said so
        return None, f"np.copyto (llvmlite could not build the streaming copy: {exc})"
    cfn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)(address)
    _State.keep[:] = [engine, cfn]
    llvm_version = ".".join(map(str, llvm.llvm_version_info))
    return cfn, f"non-temporal stores (llvmlite, LLVM {llvm_version}, {cpu})"


def _build() -> None:
    with _State.lock:
        if not _State.loaded:
            _State.fn, _State.reason = _compile()
            _State.loaded = True


def build_streaming_copy() -> None:
    """Start building the copy loop in a background thread (importing llvmlite and
    compiling take ~80 ms); :func:`copy_streaming` uses ``np.copyto`` until it is ready
    instead of waiting. A Pipeline calls this when it is made."""
    if _State.loaded or _State.building:
        return
    with _State.lock:
        if _State.loaded or _State.building:
            return
        _State.building = True
    with contextlib.suppress(RuntimeError):  # no new threads at interpreter exit: copies stay plain
        threading.Thread(target=_build, name="ctxkit-streamcopy-build", daemon=True).start()


def _loop() -> _CopyFn | None:
    if not _State.loaded:
        if _State.building:
            return None  # being built: plain copies meanwhile
        _build()
    return _State.fn if _State.enabled else None


def set_streaming_copy(enabled: bool) -> bool:
    """Switch non-temporal copies on or off for the process; return the previous setting.

    Off, :func:`copy_streaming` is ``np.copyto``: for comparing the two in one run, or
    on a machine where plain copies measure faster.
    """
    with _State.lock:
        previous, _State.enabled = _State.enabled, bool(enabled)
    return previous


def streaming_copy_info() -> StreamingCopyInfo:
    """What :func:`copy_streaming` does on this machine (builds the loop, or waits for
    its build, first)."""
    _build()
    reason = _State.reason if _State.enabled else "np.copyto (switched off)"
    return StreamingCopyInfo(_State.enabled, _State.fn is not None, reason)


def _cache_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of the largest CPU cache (``sysconf``, else sysfs, else
    :data:`DEFAULT_CACHE_BYTES`)."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
        if size > 0:
            return size
    best = 0
    for entry in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(entry) as f:
                best = max(best, _cache_size(f.read()))
        except (OSError, ValueError):
            continue
    return best or DEFAULT_CACHE_BYTES


def streaming_pays(total_bytes: int) -> bool:
    """True when a copy of *total_bytes* in all (a map's whole input or output) is worth
    non-temporal stores: at least the last-level cache.

    Below it, an ordinary copy leaves the data in the cache, where the next reader, a
    DMA engine included, finds it. Measured on an H200 host (300 MiB L3): a long-lived
    Pipeline on fresh 256 MiB arrays ran 0.87x with streaming copies, on 1 GiB arrays
    1.06-1.15x.
    """
    return total_bytes >= last_level_cache_bytes()


# a build thread of the parent does not exist in a forked child: build again there
_driver.renew_at_fork(_State, "lock")

_driver.renew_at_fork(_State, "building", lambda: False)


def _streamable(dst: Any, src: Any) -> bool:
    return (
        isinstance(dst, np.ndarray)
        and isinstance(src, np.ndarray)
        and dst.nbytes >= MIN_STREAMING_BYTES
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and not dst.dtype.hasobject
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
        and dst.flags.writeable
        and not np.may_share_memory(dst, src)
    )


def copy_streaming(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy *src* into *dst* as ``np.copyto(dst, src)`` does, with non-temporal stores
    when both are C-contiguous arrays of one dtype and shape, at least
    :data:`MIN_STREAMING_BYTES`, apart in memory (anything else is ``np.copyto``).

    For destinations the CPU will not read soon, in copies that together exceed the
    cache (:func:`streaming_pays`): pinned staging buffers the GPU reads, big outputs.
    Releases the GIL like ``np.copyto``, so threads copy in parallel.
    """
    fn = _loop()
    if fn is None or not _streamable(dst, src):
        np.copyto(dst, src)
        return
    d8, s8 = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    n = d8.shape[0]
    d = host_address(d8)
    s = host_address(s8)
    head = min((-d) % _ALIGN, n)
    body = (n - head) // _STEP * _STEP
    if head:
        np.copyto(d8[:head], s8[:head])
    if body:
        fn(d + head, s + head, body)
    if head + body < n:
        np.copyto(d8[head + body :], s8[head + body :])
