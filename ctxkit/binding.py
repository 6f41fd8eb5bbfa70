"""One shared context per device, usable from any thread.

The classic Driver-API bug: a context created in the main thread is used from a worker
thread, and the driver answers ``CUDA_ERROR_INVALID_CONTEXT`` because the current
context is per thread. ctxkit's answer:

* :data:`registry` (``ctxkit.registry``) hands out one context per device (primary by
  default);
* :func:`bind` / :func:`bound` make it current in whatever thread runs the code;
* :class:`ContextExecutor` runs every task with the context current;
* a thread with no context gets :class:`NoCurrentContextError` naming the fix, before
  the driver would answer ``INVALID_CONTEXT``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

from . import _driver
from ._env import env_flag
from .context import Context, current_handle, no_context_error, require_current, thread_bindings
from .device import Device

__all__ = ["ContextLike", "ContextRegistry", "bind", "bound", "registry"]


P = ParamSpec("P")


R = TypeVar("R")


ContextLike = Context | Device | int


class ContextRegistry:
    """One shared context per device, created on first use (thread-safe).

    Parameters
    ----------
    kind : {"primary", "owned"}
        ``"primary"`` (default) shares the device's primary context with PyTorch, CuPy
        and Numba; ``"owned"`` creates a private context per device with ``flags``.
    flags : int
        ``CUctx_flags`` for owned contexts.
    strict : bool, optional
        Objects that know their context (buffers, streams, events, modules, kernels) bind
        it for each operation, from any thread, as CuPy, Numba and PyTorch do. With
        ``strict`` an operation in a thread with *no* current context raises
        :class:`NoCurrentContextError` instead, for framework authors who want every
        implicit bind to be an error. Default: the ``CTXKIT_STRICT_CONTEXT`` environment
        variable (off).
    """

    def __init__(self, kind: str = "primary", flags: int = 0, strict: bool | None = None):
        if kind not in ("primary", "owned"):
            raise ValueError(f"kind must be 'primary' or 'owned', not {kind!r}")
        self.kind = kind
        self.flags = flags
        self.strict = env_flag("CTXKIT_STRICT_CONTEXT") if strict is None else bool(strict)
        self._contexts: dict[int, Context] = {}
        self._created: list[Context] = []
        self._lock = threading.Lock()

    def context(self, device: Device | int = 0) -> Context:
        """The shared context of *device* (created once; later calls take no lock)."""
        ordinal = device if type(device) is int else Device(device).ordinal
        ctx = self._contexts.get(ordinal)
        if ctx is not None and not ctx.closed:
            return ctx
        dev = Device(ordinal)
        _driver.check_fork(f"registry.context({ordinal})")
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None or ctx.closed:
                primary = self.kind == "primary"
                ctx = Context.primary(dev) if primary else Context.create(dev, flags=self.flags)
                self._contexts[ordinal] = ctx
                self._created.append(ctx)
        return ctx

    def set(self, device: Device | int, ctx: Context) -> None:
        """Register a context the caller made as the shared one for *device*.

        The registry never closes a context registered this way.
        """
        dev = Device(device)
        if not isinstance(ctx, Context):
            raise TypeError(f"expected a ctxkit.Context, got {type(ctx).__name__}")
        if ctx.device.ordinal != dev.ordinal:
            raise ValueError(
                f"{ctx!r} belongs to device {ctx.device.ordinal}, not device {dev.ordinal}"
            )
        ctx.check_usable()
        _driver.check_fork("registry.set")
        with self._lock:
            self._contexts[dev.ordinal] = ctx

    def resolve(self, target: ContextLike) -> Context:
        """A Context for a Context, Device or ordinal (the shared one of a device)."""
        if isinstance(target, Context):
            return target
        if type(target) is int or isinstance(target, Device):
            return self.context(target)
        raise TypeError(
            f"expected a ctxkit.Context, ctxkit.Device or device ordinal, "
            f"got {type(target).__name__}"
        )

    def contexts(self) -> dict[int, Context]:
        """The registered contexts by device ordinal (open ones only)."""
        return {k: c for k, c in self._contexts.items() if not c.closed}

    def bindings(self) -> dict[str, list[Context]]:
        """Which threads have which contexts bound by ctxkit right now."""
        return thread_bindings()

    def close(self, *, quiet: bool = False) -> None:
        """Close what this registry created, newest first. Safe to call twice.

        ``quiet``: a context that fails to close is skipped (interpreter exit).
        """
        _driver.check_fork("registry.close")
        with self._lock:
            created, self._created = self._created, []
            self._contexts = {k: c for k, c in self._contexts.items() if c not in created}
        for ctx in reversed(created):
            try:
                ctx.close()
            except Exception:
                if not quiet:
                    raise


#: The process-wide registry (primary contexts): ``ctxkit.registry``.
registry = ContextRegistry()
_driver.renew_at_fork(__name__, "registry._lock")


def resolve_context(target: ContextLike | None, what: str) -> Context:
    """The context an operation or a new resource uses: *target*, or the current one.

    The one resolver of "a Context from a Context, Device, ordinal or ``None``": ``None``
    means the calling thread's current context (:class:`NoCurrentContextError` naming the
    fix when it has none); a Device or ordinal means the registry's context of that device.
    The context must be usable (not closed, not poisoned).
    """
    ctx = require_current(what) if target is None else registry.resolve(target)
    ctx.check_usable()
    return ctx


def check_devices(
    devices: Sequence[ContextLike] | None, what: str, *, lanes: bool = False
) -> list[ContextLike] | None:
    """Validate a list of devices (ordinals, Devices and Contexts).

    The one check of a ``devices=`` argument: a sequence (not a single device), not empty,
    no negative ordinal, no device twice -- with *lanes*, distinct contexts of one device
    (green partitions, owned contexts) may be listed, each a lane; the same context twice
    is refused. ``None`` (all visible devices) passes through.
    """
    if devices is None:
        return None
    kinds = (int, Device, Context)
    if isinstance(devices, kinds):
        raise TypeError(f"{what}: devices must be a sequence, e.g. devices=[0] or devices=[0, 1]")
    specs = list(devices)
    if not specs:
        raise ValueError(
            f"{what} needs at least one device; devices=[] was given (use devices=None "
            "for all visible devices)"
        )
    seen: set[tuple[bool, int]] = set()
    for d in specs:
        if isinstance(d, bool) or not isinstance(d, kinds):
            raise TypeError(f"{what}: devices must hold ints, Devices or Contexts, got {d!r}")
        if isinstance(d, int) and d < 0:
            raise ValueError(f"{what}: device ordinals are >= 0, got {d}")
        if isinstance(d, Context):
            key = (True, d.handle) if lanes else (False, d.device.ordinal)
        else:
            key = (False, int(d))
        if key in seen:
            name = f"context {d!r}" if key[0] else f"device {key[1]}"
            raise ValueError(f"{what}: {name} is listed twice in devices={specs!r}")
        seen.add(key)
    return specs


def bind(target: ContextLike) -> Context:
    """Make a context current in the calling thread for a ``with`` block.

    ``with ctxkit.bind(0): ...`` binds the registry's context for device 0; a Context
    binds itself. Already current -> no driver call. Nestable, exception-safe; the
    previous context is restored on exit. Returns the Context itself (``bind(x)`` also
    resolves *x* without binding it).
    """
    if type(target) is Context:  # the hot path: no call
        return target
    return registry.resolve(target)


def bound(target: ContextLike) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run the function with *target*'s context bound (resolved per call)."""

    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with bind(target):
                return fn(*args, **kwargs)

        return wrapper

    return deco


def guard(owner: Context, what: str) -> Context:
    """The context to bind for an operation on an object owned by *owner*.

    Returns *owner* (use it as ``with guard(owner, "..."):``): objects always act in their
    own context, whatever the thread has current. In strict mode
    (``ck.registry.strict = True``) a thread with no current context at all gets
    :class:`NoCurrentContextError` instead of an implicit bind.
    """
    if registry.strict and not current_handle():
        raise no_context_error(what)
    return owner
