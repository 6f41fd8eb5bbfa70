"""NVTX ranges for Nsight Systems, in the ``ctxkit`` domain; free when unused.

ctxkit marks its chunk stages, copies, compiles and launches with these, so a profile
(``nsys profile python app.py``) shows ctxkit's work by name beside the CUDA calls. They
need the optional ``nvtx`` package (``pip install "ctxkit-cuda[nvtx]"``, or ``[nvtx]`` in
a checkout); without it -- or with ``CTXKIT_NVTX=0`` -- every function here does nothing
and costs one check of a module flag: :func:`range` returns one shared do-nothing context
manager and :func:`annotate` returns the function itself.

The ``nvtx`` package is imported at the first range, not when this module is imported.
Ranges opened with :func:`range` belong to the calling thread (push/pop); a range that
starts in one thread and ends in another (a chunk handed from a feeder to a drainer)
uses :func:`start_range` / :func:`end_range`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from . import _driver
from ._env import env_off

__all__ = [
    "DOMAIN",
    "ENV",
    "annotate",
    "enabled",
    "end_range",
    "mark",
    "range",
    "set_enabled",
    "start_range",
]

F = TypeVar("F", bound=Callable[..., Any])


DOMAIN = "ctxkit"


ENV = "CTXKIT_NVTX"


_INSTALL_HINT = (
    'pip install "ctxkit-cuda[nvtx]" (or pip install nvtx; ".[nvtx]" in a ctxkit checkout)'
)


#: At most this many (name, color) pairs keep their NVTX event attributes cached.
_MAX_CACHED = 4096


def _available() -> bool:
    try:
        return importlib.util.find_spec("nvtx") is not None
    except (ImportError, ValueError):
        return False


#: The one flag every call checks: the nvtx package is there and not switched off.
_enabled: bool = _available() and not env_off(ENV)


_domain: Any = None


_attrs: dict[tuple[str, Any], Any] = {}


_load_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_load_lock")


_NULL = contextlib.nullcontext()


def enabled() -> bool:
    """True when ctxkit emits NVTX ranges (the ``nvtx`` package is installed and neither
    ``CTXKIT_NVTX=0`` nor :func:`set_enabled` turned them off)."""
    return _enabled


def set_enabled(flag: bool = True) -> None:
    """Turn ctxkit's NVTX ranges on or off for the process (the default comes from the
    ``nvtx`` package being installed and ``CTXKIT_NVTX``).

    Functions decorated with :func:`annotate` while ranges were off stay undecorated.

    Raises
    ------
    ImportError
        ``flag`` is true and the ``nvtx`` package is not installed.
    """
    global _enabled
    if flag and not _available():
        raise ImportError(f"ctxkit NVTX ranges need the nvtx package: {_INSTALL_HINT}")
    _enabled = bool(flag)


def _load() -> Any:
    """The ``ctxkit`` NVTX domain (importing ``nvtx`` at the first use)."""
    global _domain, _enabled
    with _load_lock:
        if _domain is None:
            try:
                import nvtx

                _domain = nvtx.get_domain(DOMAIN)
                _domain.get_event_attributes  # noqa: B018 - the API ctxkit needs
            except Exception:
                _enabled = False
                _domain = None
                return None
    return _domain


def _attributes(name: str, color: Any) -> tuple[Any, Any]:
    """``(domain, event attributes)`` for *name*/*color*, cached."""
    dom = _domain or _load()
    if dom is None:
        return None, None
    key = (name, color)
    attrs = _attrs.get(key)
    if attrs is None:
        attrs = dom.get_event_attributes(message=name, color=color)
        if len(_attrs) < _MAX_CACHED:
            _attrs[key] = attrs
    return dom, attrs


@contextlib.contextmanager
def _pushed(name: str, color: Any) -> Iterator[None]:
    dom, attrs = _attributes(name, color)
    if dom is None:
        yield
        return
    dom.push_range(attrs)
    try:
        yield
    finally:
        dom.pop_range()


def range(name: str, color: Any = None) -> contextlib.AbstractContextManager[None]:
    """``with ctxkit.nvtx.range("h2d", color="green"):`` -- an NVTX range of the calling
    thread around the block (push/pop, domain ``ctxkit``).

    *color* is an NVTX color: a name the ``nvtx`` package knows (``"blue"``,
    ``"green"``, ...) or a 0xAARRGGBB int. Without NVTX: a shared no-op.
    """
    if not _enabled:
        return _NULL
    return _pushed(name, color)


def annotate(name: str | None = None, color: Any = None) -> Callable[[F], F]:
    """Decorator: every call of the function is an NVTX range named *name* (default:
    the function's qualified name). Without NVTX the function is returned unchanged."""

    def deco(fn: F) -> F:
        if not _enabled:
            return fn
        label: str = name or getattr(fn, "__qualname__", None) or repr(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _enabled:
                return fn(*args, **kwargs)
            with _pushed(label, color):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return deco


def start_range(name: str, color: Any = None) -> Any:
    """Start a range that may end in another thread; pass the result to
    :func:`end_range`. ``None`` without NVTX."""
    if not _enabled:
        return None
    dom, attrs = _attributes(name, color)
    return None if dom is None else dom.start_range(attrs)


def end_range(handle: Any) -> None:
    """End a range of :func:`start_range` (``None`` is ignored)."""
    if handle is None or _domain is None:
        return
    _domain.end_range(handle)


def mark(name: str, color: Any = None) -> None:
    """An instant NVTX marker (e.g. "kernel compiled")."""
    if not _enabled:
        return
    dom, attrs = _attributes(name, color)
    if dom is not None:
        dom.mark(attrs)
