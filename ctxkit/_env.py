"""The ``CTXKIT_*`` environment variables, read in one place.

- ``CTXKIT_CACHE_DIR``: compiled-kernel cache directory (``off`` disables it).
- ``CTXKIT_STRICT_CONTEXT``: ``1``: an operation in a thread with no current context raises.
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
