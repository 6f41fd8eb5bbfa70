"""Node builders of :class:`~ctxkit.graph.graph.Graph` for the nodes that do one thing:
kernel, memcpy, memset, host, event record, event wait and empty nodes.

:class:`NodeBuilders` is a base class of ``Graph``. Each builder checks its arguments and
builds the node's parameters (with :mod:`ctxkit.graph.nodes`) before anything reaches the
driver, then adds the node with ``Graph._add``. The nodes that hold other graphs (child
graphs, conditional bodies) need ``Graph`` itself and are built there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._driver import drv
from ..binding import guard
from ..errors import WrongContextError
from ..stream import Event
from .host import HOST_FN_ADDR, HostCallback
from .nodes import (
    GraphNode,
    HostSide,
    copy_nbytes,
    copy_side,
    kernel_spec,
    memcpy_params,
    memset_params,
)

if TYPE_CHECKING:
    from ..context import Context
    from ..module.kernel import Kernel
    from .nodes import KernelSpec

__all__ = ["NodeBuilders"]

_INVALID_HANDLE = 400


class NodeBuilders:
    """The builders of kernel, memcpy, memset, host, event and empty nodes of a
    :class:`~ctxkit.graph.graph.Graph` (its base class)."""

    if TYPE_CHECKING:
        context: Context
        _callbacks: list[HostCallback]

        def _open(self, what: str) -> Any: ...

        def _add(
            self,
            what: str,
            fn: Any,
            *params: Any,
            depends_on: Any,
            kind: str,
            keep: tuple[Any, ...] = (),
            spec: KernelSpec | None = None,
        ) -> GraphNode: ...

    def kernel(
        self,
        kernel: Kernel,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        *args: Any,
        shared_mem: int = 0,
        depends_on: Any = None,
    ) -> GraphNode:
        """A kernel node (``cuGraphAddKernelNode``); arguments as for ``Kernel.launch``.

        The arguments are checked and packed now, exactly as a launch would, and kept
        (with the buffers among them) while the graph or an executable graph of it lives.
        A :class:`~ctxkit.graph.conditional.ConditionalHandle` passes as its value.

        Raises
        ------
        LaunchArgumentError
            The arguments do not fit the kernel's parameters (named in the message).
        CudaError
            The kernel's module is bound to another context, or is closed.
        """
        what = f"Graph.kernel({getattr(kernel, 'name', kernel)!r})"
        self._open(what)
        ctx = self.context
        with guard(ctx, what):
            spec = kernel_spec(kernel, ctx, grid, block, args, shared_mem)
            params = spec.params(ctx)
        return self._add(
            what,
            drv.cuGraphAddKernelNode,
            params,
            depends_on=depends_on,
            kind="kernel",
            spec=spec,
        )

    def memcpy(
        self, dst: Any, src: Any, nbytes: int | None = None, *, depends_on: Any = None
    ) -> GraphNode:
        """A copy node (``cuGraphAddMemcpyNode``): device to device, pinned host to
        device or device to pinned host.

        *dst* and *src* are ctxkit buffers/arrays (of the graph's context), other
        libraries' device arrays (``__cuda_array_interface__``) or page-locked numpy
        arrays (``ck.pinned_empty``, ``ck.register_host``). *nbytes* defaults to the size
        both sides share.

        Raises
        ------
        PageableCopyError
            A numpy array is pageable: graphs copy host memory asynchronously.
        WrongContextError
            A ctxkit buffer belongs to another context.
        ValueError
            Sizes differ (without *nbytes*), *nbytes* exceeds a side, or nothing to copy.
        """
        what = "Graph.memcpy"
        ctx = self.context
        self._open(what)
        d = copy_side(dst, ctx, what, "destination", write=True)
        s = copy_side(src, ctx, what, "source", write=False)
        if isinstance(d, HostSide) and isinstance(s, HostSide):
            raise ValueError(f"{what}: both sides are host memory; copy them with numpy")
        n = copy_nbytes(d, s, nbytes, what)
        if n == 0:
            raise ValueError(
                f"{what}: nothing to copy (0 bytes); use graph.empty() for a node that does nothing"
            )
        return self._add(
            what,
            drv.cuGraphAddMemcpyNode,
            memcpy_params(d, s, n),
            ctx._cu,
            depends_on=depends_on,
            kind="memcpy",
            keep=(dst, src),
        )

    def memset(
        self,
        dst: Any,
        value: int,
        count: int | None = None,
        element_size: int = 1,
        *,
        depends_on: Any = None,
    ) -> GraphNode:
        """A memset node (``cuGraphAddMemsetNode``): *count* elements of *element_size*
        (1, 2 or 4) bytes of device memory *dst* set to *value* (the element's bit
        pattern); *count* defaults to the whole of *dst*."""
        what = "Graph.memset"
        ctx = self.context
        self._open(what)
        if not hasattr(dst, "__cuda_array_interface__") and not hasattr(dst, "_ctxkit_mem"):
            raise TypeError(
                f"{what}: dst must be device memory (a ctxkit buffer/array or a device "
                f"array of another library), got {type(dst).__name__}"
            )
        mem = copy_side(dst, ctx, what, "destination", write=True)
        assert not isinstance(mem, HostSide)
        params = memset_params(mem, value, count, element_size, what)
        if not params.width:
            raise ValueError(f"{what}: nothing to set (0 elements)")
        return self._add(
            what,
            drv.cuGraphAddMemsetNode,
            params,
            ctx._cu,
            depends_on=depends_on,
            kind="memset",
            keep=(dst,),
        )

    def host(self, fn: Any, *args: Any, depends_on: Any = None) -> GraphNode:
        """A host node (``cuGraphAddHostNode``): ``fn(*args)`` runs on a driver thread at
        every launch, when the nodes it depends on have completed.

        ``fn`` must not call CUDA. An exception it raises is re-raised by the next
        ``synchronize()`` of the ctxkit stream the graph was launched on (logged for
        other streams). ``fn`` stays alive while the graph or an executable graph of it
        does.
        """
        what = "Graph.host"
        if not callable(fn):
            raise TypeError(f"{what}: fn must be callable, got {type(fn).__name__}")
        self._open(what)
        cb = HostCallback(fn, args)
        params = drv.CUDA_HOST_NODE_PARAMS()
        params.fn = drv.CUhostFn(HOST_FN_ADDR)
        params.userData = cb.key
        node = self._add(
            what, drv.cuGraphAddHostNode, params, depends_on=depends_on, kind="host", keep=(cb,)
        )
        self._callbacks.append(cb)
        return node

    def _event(self, event: Any, what: str, *, same_context: bool) -> Any:
        if not isinstance(event, Event):
            raise TypeError(f"{what}: expected a ctxkit.Event, got {type(event).__name__}")
        handle = event._open_handle(what)
        if same_context and event.context.handle != self.context.handle:
            raise WrongContextError(
                f"{what}: {event!r} belongs to {event.context!r}, but the graph belongs to "
                f"{self.context!r}; create the event in the graph's context "
                "(ck.Event(context=graph.context))",
                _INVALID_HANDLE,
                "CUDA_ERROR_INVALID_HANDLE",
            )
        return handle

    def event_record(self, event: Event, *, depends_on: Any = None) -> GraphNode:
        """An event record node (``cuGraphAddEventRecordNode``); *event* must belong to
        the graph's context."""
        return self._event_node(event, depends_on, "event_record", same_context=True)

    def event_wait(self, event: Event, *, depends_on: Any = None) -> GraphNode:
        """An event wait node (``cuGraphAddEventWaitNode``): the nodes after it wait for
        the work before *event*'s latest record (of any context)."""
        return self._event_node(event, depends_on, "event_wait", same_context=False)

    def _event_node(
        self, event: Event, depends_on: Any, kind: str, *, same_context: bool
    ) -> GraphNode:
        what = f"Graph.{kind}"
        handle = self._event(event, what, same_context=same_context)
        add = (
            drv.cuGraphAddEventRecordNode if kind == "event_record" else drv.cuGraphAddEventWaitNode
        )
        return self._add(what, add, handle, depends_on=depends_on, kind=kind, keep=(event,))

    def empty(self, *, depends_on: Any = None) -> GraphNode:
        """A node that does nothing (``cuGraphAddEmptyNode``): a join point of edges."""
        return self._add(
            "Graph.empty", drv.cuGraphAddEmptyNode, depends_on=depends_on, kind="empty"
        )
