"""Exception hierarchy of ctxkit and the mapping from a ``CUresult`` code to it.

Every failure of the driver, NVRTC or nvJitLink surfaces as a :class:`CudaError`
subclass whose message carries the CUDA error name, the driver's explanation and,
for the errors people meet most, what to do about it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

__all__ = [
    "CaptureOrderError",
    "CompileError",
    "ContextClosedError",
    "ContextInUseError",
    "ContextPoisonedError",
    "ContextStackError",
    "CudaError",
    "DriverNotFoundError",
    "ForkError",
    "GraphUpdateError",
    "LaunchArgumentError",
    "LaunchQueueError",
    "NoCurrentContextError",
    "OutOfMemoryError",
]


class CudaError(RuntimeError):
    """A CUDA driver, NVRTC or nvJitLink call failed.

    Attributes
    ----------
    code : int
        The numeric ``CUresult`` (or library status) value; 0 when no call failed
        (ctxkit detected the problem itself).
    name : str
        The CUDA name of the error, e.g. ``"CUDA_ERROR_INVALID_CONTEXT"``.
    """

    def __init__(self, message: str, code: int = 0, name: str = "") -> None:
        super().__init__(message)
        self.code = int(code)
        self.name = name


class DriverNotFoundError(CudaError):
    """No usable NVIDIA driver (``libcuda``) or no ``cuda-bindings`` installation."""


class NoCurrentContextError(CudaError):
    """The calling thread has no current context where ctxkit needs one."""


class ContextStackError(CudaError):
    """The thread's context stack is not what ctxkit expected (foreign push/pop)."""


class ContextClosedError(CudaError):
    """A closed context (or an object of one) was used."""


class ContextInUseError(CudaError):
    """A context cannot be closed while it is current in some thread."""


class OutOfMemoryError(CudaError, MemoryError):
    """An allocation did not fit on the device (or in page-locked host memory)."""


class CompileError(CudaError):
    """NVRTC or nvJitLink rejected a program; ``.log`` holds the full compiler log."""

    def __init__(self, message: str, log: str = "", code: int = 0, name: str = "") -> None:
        super().__init__(message, code, name)
        self.log = log


class ContextPoisonedError(CudaError):
    """A sticky error (illegal address, trap, ...) left the context unusable.

    Every later use of the faulting context raises this error at once. The damage is not
    confined to that context: on current drivers (observed: 580 / CUDA 13.0) every later
    CUDA call in the process fails with the same error, in every context on every device,
    primary or owned, even with no context current. An owned context does not isolate a
    fault; a process does. To keep other devices working, run device work in separate
    processes (:func:`ctxkit.procs.run_per_device`, or :class:`ctxkit.procs.DevicePool`,
    which replaces a faulted worker) and restart the process (or the worker) after a
    fault. tests/core/test_sticky_gpu.py checks this behaviour on the real driver.
    """


class ForkError(CudaError):
    """CUDA was used in a process forked after its parent initialised CUDA."""


class WrongContextError(CudaError, ValueError):
    """An object of one context (a stream, buffer, event) was used with another context
    (by default ``CUDA_ERROR_INVALID_HANDLE``, what the driver would answer)."""

    def __init__(
        self, message: str, code: int = 400, name: str = "CUDA_ERROR_INVALID_HANDLE"
    ) -> None:
        super().__init__(message, code, name)


class LaunchArgumentError(CudaError, TypeError):
    """Kernel arguments do not match the kernel's parameter list."""


# Codes from the CUDA driver API (cuda.h), by number with their names beside them, so the
# mapping also works (and can be tested) on a machine where the driver library is absent.
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100

