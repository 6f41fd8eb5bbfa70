"""CUDA devices: enumeration and properties (``CUdevice``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from . import _driver
from ._driver import call, drv
from .errors import DriverNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from .context import Context

__all__ = ["Device", "device_count", "devices", "plan_partition", "sm_granularity"]


def device_count() -> int:
    """Number of CUDA devices visible to this process.

    Returns 0 (rather than raising) when there is no driver or no device, so code can
    branch on it; a process forked after CUDA initialisation still gets ``ForkError``.
    """
    try:
        _driver.init()
    except DriverNotFoundError:  # no bindings, no driver, or the driver sees no device
        return 0
    return int(call(drv.cuDeviceGetCount, what="cuDeviceGetCount"))


def devices() -> list[Device]:
    """All visible devices, in ordinal order."""
    return [Device(i) for i in range(device_count())]


class Device:
    """One CUDA device (``CUdevice``); ``Device(i)`` returns the same object for the same i.

    Parameters
    ----------
    ordinal : int
        Index in ``range(device_count())``.

    Raises
    ------
    ValueError
        The ordinal is out of range (the message names the valid range).
    """

    _instances: ClassVar[dict[int, Device]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    ordinal: int
    handle: Any

    def __new__(cls, ordinal: int | Device) -> Device:
        if isinstance(ordinal, Device):
            return ordinal
        dev = cls._instances.get(ordinal) if type(ordinal) is int else None
        if dev is not None:
            return dev
        if isinstance(ordinal, bool) or not isinstance(ordinal, int):
            raise TypeError(f"device ordinal must be an int, got {type(ordinal).__name__}")
        n = device_count()
        if n == 0:
            _driver.init()  # no driver -> DriverNotFoundError with the reason
        if not 0 <= ordinal < n:
            valid = f"0..{n - 1}" if n else "none: no CUDA device is visible"
            raise ValueError(f"device ordinal {ordinal} is out of range (valid: {valid})")
        with cls._lock:
            dev = cls._instances.get(ordinal)
            if dev is None:
                dev = object.__new__(cls)
                dev.ordinal = ordinal
                dev.handle = call(drv.cuDeviceGet, ordinal, what=f"cuDeviceGet({ordinal})")
                cls._instances[ordinal] = dev
        return dev

    def __reduce__(self) -> tuple[Any, ...]:
        return (Device, (self.ordinal,))

    def __int__(self) -> int:
        return self.ordinal

    def __index__(self) -> int:
        return self.ordinal

    def __repr__(self) -> str:
        return f"<Device {self.ordinal}: {self.name} ({self.arch})>"

    @cached_property
    def name(self) -> str:
        """Marketing name, e.g. ``"NVIDIA H200"``."""
        raw = call(drv.cuDeviceGetName, 256, self.handle, what="cuDeviceGetName")
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")

    @cached_property
    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)``, e.g. ``(9, 0)`` for Hopper."""
        major = self.attribute("compute_capability_major")
        return major, self.attribute("compute_capability_minor")

    @property
    def arch(self) -> str:
        """The NVRTC architecture name, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @cached_property
    def total_memory(self) -> int:
        """Device memory in bytes."""
        return int(call(drv.cuDeviceTotalMem, self.handle, what="cuDeviceTotalMem"))

    @cached_property
    def pci_bus_id(self) -> str:
        """PCI bus id in ``domain:bus:device.function`` form."""
        raw = call(drv.cuDeviceGetPCIBusId, 32, self.handle, what="cuDeviceGetPCIBusId")
        return bytes(raw).split(b"\0", 1)[0].decode()

    @cached_property
    def multiprocessor_count(self) -> int:
        """Number of SMs."""
        return self.attribute("multiprocessor_count")

    def attribute(self, name: str | Any) -> int:
        """Value of a device attribute by readable name (``"max_threads_per_block"``).

        The full enum name (``"CU_DEVICE_ATTRIBUTE_..."``) or the enum member also work.
        """
        attr = _driver.enum_member(
            drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_", name, "device attribute"
        )
        what = f"cuDeviceGetAttribute({name})"
        return int(call(drv.cuDeviceGetAttribute, attr, self.handle, what=what))

    def can_access_peer(self, other: Device | int) -> bool:
        """True when this device can map memory of *other* (``cuDeviceCanAccessPeer``)."""
        peer = Device(other)
        if peer.ordinal == self.ordinal:
            return False
        return bool(call(drv.cuDeviceCanAccessPeer, self.handle, peer.handle))

    @cached_property
    def sm_granularity(self) -> tuple[int, int]:
        """``(minimum, multiple)``: the SM counts a partition of this device can have
        (:meth:`partition`), as the driver reports them (``minSmPartitionSize``,
        ``smCoscheduledAlignment``, CUDA 13) or else by compute capability."""
        sm = _driver.sm_resource(self.handle).sm
        low, step = sm_granularity(self.compute_capability[0])
        return int(getattr(sm, "minSmPartitionSize", 0) or low), int(
            getattr(sm, "smCoscheduledAlignment", 0) or step
        )

    def partition(self, sm_counts: Sequence[int], *, remainder: bool = True) -> list[Context]:
        """Split the SMs into disjoint green contexts of at least *sm_counts* SMs each.

        Each count is rounded up to :attr:`sm_granularity`; with *remainder* the SMs left
        over (if any) are one more context, the last. One split: the contexts never share
        an SM. Each is a :class:`~ctxkit.Context` of ``kind == "green"`` with its
        ``sm_count``; ``close()`` destroys it.

        Raises
        ------
        ValueError
            The counts do not fit the device (the message gives its SM count and the
            granularity).
        CudaError
            The driver or cuda-bindings has no green contexts (``CUDA_ERROR_NOT_SUPPORTED``;
            the message names the minimum versions).
        """
        assert _partitioner is not None  # set by ctxkit.context, imported with ctxkit
        return _partitioner(self, list(sm_counts), remainder)


_driver.renew_at_fork(Device, "_lock")


#: ``fn(device, sm_counts, remainder)`` behind :meth:`Device.partition`: installed by
#: ``ctxkit.context`` (which imports this module; a Device cannot import Context).
_partitioner: Callable[[Device, list[int], bool], list[Context]] | None = None


def set_partitioner(fn: Callable[[Device, list[int], bool], list[Context]]) -> None:
    """Install the function that makes the green contexts of :meth:`Device.partition`."""
    global _partitioner
    _partitioner = fn


def sm_granularity(cc_major: int) -> tuple[int, int]:
    """``(minimum, multiple)`` SM count of a partition by compute capability major, where
    the driver does not report it: 8 and 8 on 9.x and later, 4 and 2 on 8.x, 2 and 2
    before."""
    if cc_major >= 9:
        return 8, 8
    return (4, 2) if cc_major == 8 else (2, 2)


def plan_partition(
    sm_counts: Sequence[int], total: int, minimum: int, multiple: int, where: str = "the device"
) -> list[int]:
    """The SM counts of a partition of *total* SMs: each request rounded up to at least
    *minimum* and to a *multiple*.

    Raises
    ------
    ValueError
        A count is not a positive int, or the rounded counts need more than *total* SMs
        (the message names *total* and the granularity).
    """
    counts = list(sm_counts)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"sm_counts must be a non-empty list of positive ints, got {sm_counts!r}")
    plan = [-(-max(c, minimum) // multiple) * multiple for c in counts]
    if sum(plan) > total:
        raise ValueError(
            f"cannot partition {where} into {counts} SMs: it has {total} SMs, and a "
            f"partition has at least {minimum} SMs in multiples of {multiple} (rounded: "
            f"{plan}, {sum(plan)} SMs)"
        )
    return plan
