"""Peer access between contexts of different devices.

:func:`enable_peer_access` (``cuCtxEnablePeerAccess``), :func:`disable_peer_access`
(``cuCtxDisablePeerAccess``; both idempotent, one direction per call) and
:func:`peer_access_enabled` keep ctxkit's record of enabled pairs, keyed by the Context
objects so a handle reused by a new context is not mistaken for an enabled pair;
:func:`copy_peer` copies between two contexts' memory, directly when access is enabled
and staged by the driver otherwise.
"""

from __future__ import annotations

from typing import Any

from .._driver import drv
from ..binding import bind
from ..context import Context
from ..errors import CudaError
from .copies import (
    _direct,
    _enabled,
    device_mem,
    forget_peer_access,
    memcpy_peer,
    nbytes_arg,
    record_peer_access,
    resolve_contexts,
)

__all__ = ["copy_peer", "disable_peer_access", "enable_peer_access", "peer_access_enabled"]


_PEER_ACCESS_UNSUPPORTED = 217


_PEER_ACCESS_ALREADY_ENABLED = 704


_PEER_ACCESS_NOT_ENABLED = 705


def _peer_ctx(x: Any) -> Context:
    if isinstance(x, Context):
        x.check_usable()
        return x
    ctx = bind(x)
    ctx.check_usable()
    return ctx


def enable_peer_access(a: Any, b: Any) -> None:
    """Let context *a* access memory of context *b* (``cuCtxEnablePeerAccess``).

    *a* and *b* are Contexts, Devices or ordinals (the registry's contexts). One
    direction per call: call ``enable_peer_access(b, a)`` too for the other. Idempotent:
    a second call is not an error, and being the Driver API it leaves no pending error
    behind (the runtime's ``cudaGetLastError`` is not touched). Contexts on the same
    device need nothing.

    Raises
    ------
    CudaError
        ``CUDA_ERROR_PEER_ACCESS_UNSUPPORTED``: the devices cannot access each other
        (``Device.can_access_peer`` is False); copies still work, staged by the driver.
    """
    ca, cb = _peer_ctx(a), _peer_ctx(b)
    if ca.device.ordinal == cb.device.ordinal:
        return
    if not ca.device.can_access_peer(cb.device):
        raise CudaError(
            f"enable_peer_access: device {ca.device.ordinal} cannot access device "
            f"{cb.device.ordinal} directly (cuDeviceCanAccessPeer is 0: no NVLink/PCIe P2P "
            "path, or IOMMU/virtualization blocks it). copy_peer still works through the "
            "driver's staged path",
            _PEER_ACCESS_UNSUPPORTED,
            "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        )
    with ca:
        (err,) = drv.cuCtxEnablePeerAccess(cb.cu, 0)
    if err and int(err) != _PEER_ACCESS_ALREADY_ENABLED:
        raise ca.note_error(err, f"cuCtxEnablePeerAccess({ca!r} -> {cb!r})")
    record_peer_access(ca, cb)


def disable_peer_access(a: Any, b: Any) -> None:
    """Stop context *a* from accessing memory of context *b* (``cuCtxDisablePeerAccess``).

    The reverse of :func:`enable_peer_access`, one direction per call; idempotent (access
    that is not enabled, contexts on the same device and devices without a peer path need
    nothing). Afterwards :func:`peer_access_enabled` is False and :func:`copy_peer` takes
    the staged path. Finish kernels and copies of *a* that use *b*'s memory first: their
    accesses fault once the mapping is gone.
    """
    ca, cb = _peer_ctx(a), _peer_ctx(b)
    if ca.device.ordinal == cb.device.ordinal:
        return
    if ca.device.can_access_peer(cb.device):
        with ca:
            (err,) = drv.cuCtxDisablePeerAccess(cb.cu)
        if err and int(err) != _PEER_ACCESS_NOT_ENABLED:
            raise ca.note_error(err, f"cuCtxDisablePeerAccess({ca!r} -> {cb!r})")
    forget_peer_access(ca, cb)


def peer_access_enabled(a: Any, b: Any) -> bool:
    """True when :func:`enable_peer_access` (a, b) has succeeded in this process and
    :func:`disable_peer_access` (a, b) has not been called since."""
    return _enabled(_peer_ctx(a), _peer_ctx(b))


def copy_peer(dst: Any, src: Any, nbytes: int | None = None, stream: Any = None) -> bool:
    """Copy *nbytes* (default: all of *src*) between memory of two contexts/devices.

    Uses ``cuMemcpyPeer`` (``cuMemcpyPeerAsync`` on *stream*): the driver copies
    directly over NVLink/PCIe when peer access is enabled between the two contexts and
    stages through host memory otherwise. Without *stream* the copy has completed when
    the call returns; with *stream* it is enqueued there, and neither side may be freed
    before that stream is synchronized.

    Returns
    -------
    bool
        True when peer access was enabled between the two contexts (either direction,
        by :func:`enable_peer_access`) so the direct path ran; False for the staged path.
    """
    what = "copy_peer"
    d = device_mem(dst, what, write=True)
    s = device_mem(src, what)
    n = s.nbytes if nbytes is None else nbytes_arg(nbytes, what)
    if n > s.nbytes or n > d.nbytes:
        raise ValueError(
            f"{what}: {n} bytes do not fit (source {s.nbytes} bytes, destination {d.nbytes})"
        )
    dctx, sctx = resolve_contexts(d, s, stream, what)
    if n == 0:
        return _direct(dctx, sctx)
    return memcpy_peer(d.ptr, dctx, s.ptr, sctx, n, stream, what)
