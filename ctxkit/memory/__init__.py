"""Device, managed and page-locked host memory; copies; peer access.

Every allocation is made inside its context (the one passed in, or the caller's current
one), remembers it in ``.context`` and is freed inside it from whatever thread drops the
last reference, or by ``close()``. Copies check sizes, dtypes and contiguity before the
driver is called and raise ``ValueError`` on a mismatch; zero-size copies do nothing.

Synchronous unless a stream is given
------------------------------------
Without ``stream=`` a copy, memset or peer copy has completed when the call returns,
so the next operation may use the memory from any stream or context. (The driver runs
memsets, device-to-device and peer copies asynchronously to the host on the context's
legacy default stream, which ``ctxkit.Stream()``, non-blocking by default, does not wait
for; ctxkit waits for that stream before returning.) With ``stream=`` the operation is
enqueued on that stream and the call returns at once; order it against other streams
with events (``Stream.wait``), and keep the memory alive until the stream has reached
it: memory freed while a copy into it is still queued in *another* context (a peer copy
on a stream) faults that context.

Honest async
------------
An asynchronous copy (``stream=`` given) from or to *pageable* host memory is not
asynchronous: the driver blocks the calling thread for the whole copy (measured on an
H200: 1 GiB pageable ``cuMemcpyHtoDAsync`` blocked the host for the whole copy at
~7.8 GB/s; from pinned memory it returned at once and ran at ~55 GB/s). ctxkit therefore
emits a :class:`PageableCopyWarning` (once per call site) for such a copy, or raises
:class:`PageableCopyError` in strict mode (:func:`set_strict_async` or the environment
variable ``CTXKIT_STRICT_ASYNC=1``). Use :func:`pinned_empty` or :func:`register_host`;
:func:`is_pinned` tells which memory you have.

Interoperability
----------------
:class:`DeviceArray` (and :class:`DeviceBuffer`, as bytes) export
``__cuda_array_interface__`` v3 and DLPack, so CuPy, PyTorch and Numba use ctxkit memory
without a copy; copies accept their arrays (anything with ``__cuda_array_interface__``)
as sources and targets. ``DeviceArray.stream`` names the stream with pending writes
(set by ctxkit's async copies, or by you after launching a kernel); it is exported as the
interface's ``"stream"`` entry and honoured by ``__dlpack__(stream=...)``.

Modules
-------
``device`` buffers, typed arrays and memory pools; ``alloc`` the kinds of memory as data
(:class:`~ctxkit.memory.alloc.MemoryKind`) and the stream-ordered block cache; ``managed``
unified memory; ``host`` pointer kinds, pinned allocations, registration
(:func:`~ctxkit.memory.host.register_pages`, the one ``cuMemHostRegister``) and kernel access
to host memory; ``pinned`` the pinned pool; ``copies`` host, device and peer copies;
``interop`` foreign arrays, CUDA Array Interface and DLPack; ``ipc`` sharing with other
processes; ``vmm`` virtual memory; ``streamcopy`` non-temporal host copies; ``sizes`` the
checks of sizes and shapes. The guide's table of memory kinds and copy paths is in
``docs/guides/streams-memory-and-faults.md``.
"""

from __future__ import annotations

from ..errors import PageableCopyError, PageableCopyWarning
from .copies import copy_peer, disable_peer_access, enable_peer_access, peer_access_enabled
from .device import DeviceArray, DeviceBuffer, MemoryPool, device_array, to_device
from .host import (
    HostMemoryFlags,
    PageableArg,
    allow_pageable_kernel_args,
    device_pointer,
    host_memory_flags,
    is_pinned,
    pageable_arg,
    pageable_kernel_args_allowed,
    pageable_memory_access,
    pinned_empty,
    pinned_zeros,
    register_host,
    set_strict_async,
    strict_async,
)
from .interop import producer_stream
from .ipc import (
    ImportedBuffer,
    IpcBufferHandle,
    IpcEventHandle,
    IpcVirtualBufferHandle,
    export_buffer,
    export_event,
    import_buffer,
    import_event,
    ipc_event,
)
from .managed import ManagedBuffer
from .pinned import PinnedPool, PinnedPoolStats, pinned_pool
from .streamcopy import StreamingCopyInfo, copy_streaming, set_streaming_copy, streaming_copy_info
from .vmm import VirtualBuffer

__all__ = [
    "DeviceArray",
    "DeviceBuffer",
    "HostMemoryFlags",
    "ImportedBuffer",
    "IpcBufferHandle",
    "IpcEventHandle",
    "IpcVirtualBufferHandle",
    "ManagedBuffer",
    "MemoryPool",
    "PageableArg",
    "PageableCopyError",
    "PageableCopyWarning",
    "PinnedPool",
    "PinnedPoolStats",
    "StreamingCopyInfo",
    "VirtualBuffer",
    "allow_pageable_kernel_args",
    "copy_peer",
    "copy_streaming",
    "device_array",
    "device_pointer",
    "disable_peer_access",
    "enable_peer_access",
    "export_buffer",
    "export_event",
    "host_memory_flags",
    "import_buffer",
    "import_event",
    "ipc_event",
    "is_pinned",
    "pageable_arg",
    "pageable_kernel_args_allowed",
    "pageable_memory_access",
    "peer_access_enabled",
    "pinned_empty",
    "pinned_pool",
    "pinned_zeros",
    "producer_stream",
    "register_host",
    "set_streaming_copy",
    "set_strict_async",
    "streaming_copy_info",
    "strict_async",
    "to_device",
]
