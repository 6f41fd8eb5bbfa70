"""The ``CTXKIT_*`` environment variables, read in one place.

- ``CTXKIT_CACHE_DIR``: compiled-kernel cache directory (``off`` disables it).
- ``CTXKIT_STRICT_CONTEXT``: ``1``: an operation in a thread with no current context raises.
- ``CTXKIT_AUTO_BIND``: ``0``: the same as ``CTXKIT_STRICT_CONTEXT=1`` (the ctxkit 0.1 name).
- ``CTXKIT_STRICT_ASYNC``: ``1``: an async copy from pageable host memory raises.
- ``CTXKIT_PAGEABLE_KERNEL_ARGS``: ``1``: pageable numpy arrays as kernel arguments on
  devices that access pageable memory (HMM/ATS).
- ``CTXKIT_PINNED_POOL_BYTES``: the pinned host pool's budget in bytes (default: a quarter
  of RAM, at most 64 GiB).
- ``CTXKIT_ALLOC_CACHE``: ``0``: no cache of freed stream-ordered blocks; a number: its bound
  in bytes per device (default: a quarter of the device's memory).
- ``CTXKIT_NVTX``: ``0``: no NVTX ranges even when the nvtx package is installed.
"""

from __future__ import annotations

import os

__all__ = ["env_flag", "env_off"]

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def env_flag(name: str) -> bool:
    """True when the variable *name* is set to 1/true/yes/on (any case)."""
    return os.environ.get(name, "").strip().lower() in _ON


def env_off(name: str) -> bool:
    """True when the variable *name* is explicitly set to 0/false/no/off (any case)."""
    return os.environ.get(name, "").strip().lower() in _OFF


def alloc_cache() -> tuple[bool, int | None]:
    """``CTXKIT_ALLOC_CACHE``: (enabled, bound in bytes per device or ``None`` for the
    default bound); ValueError naming the accepted values for anything else."""
    raw = os.environ.get("CTXKIT_ALLOC_CACHE", "").strip().lower()
    if raw == "" or raw in _ON:
        return True, None
    if raw in _OFF:
        return False, None
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(
            f"CTXKIT_ALLOC_CACHE={raw!r}: expected 0/off (no cache), 1/on (default bound) or "
            "the bound in bytes per device (e.g. 4294967296)"
        ) from None
    if value < 0:
        raise ValueError(f"CTXKIT_ALLOC_CACHE={raw!r}: the bound in bytes must not be negative")
    return value > 0, value


def pinned_alloc() -> str:
    """``CTXKIT_PINNED_ALLOC``: ``""`` (default), ``"register"`` or ``"hostalloc"``."""
    want = os.environ.get("CTXKIT_PINNED_ALLOC", "").strip().lower()
    if want not in ("", "register", "hostalloc"):
        raise ValueError(
            f"CTXKIT_PINNED_ALLOC={want!r}: use 'register' (default on Linux) or 'hostalloc'"
        )
    return want


def pinned_pool_bytes() -> int | None:
    """``CTXKIT_PINNED_POOL_BYTES``: the pinned pool's budget, ``None`` when unset."""
    value = os.environ.get("CTXKIT_PINNED_POOL_BYTES", "").strip()
    if not value:
        return None
    try:
        budget = int(value)
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(
            f"CTXKIT_PINNED_POOL_BYTES={value!r}: give the most bytes of page-locked host "
            "memory the pinned pool may hold in this process, as an integer >= 0"
        )
    return budget


def streaming_copy() -> bool:
    """``CTXKIT_STREAMING_COPY``: False when set to 0/false/no/off (default on)."""
    return not env_off("CTXKIT_STREAMING_COPY")
