"""The ``CTXKIT_*`` environment variables: the one table of them, and their only readers.

Every variable ctxkit reads is one :class:`Variable` in :data:`VARIABLES` (name, type,
default, meaning), and is read only through :func:`env_text`, :func:`env_flag` and
:func:`env_off`, which refuse a name the table does not list. A new variable is one more
entry here and one more row in ``docs/configuration.md`` (the user's copy of this table;
``tests/core/test_env.py`` checks the two agree). How a value is parsed beyond that (a size,
a choice) is up to the module that uses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One ``CTXKIT_*`` variable: what it takes, what it means when unset, what it does."""

    name: str
    type: str
    default: str
    meaning: str


#: Every ``CTXKIT_*`` variable: ``docs/configuration.md`` says more about each.
VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable("CTXKIT_CACHE_DIR", "path or off", "~/.cache/ctxkit/kernels", "kernel cache"),
        Variable("CTXKIT_CACHE_MAX_BYTES", "size: 512M, 2G", "1 GiB", "kernel cache size cap"),
        Variable("CTXKIT_STRICT_CONTEXT", "flag", "off", "ck.registry.strict"),
        Variable("CTXKIT_STRICT_ASYNC", "flag", "off", "async pageable copies raise"),
        Variable("CTXKIT_PAGEABLE_KERNEL_ARGS", "flag", "off", "pageable kernel arguments"),
        Variable("CTXKIT_PINNED_POOL_BYTES", "int >= 0", "RAM / 4, <= 64 GiB", "pinned budget"),
        Variable("CTXKIT_PINNED_ALLOC", "register or hostalloc", "register", "pinned pool blocks"),
        Variable("CTXKIT_ALLOC_CACHE", "flag or bytes", "device memory / 4", "freed-block cache"),
        Variable("CTXKIT_STREAMING_COPY", "flag", "on", "non-temporal staging copies"),
        Variable("CTXKIT_NVTX", "flag", "on with the nvtx package", "NVTX ranges"),
    )
}

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def env_text(name: str) -> str:
    """The value of the variable *name*, stripped (``""`` when unset).

    Raises
    ------
    KeyError
        *name* is not in :data:`VARIABLES` (add its entry there first).
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in ctxkit._env.VARIABLES: add its entry there")
    return os.environ.get(name, "").strip()


def env_flag(name: str) -> bool:
    """True when the variable *name* is set to 1/true/yes/on (any case)."""
    return env_text(name).lower() in _ON


def env_off(name: str) -> bool:
    """True when the variable *name* is explicitly set to 0/false/no/off (any case)."""
    return env_text(name).lower() in _OFF


def alloc_cache() -> tuple[bool, int | None]:
    """``CTXKIT_ALLOC_CACHE``: (enabled, bound in bytes per device or ``None`` for the
    default bound); ValueError naming the accepted values for anything else."""
    raw = env_text("CTXKIT_ALLOC_CACHE").lower()
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
    want = env_text("CTXKIT_PINNED_ALLOC").lower()
    if want not in ("", "register", "hostalloc"):
        raise ValueError(
            f"CTXKIT_PINNED_ALLOC={want!r}: use 'register' (default on Linux) or 'hostalloc'"
        )
    return want


def pinned_pool_bytes() -> int | None:
    """``CTXKIT_PINNED_POOL_BYTES``: the pinned pool's budget, ``None`` when unset."""
    value = env_text("CTXKIT_PINNED_POOL_BYTES")
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
