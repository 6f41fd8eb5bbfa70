"""Prepared launches: arguments checked and packed once, the cheapest repeated launch.

:meth:`Kernel.prepare <ctxkit.module.kernel.Kernel.prepare>` makes a
:class:`PreparedLaunch`; calling it is one thread-local check and one driver call
(``cuLaunchKernel``, or ``cuLaunchKernelEx`` with its launch attributes prebuilt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._driver import drv
from ..binding import guard
from ..context import Context
from ..context import _tls as _thread_local
from ..errors import CudaError
from ..memory.interop import order_after_producers
from ..stream import implicit_stream, stream_for
from .launch import LaunchConfig, native_config, normalize_dims, shared_mem_arg
from .memargs import foreign_arrays
from .params import ParamBuffer

if TYPE_CHECKING:
    from .kernel import Kernel

__all__ = ["PreparedLaunch"]


class PreparedLaunch:
    """A launch with its arguments packed once; ``pl()`` launches it again.

    Made by :meth:`Kernel.prepare`. It belongs to one context; calling it from a thread
    where another context is current binds that context for the call. It keeps
    references to its arguments, so buffers stay alive as long as it does.

    Attributes
    ----------
    grid, block : tuple of 3 ints
    shared_mem : int
    config : LaunchConfig
        Its launch attributes (empty: a plain ``cuLaunchKernel``).
    context : Context
    """

    __slots__ = (
        "_args",
        "_buf",
        "_call",
        "_consumer",
        "_kernel",
        "_launch",
        "_module",
        "_raw",
        "_stream",
        "block",
        "config",
        "context",
        "grid",
        "shared_mem",
    )

    def __init__(
        self,
        kernel: Kernel,
        ctx: Context,
        func: Any,
        grid: Any,
        block: Any,
        args: tuple[Any, ...],
        stream: Any,
        shared_mem: int,
        cfg: LaunchConfig,
    ) -> None:
        packer = kernel._require_packer()
        self._kernel = kernel
        self._module = kernel.module
        self.context = ctx
        self.grid = normalize_dims(grid, "grid")
        self.block = normalize_dims(block, "block")
        self.shared_mem = shared_mem_arg(shared_mem, kernel.name)
        self.config = cfg
        self._buf = ParamBuffer(packer.sig)
        packer.pack_into(self._buf, args, ctx)
        self._args = list(args)
        hs = stream_for(stream, ctx, "launch")
        self._stream = hs
        self._consumer = stream if stream is not None else implicit_stream(ctx)
        if cfg.empty:
            self._launch = drv.cuLaunchKernel
            self._call: tuple[Any, ...] = (
                func,
                *self.grid,
                *self.block,
                self.shared_mem,
                hs,
                self._buf.address,
                0,
            )
        else:
            kernel._check_config(ctx, func, self.grid, self.block, self.shared_mem, cfg)
            native = native_config(self.grid, self.block, self.shared_mem, hs, cfg.attributes())
            self._launch = drv.cuLaunchKernelEx
            self._call = (native, func, self._buf.address, 0)
        self._raw = self._launch
        self._wire()

    def _wire(self) -> None:
        """Order after the producers of foreign arguments at each call, only if there are any."""
        foreign = foreign_arrays(self._args)
        if not foreign:
            self._launch = self._raw
            return
        raw, ctx, consumer = self._raw, self.context, self._consumer
        hs = int(self._stream)

        def ordered_launch(*call: Any) -> Any:
            order_after_producers(foreign, hs, ctx, consumer)
            return raw(*call)

        self._launch = ordered_launch

    def __call__(self) -> None:
        """Launch (no argument packing; the context is checked in thread-local state)."""
        if _thread_local.s.top is not self.context or self._module.closed:
            return self._call_slow()
        (err,) = self._launch(*self._call)
        if err:
            raise self._error(int(err))

    def _call_slow(self) -> None:
        self._module._check_open()
        with guard(self.context, f"PreparedLaunch of {self._kernel.name!r}"):
            (err,) = self._launch(*self._call)
            if err:
                raise self._error(int(err))

    def _error(self, code: int) -> CudaError:
        func = self._call[0] if self.config.empty else self._call[1]
        return self._kernel._launch_error(
            code, self.context, func, self.grid, self.block, self.shared_mem, self.config
        )

    def set_arg(self, key: int | str, value: Any) -> None:
        """Replace one argument (by index or PTX parameter name), checked like a launch."""
        packer = self._kernel._require_packer()
        i = packer.index_of(key)
        packer.pack_one(self._buf, i, value, self.context)
        self._args[i] = value
        self._wire()

    @property
    def args(self) -> tuple[Any, ...]:
        """The current arguments."""
        return tuple(self._args)

    def __repr__(self) -> str:
        options = f" {self.config.describe()}" if not self.config.empty else ""
        return (
            f"<PreparedLaunch {self._kernel.name} grid={self.grid} block={self.block}"
            f"{options} in {self.context!r}>"
        )