#: Sticky errors: the context (and, on current drivers, the process) cannot be used again.
#: ILLEGAL_ADDRESS 700, HARDWARE_STACK_ERROR 714, ILLEGAL_INSTRUCTION 715,
#: MISALIGNED_ADDRESS 716, INVALID_ADDRESS_SPACE 717, INVALID_PC 718, LAUNCH_FAILED 719,
#: ASSERT 710, ECC_UNCORRECTABLE 214.
STICKY_CODES = frozenset({700, 714, 715, 716, 717, 718, 719, 710, 214})

_CLASS_FOR_CODE: dict[int, type[CudaError]] = {
    2: OutOfMemoryError,  # CUDA_ERROR_OUT_OF_MEMORY
    201: NoCurrentContextError,  # CUDA_ERROR_INVALID_CONTEXT
    709: ContextClosedError,  # CUDA_ERROR_CONTEXT_IS_DESTROYED
    216: ContextInUseError,  # CUDA_ERROR_CONTEXT_ALREADY_IN_USE
    34: DriverNotFoundError,  # CUDA_ERROR_STUB_LIBRARY
    36: DriverNotFoundError,  # CUDA_ERROR_REQUIRES_NEWER_DRIVER
    **dict.fromkeys(STICKY_CODES, ContextPoisonedError),
}

_HINTS: dict[int, str] = {
    CUDA_ERROR_NOT_INITIALIZED: "the driver is not initialised in this process; call ctxkit APIs "
    "(they initialise it) rather than raw cuda.bindings calls first",
    # CUDA_ERROR_OUT_OF_MEMORY
    2: "free buffers you no longer need (close() them), use smaller chunks, "
    "or pick a device with more free memory",
    CUDA_ERROR_NO_DEVICE: "no CUDA device is visible; check nvidia-smi and CUDA_VISIBLE_DEVICES",
    # CUDA_ERROR_INVALID_DEVICE
    101: "use an ordinal in range(ctxkit.device_count())",
    # CUDA_ERROR_INVALID_CONTEXT
    201: "this thread has no current context; use `with ctx:` or "
    "`with ctxkit.bind(device_or_ctx):` in the thread that does the work",
    # CUDA_ERROR_CONTEXT_IS_DESTROYED
    709: "the context was destroyed; create a new one and reallocate its resources",
    # CUDA_ERROR_CONTEXT_ALREADY_IN_USE
    216: "the context is current in another thread in exclusive "
    "compute mode; share it through ctxkit.registry instead",
    # CUDA_ERROR_UNSUPPORTED_PTX_VERSION
    222: "the PTX came from an NVRTC newer than the driver; compile "
    "with target='cubin' (or 'auto'), or upgrade the driver",
    # CUDA_ERROR_NO_BINARY_FOR_GPU
    209: "the module has no code for this GPU; compile for its arch "
    "(ctxkit.compile(..., arch=None) picks the current device)",
    # CUDA_ERROR_INVALID_PTX
    218: "the PTX failed to JIT-compile; see the JIT log in this message",
    # CUDA_ERROR_NOT_FOUND
    500: "the named symbol is not in the module; check the name "
    '(extern "C" or name_expressions for C++ templates)',
    # CUDA_ERROR_INVALID_HANDLE
    400: "the handle belongs to another context or was already freed; use "
    "objects inside the context that created them",
    # CUDA_ERROR_STUB_LIBRARY
    34: "libcuda is the toolkit's stub, not a real driver; install the NVIDIA "
    "driver or fix LD_LIBRARY_PATH",
    # CUDA_ERROR_REQUIRES_NEWER_DRIVER
    36: "this call needs a newer driver than the installed one; upgrade "
    "the driver or install the cu12 extra (cuda-bindings 12.x)",
    # CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    701: "the launch needs more registers or shared memory than the "
    "device has per block; use a smaller block",
    # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    704: "peer access is already on (ctxkit.enable_peer_access is idempotent)",
    # CUDA_ERROR_DEINITIALIZED
    4: "the driver is shutting down (interpreter exit)",
    **dict.fromkeys(
        STICKY_CODES,
        "a kernel faulted and poisoned the context; on current drivers (observed: 580 / "
        "CUDA 13.0) every other context in the process, on every device, fails too. Restart "
        "the process (or the ctxkit.procs worker); to keep other devices working, run device "
        "work in separate processes (ctxkit.procs.run_per_device / DevicePool). Find the "
        "faulting access with compute-sanitizer",
    ),
}


