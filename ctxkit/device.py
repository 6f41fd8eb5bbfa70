"""CUDA devices: enumeration and properties (``CUdevice``)."""

from __future__ import annotations

import threading
from functools import cached_property
from typing import Any, ClassVar

from . import _driver
from ._driver import call, drv
from .errors import DriverNotFoundError

__all__ = ["Device", "device_count", "devices"]


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


_driver.renew_at_fork(Device, "_lock")
