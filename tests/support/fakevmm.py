"""The memory fake of tests/support/fakemem.py extended with what issue 17's memory
features call: virtual memory management, legacy IPC handles, POSIX file-descriptor
export, page-lock flags, peer-access disabling and device attributes.

Virtual memory is simulated honestly enough to catch ordering mistakes: an address range
from ``cuMemAddressReserve`` is real host memory (so the copy fakes work on it), a
physical chunk from ``cuMemCreate`` keeps its bytes while it is unmapped, moved, or mapped
by an "importing process", and the fake refuses what the driver refuses (mapping outside
a reservation or over a mapping, freeing a range that is still mapped, releasing a handle
twice, copies through memory the current device has no access to). Import the fixtures
into a test module: ``from tests.support.fakevmm import vfake, vctx0, vctx1  # noqa: F401``.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import tempfile
from typing import Any

import pytest
from cuda.bindings import driver as real

import ctxkit as ck
from ctxkit.context import Context
from ctxkit.memory import host as _hostmem
from ctxkit.memory import ipc as _ipc
from ctxkit.memory import vmm as _vmm  # noqa: F401 - patched by swap_driver
from tests.support.fakedriver import FakeHandle
from tests.support.fakemem import FakeMemDriver, install

OK = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
INVALID_CONTEXT = 201
MAP_FAILED = 205
INVALID_HANDLE = 400
PEER_NOT_ENABLED = 705
NOT_SUPPORTED = 801
GRANULARITY = 1 << 16
A = real.CUdevice_attribute
P = real.CUpointer_attribute


class Physical:
    """A ``cuMemCreate`` allocation: its bytes, where it is mapped, who holds a handle."""

    def __init__(self, n: int, device: int) -> None:
        self.store = ctypes.create_string_buffer(n)
        self.n = n
        self.device = device
        self.mapped_at: list[int] = []
        self.handles = 0
        self.shareable = False

    def bytes_now(self) -> bytes:
        """The current contents: of a mapping when there is one."""
        if self.mapped_at:
            return ctypes.string_at(self.mapped_at[0], self.n)
        return self.store.raw


class FakeVmmDriver(FakeMemDriver):
    """FakeMemDriver + VMM, IPC, host-memory flags, peer disabling, device attributes."""

    CUipcMemHandle = real.CUipcMemHandle
    CUipcEventHandle = real.CUipcEventHandle
    CUmemAllocationProp = real.CUmemAllocationProp
    CUmemAllocationType = real.CUmemAllocationType
    CUmemAllocationHandleType = real.CUmemAllocationHandleType
    CUmemAllocationGranularity_flags = real.CUmemAllocationGranularity_flags
    CUmemAccessDesc = real.CUmemAccessDesc
    CUmemAccess_flags = real.CUmemAccess_flags

    def __init__(self, base: Any) -> None:
        super().__init__(base, total=64 << 20)
        self.attrs: dict[Any, int] = {
            A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: 1,
            A.CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: 0,
        }
        self.reservations: dict[int, tuple[Any, int]] = {}  # addr -> (None, size)
        self.arenas: list[tuple[int, int, Any]] = []  # real memory behind reservations
        self.mappings: dict[int, tuple[int, Physical]] = {}  # addr -> (size, physical)
        self.access: dict[int, set[int]] = {}  # mapping addr -> devices
        self.handles: dict[int, Physical] = {}  # live allocation handles
        self.honour_hint = True
        self.vmm_oom_after: int | None = None  # cuMemCreate fails after this many
        self.host_flags: dict[int, int] = {}  # cuMemHostAlloc address -> flags
        self.readonly_pages: set[int] = set()  # host addresses the OS maps read-only
        self.ipc_opens: dict[tuple[int, int], int] = {}  # (base, ctx) -> open count
        self.refuse_ipc_open = OK
        self.exported: dict[int, Physical] = {}  # inode of an exported fd -> physical
        self.mempool_allocs: set[int] = set()
        self._hids = itertools.count(0x9000)

    # --- device attributes and identity ----------------------------------------
    def cuDeviceGetAttribute(self, attr: Any, dev: Any) -> tuple[int, int]:
        if attr in self.attrs:
            return (OK, self.attrs[attr])
        return super().cuDeviceGetAttribute(attr, dev)

    def cuDeviceGetUuid(self, dev: Any) -> tuple[int, Any]:
        u = real.CUuuid()
        ctypes.memmove(int(u.getPtr()), bytes([0xC0 + int(dev)] * 16), 16)
        return (OK, u)

    def cuDeviceGetPCIBusId(self, n: int, dev: Any) -> tuple[int, bytes]:
        return (OK, f"0000:{0x40 + int(dev):02x}:00.0".encode())

    # --- VMM ---------------------------------------------------------------------
    def cuMemGetAllocationGranularity(self, prop: Any, flag: Any) -> tuple[int, int]:
        return (OK, GRANULARITY)

    def cuMemAddressReserve(self, size: int, align: int, addr: Any, flags: int) -> tuple[int, int]:
        if size % GRANULARITY or flags:
            return (INVALID_VALUE, 0)
        hint = int(addr)
        if hint and self.honour_hint and not self._overlaps_reservation(hint, size):
            for start, end, _buf in self.arenas:
                if start <= hint and hint + size <= end:
                    self.reservations[hint] = (None, size)
                    self.note("reserve", (hint, size))
                    return (OK, hint)
        # real memory with room after it, where a hinted extension may go
        buf = ctypes.create_string_buffer(size * 4 + GRANULARITY)
        start = (ctypes.addressof(buf) + GRANULARITY - 1) // GRANULARITY * GRANULARITY
        self.arenas.append((start, start + size * 4, buf))
        self.reservations[start] = (None, size)
        self.note("reserve", (start, size))
        return (OK, start)

    def _overlaps_reservation(self, ptr: int, n: int) -> bool:
        return any(a < ptr + n and ptr < a + s for a, (_b, s) in self.reservations.items())

    def _reserved(self, ptr: int, n: int) -> bool:
        return any(a <= ptr and ptr + n <= a + s for a, (_b, s) in self.reservations.items())

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple[int]:
        p = int(ptr)
        entry = self.reservations.get(p)
        if entry is None or entry[1] != size:
            return (INVALID_VALUE,)
        if any(p <= m < p + size for m in self.mappings):
            return (INVALID_VALUE,)  # still mapped
        del self.reservations[p]
        self.note("addressfree", (p, size))
        return (OK,)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[int, Any]:
        if size % GRANULARITY:
            return (INVALID_VALUE, None)
        if self.vmm_oom_after is not None:
            if self.vmm_oom_after == 0:
                return (OUT_OF_MEMORY, None)
            self.vmm_oom_after -= 1
        phys = Physical(size, int(prop.location.id))
        phys.handles = 1
        phys.shareable = int(prop.requestedHandleTypes) == 1
        h = next(self._hids)
        self.handles[h] = phys
        self.note("memcreate", (h, size, phys.device))
        return (OK, real.CUmemGenericAllocationHandle(h))

    def cuMemRelease(self, handle: Any) -> tuple[int]:
        phys = self.handles.pop(int(handle), None)
        if phys is None:
            return (INVALID_VALUE,)
        phys.handles -= 1
        self.note("memrelease", int(handle))
        return (OK,)

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple[int]:
        p = int(ptr)
        phys = self.handles.get(int(handle))
        if phys is None or offset or flags or size != phys.n or not self._reserved(p, size):
            return (INVALID_VALUE,)
        if any(m < p + size and p < m + n for m, (n, _ph) in self.mappings.items()):
            return (INVALID_VALUE,)  # overlaps a mapping
        ctypes.memmove(p, phys.bytes_now(), size)
        phys.mapped_at.append(p)
        self.mappings[p] = (size, phys)
        self.access[p] = set()
        self.note("map", (p, size, int(handle)))
        return (OK,)

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple[int]:
        p = int(ptr)
        entry = self.mappings.get(p)
        if entry is None or entry[0] != size:
            return (INVALID_VALUE,)
        phys = entry[1]
        phys.mapped_at.remove(p)
        if not phys.mapped_at:
            ctypes.memmove(phys.store, p, size)
        del self.mappings[p]
        del self.access[p]
        self.note("unmap", (p, size))
        return (OK,)

    def cuMemSetAccess(self, ptr: Any, size: int, descs: Any, count: int) -> tuple[int]:
        p = int(ptr)
        entry = self.mappings.get(p)
        if entry is None or entry[0] != size or count != len(descs):
            return (INVALID_VALUE,)
        devs = {int(d.location.id) for d in descs}
        if self.no_peer and any(d != entry[1].device for d in devs):
            return (INVALID_VALUE,)
        self.access[p] |= devs
        self.note("setaccess", (p, size, tuple(sorted(devs))))
        return (OK,)

    def _dev_range(self, ptr: int, n: int) -> bool:
        if super()._dev_range(ptr, n):
            return True
        dev = self.base.ctx_device.get(self.cur())
        covered = 0
        for m, (size, _ph) in sorted(self.mappings.items()):
            lo, hi = max(m, ptr), min(m + size, ptr + n)
            if lo < hi:
                assert dev in self.access[m], f"device {dev} has no access to {m:#x}"
                covered += hi - lo
        return covered == n

    def physical_device_at(self, ptr: int) -> int:
        for m, (size, ph) in self.mappings.items():
            if m <= ptr < m + size:
                return ph.device
        raise AssertionError(f"{ptr:#x} is not mapped")

    # --- POSIX fd export of VMM allocations --------------------------------------
    def cuMemExportToShareableHandle(self, handle: Any, kind: Any, flags: int) -> tuple[int, Any]:
        phys = self.handles.get(int(handle))
        if phys is None or int(kind) != 1 or flags:
            return (INVALID_VALUE, None)
        if not phys.shareable:
            return (INVALID_VALUE, None)
        fd, path = tempfile.mkstemp(prefix="fakevmm-")
        os.unlink(path)
        self.exported[os.fstat(fd).st_ino] = phys
        self.note("export", int(handle))
        return (OK, fd)

    def cuMemImportFromShareableHandle(self, fd: Any, kind: Any) -> tuple[int, Any]:
        phys = self.exported.get(os.fstat(int(fd)).st_ino)
        if phys is None or int(kind) != 1:
            return (INVALID_VALUE, None)
        phys.handles += 1
        h = next(self._hids)
        self.handles[h] = phys
        self.note("import", h)
        return (OK, real.CUmemGenericAllocationHandle(h))

    # --- legacy IPC ---------------------------------------------------------------
    def cuMemGetAddressRange(self, ptr: Any) -> tuple[int, int, int]:
        p = int(ptr)
        for addr, (_b, n, _c, _k) in self.allocs.items():
            if addr <= p < addr + n:
                return (OK, addr, n)
        return (INVALID_VALUE, 0, 0)

    def cuPointerGetAttribute(self, attr: Any, ptr: int) -> tuple[int, Any]:
        p = int(ptr)
        alloc = next(
            ((a, e) for a, e in self.allocs.items() if a <= p < a + e[1]),
            None,
        )
        if alloc is None and any(m <= p < m + n for m, (n, _ph) in self.mappings.items()):
            vmm = {
                P.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: 0,
                P.CU_POINTER_ATTRIBUTE_IS_MANAGED: 0,
                P.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: 0,
                P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE: 2,
            }
            if attr in vmm:
                return (OK, vmm[attr])
        if alloc is not None and attr == P.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
            return (OK, alloc[1][3] == "device" and alloc[0] not in self.mempool_allocs)
        if alloc is not None and attr == P.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
            return (OK, 0x77 if alloc[0] in self.mempool_allocs else 0)
        if attr == P.CU_POINTER_ATTRIBUTE_DEVICE_POINTER and alloc is None:
            err, _kind = super().cuPointerGetAttribute(P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p)
            return (OK, p ^ (1 << 46)) if not err else (INVALID_VALUE, None)
        return super().cuPointerGetAttribute(attr, p)

    def cuIpcGetMemHandle(self, ptr: Any) -> tuple[int, Any]:
        p = int(ptr)
        if p not in self.allocs or not self.cur():
            return (INVALID_VALUE, None)
        h = real.CUipcMemHandle()
        data = b"FAKEIPC\0" + p.to_bytes(8, "little") + bytes(48)
        ctypes.memmove(int(h.getPtr()), data, 64)
        self.note("ipcget", p)
        return (OK, h)

    def cuIpcOpenMemHandle(self, h: Any, flags: int) -> tuple[int, int]:
        data = ctypes.string_at(int(h.getPtr()), 64)
        if not self.cur():
            return (INVALID_CONTEXT, 0)
        if self.refuse_ipc_open:
            return (self.refuse_ipc_open, 0)
        base = int.from_bytes(data[8:16], "little")
        if data[:8] != b"FAKEIPC\0" or base not in self.allocs or flags != 1:
            return (INVALID_VALUE, 0)
        key = (base, self.cur())
        self.ipc_opens[key] = self.ipc_opens.get(key, 0) + 1
        self.note("ipcopen", base)
        return (OK, base)

    def cuIpcCloseMemHandle(self, ptr: Any) -> tuple[int]:
        key = (int(ptr), self.cur())
        if not self.ipc_opens.get(key):
            return (INVALID_VALUE,)
        self.ipc_opens[key] -= 1
        self.note("ipcclose", int(ptr))
        return (OK,)

    def cuIpcGetEventHandle(self, ev: Any) -> tuple[int, Any]:
        entry = self.events.get(int(ev))
        if entry is None or entry[1] & 6 != 6:  # INTERPROCESS | DISABLE_TIMING
            return (INVALID_VALUE, None)
        h = real.CUipcEventHandle()
        ctypes.memmove(int(h.getPtr()), b"FAKEEVT\0" + int(ev).to_bytes(8, "little"), 16)
        return (OK, h)

    def cuIpcOpenEventHandle(self, h: Any) -> tuple[int, Any]:
        data = ctypes.string_at(int(h.getPtr()), 16)
        if data[:8] != b"FAKEEVT\0" or int.from_bytes(data[8:], "little") not in self.events:
            return (INVALID_VALUE, None)
        err, ev = self.cuEventCreate(6)
        self.note("ipcopenevent", int(ev))
        return (err, ev)

    # --- host memory flags -------------------------------------------------------
    def cuMemHostAlloc(self, n: int, flags: int) -> tuple[int, int]:
        err, addr = super().cuMemHostAlloc(n, flags)
        if not err:
            self.host_flags[addr] = flags
        return (err, addr)

    def cuMemHostGetFlags(self, p: Any) -> tuple[int, int]:
        if not self.cur():
            return (INVALID_CONTEXT, 0)
        for addr, (_b, n, _c) in self.host_allocs.items():
            if addr <= int(p) < addr + n:
                return (OK, self.host_flags[addr])
        return (INVALID_VALUE, 0)

    def cuMemHostRegister(self, p: int, n: int, flags: int) -> tuple[int]:
        if p in self.readonly_pages and not flags & 8:
            return (INVALID_VALUE,)
        return super().cuMemHostRegister(p, n, flags)

    # --- peers -------------------------------------------------------------------
    def cuCtxDisablePeerAccess(self, peer: Any) -> tuple[int]:
        key = (self.cur(), int(peer))
        self.note("disablepeer", key)
        if key not in self.peers:
            return (PEER_NOT_ENABLED,)
        self.peers.discard(key)
        return (OK,)


@pytest.fixture
def vfake(fake_driver, monkeypatch):
    """FakeVmmDriver patched into every ctxkit module for one test."""
    f = install(monkeypatch, FakeVmmDriver(fake_driver))
    monkeypatch.setattr(_hostmem, "_pageable_access", {})
    monkeypatch.setattr(_hostmem, "_pageable_kernel_args", False)
    monkeypatch.setattr(_hostmem, "_registered", {})
    yield f
    gc.collect()


@pytest.fixture
def vctx0(vfake) -> Context:
    return ck.registry.context(0)


@pytest.fixture
def vctx1(vfake) -> Context:
    return ck.registry.context(1)


def other_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like another one to ctxkit.memory.ipc (for imports)."""
    monkeypatch.setattr(_ipc, "_PROCESS_TAG", "another-process")


__all__ = ["FakeHandle", "FakeVmmDriver", "other_process", "vctx0", "vctx1", "vfake"]