def error_class_for(code: int) -> type[CudaError]:
    """Return the :class:`CudaError` subclass that represents *code*."""
    return _CLASS_FOR_CODE.get(int(code), CudaError)


def from_result(
    code: int, what: str = "", detail: str = "", *, name: str = "", text: str = ""
) -> CudaError:
    """Build the exception for a failed call (pure: no driver call).

    Parameters
    ----------
    code : int
        The non-zero ``CUresult``.
    what : str
        The call that failed, with the arguments worth showing.
    detail : str
        Extra context (JIT log, thread, device), appended as is.
    name, text : str
        The code's CUDA name and explanation (``ctxkit._driver.describe`` asks the
        driver); without a name, ``"CUresult <code>"``.
    """
    code = int(code)
    name = name or f"CUresult {code}"
    head = f"{what} failed: {name}" if what else name
    hint = _HINTS.get(code)
    lines = [f"{head} ({text})" if text else head, f"Fix: {hint}." if hint else "", detail]
    return error_class_for(code)("\n".join(line for line in lines if line), code, name)


class KernelCacheWarning(UserWarning):
    """The kernel cache directory cannot be used (not writable, or open to other users);
    kernels compile without the disk cache."""


class PtxVersionWarning(UserWarning):
    """PTX was produced by an NVRTC newer than the driver, which will refuse to load it."""


class PinLeakWarning(UserWarning):
    """Host pages ctxkit page-locked on its own (pin on reuse) could not be unlocked: they
    stay locked, and their memory allocated, until the process exits. Shown for each leak."""


class PageableCopyWarning(UserWarning):
    """An asynchronous copy was asked for with pageable host memory (it will block)."""


class PageableCopyError(ValueError):
    """Strict async mode: an asynchronous copy with pageable host memory was refused."""


class KernelNotFoundError(CudaError, LookupError):
    """The module has no kernel of that name (the message lists those it has)."""


@dataclass(eq=False, repr=False)
class PipelineError(CudaError):
    """A failure inside a pipeline run, naming the device, chunk (or stage) and step.

    Attributes
    ----------
    device : int
        Ordinal of the device the failing work ran on.
    chunk : int or None
        Index of the chunk (``None`` for a :meth:`Pipeline.submit` stage).
    step : str
        ``"h2d"``, ``"kernel"``, ``"d2h"``, ``"fill"``, ``"drain"``, ``"setup"``, ``"stage"``...
    poisoned : bool
        True when the device's context is poisoned (a kernel faulted): the pipeline
        cannot be used again and says so.

    The original exception is ``__cause__``; ``code``/``name`` are copied from it.
    """

    message: str
    device: int = -1
    chunk: int | None = None
    step: str = ""
    cause: InitVar[BaseException | None] = None
    poisoned: bool = False

    def __post_init__(self, cause: BaseException | None) -> None:
        code, name = (cause.code, cause.name) if isinstance(cause, CudaError) else (0, "")
        CudaError.__init__(self, self.message, code, name)
        if cause is not None:
            self.__cause__ = cause


class BlockIdentityError(RuntimeError):
    """A shared-memory name of ``ctxkit.procs`` no longer holds the block its sender made:
    another process re-created it. The block is neither read nor unlinked."""


@dataclass(eq=False, repr=False)
class DeviceTaskError(CudaError):
    """Work for one device failed in its child process.

    A subclass of :class:`~ctxkit.errors.CudaError` (itself a ``RuntimeError``) so that
    ``except ctxkit.CudaError`` around multi-GPU work also sees a failed device; when the
    child's exception was a ``CudaError`` its ``code`` and ``name`` are carried over
    (e.g. ``CUDA_ERROR_ILLEGAL_ADDRESS``).

    Attributes
    ----------
    device : int
        Logical device ordinal (as the parent numbers devices).
    kind : str
        ``"exception"`` (the function raised), ``"crash"`` (the process died without a
        result: signal, ``os._exit``, native crash), ``"timeout"``, ``"init"`` (a pool
        worker could not start) or ``"terminated"`` (the pool was stopped under the task).
    pid, exitcode : int or None
        The child process and how it ended (negative exit code: killed by that signal).
    traceback : str
        The child's formatted traceback (empty when the child sent none).
    exception_type : str
        Qualified name of the child's exception class (empty when there was none).
    child_exception : BaseException or None
        The child's exception object, when it could be pickled.
    attempts : int
        Processes started for this device's work (``retries + 1`` when all failed).
    results : list
        ``run_per_device`` only: every device's result in device order, ``None`` for the
        devices that failed.
    failures : dict[int or Context, DeviceTaskError]
        ``run_per_device`` only: the error of every failed device, by ordinal (by the
        Context given, for a lane: a green or owned context; a pickled copy keys a lane
        by the context's ``str()``, since a context does not leave its process).
    """

    message: str
    _: KW_ONLY
    device: int
    kind: str
    pid: int | None = None
    exitcode: int | None = None
    traceback: str = ""
    exception_type: str = ""
    child_exception: BaseException | None = None
    attempts: int = 1
    code: int = 0
    name: str = ""
    results: list[Any] = field(default_factory=list, init=False)
    failures: dict[Any, DeviceTaskError] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        CudaError.__init__(self, self.message, self.code, self.name)

    def __reduce__(self) -> tuple[Any, ...]:
        lanes = {k if isinstance(k, int) else str(k): v for k, v in self.failures.items()}
        return (_rebuild_task_error, (str(self),), {**self.__dict__, "failures": lanes})


def _rebuild_task_error(message: str) -> DeviceTaskError:
    err = DeviceTaskError.__new__(DeviceTaskError)
    Exception.__init__(err, message)
    return err


class LaunchQueueError(CudaError):
    """A launch handed to a :class:`~ctxkit.LaunchQueue` failed in the queue's thread.

    Raised in the thread that submitted the launch, at its next ``submit``, ``flush`` or
    ``close``. The launch's exception is ``__cause__`` (``code``/``name`` copied from a
    ``CudaError``).

    Attributes
    ----------
    dropped : int
        Launches the same thread submitted after the failed one, which were not issued
        (they may have depended on it).
    """

    def __init__(self, message: str, cause: BaseException, dropped: int) -> None:
        code, name = (cause.code, cause.name) if isinstance(cause, CudaError) else (0, "")
        super().__init__(message, code, name)
        self.__cause__ = cause
        self.dropped = dropped


class CaptureOrderError(CudaError):
    """A foreign array's producer stream cannot be ordered before a capturing stream (it
    captures into another graph, or the capture was begun outside ctxkit); the message
    says how to order it."""


class GraphUpdateError(CudaError):
    """``GraphExec.update`` was refused: the graph differs from the executable graph in a
    way ``cuGraphExecUpdate`` cannot apply.

    Attributes
    ----------
    reason : str
        The ``CUgraphExecUpdateResult`` in lower case without its prefix:
        ``"topology_changed"``, ``"node_type_changed"``, ``"function_changed"``,
        ``"parameters_changed"``, ``"not_supported"``, ...
    node : GraphNode or None
        The node of the new graph the driver named (also in the message).
    """

    def __init__(
        self, message: str, code: int = 0, name: str = "", *, reason: str = "", node: Any = None
    ) -> None:
        super().__init__(message, code, name)
        self.reason = reason
        self.node = node
