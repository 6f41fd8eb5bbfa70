"""A fake of the driver's library, module, launch, occupancy and graph calls, for CPU tests
of ctxkit.module (on top of tests/support/fakedriver.py's context stack).

``ModuleDriver`` records every launch (function, context, grid, block, stream, the packed
parameter bytes and the ``cuLaunchKernelEx`` attributes), so tests check what would reach
the GPU. Fixtures: ``fake`` (the module fake alone) and ``mem_fake`` (with the memory fake
of tests/support/fakemem.py underneath, for real ``DeviceBuffer`` arguments). Import them
into a test module: ``from tests.module.fakemodule import fake  # noqa: F401``. The GPU
suite checks the same paths against the real driver.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
from typing import Any

import pytest

import ctxkit as ck
from ctxkit import stream as stream_mod
from ctxkit.module import module as M
from ctxkit.module import ptxsig
from tests.support.fakedriver import FakeHandle, swap_driver

VECTOR_ADD = """
.version 7.0
.target sm_52
.address_size 64
.visible .entry vector_add(
    .param .u64 a, .param .u64 b, .param .u64 c, .param .u64 n
)
{ ret; }
.visible .entry saxpy(.param .f32 a, .param .u64 x, .param .u64 y, .param .u64 n)
{ ret; }
.weak .entry _Z4axpyIfEvT_PKS0_PS0_m(.param .f32 a, .param .u64 x, .param .u64 y,
    .param .u64 n)
{ ret; }
"""

BAD_PTX = ".version 7.0\n.target sm_52\n.visible .entry broken() { BAD; }\n"

CUBIN = b"\x7fELF" + bytes(60)


class FakeBuffer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeStream:
    def __init__(self, ctx: ck.Context, handle: int = 0x77) -> None:
        self.context = ctx
        self.handle = FakeHandle(handle)


_IDS = itertools.count(0x10_0000, 0x10)  # unique across tests: late finalizers stay apart


class ModuleDriver:
    """Library/module/launch/graph calls, delegating context calls to the fake stack."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.ids = _IDS
        self.libraries: dict[int, dict[str, ptxsig.Signature]] = {}
        self.kernels: dict[int, tuple[int, str]] = {}
        self.functions: dict[int, tuple[str, int]] = {}  # handle -> (kernel name, context)
        self.launches: list[dict[str, Any]] = []
        self.unloaded: list[int] = []
        self.fail_next: int = 0
        self.capturing: dict[int, int] = {}
        self.graph_nodes: dict[int, int] = {}
        self.exec_destroyed: list[tuple[int, int]] = []
        self.graph_launches: list[tuple[int, int, int]] = []
        self.graph_uploads: list[tuple[int, int, int]] = []
        self.param_info_contexts: list[int] = []
        self.attrs = {
            "MAX_THREADS_PER_BLOCK": 1024,
            "MAX_DYNAMIC_SHARED_SIZE_BYTES": 49152,
            "NON_PORTABLE_CLUSTER_SIZE_ALLOWED": 0,
        }
        #: device attributes by name without CU_DEVICE_ATTRIBUTE_ (others: 1024)
        self.dev_attrs = {
            "MULTIPROCESSOR_COUNT": 4,
            "COOPERATIVE_LAUNCH": 1,
            "COMPUTE_CAPABILITY_MAJOR": 9,
            "COMPUTE_CAPABILITY_MINOR": 0,
        }
        self.occupancy_queries: list[tuple[str, Any]] = []
        self.active_clusters = 3  # what cuOccupancyMaxActiveClusters answers for a legal size
        base.cuDeviceGetAttribute = self.cuDeviceGetAttribute

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def CUstream(self, handle: Any) -> Any:
        return handle

    def _new(self) -> FakeHandle:
        return FakeHandle(next(self.ids))

    def cuDeviceGetName(self, length, dev):
        return (0, b"Fake GPU %d" % int(dev))

    def cuDeviceGetAttribute(self, attr, dev):
        return (0, self.dev_attrs.get(attr.name[len("CU_DEVICE_ATTRIBUTE_") :], 1024))

    # libraries and modules
    def cuLibraryLoadData(self, code, keys, vals, n, lkeys, lvals, ln):
        assert n == len(keys) == len(vals) and ln == 0
        if b"SILENT" in code:
            return (218, None)  # a failure that leaves the log buffers empty
        if b"BAD" in code:
            vals[2][: len(b"ptxas fatal: bad")] = b"ptxas fatal: bad"
            return (218, None)
        h = self._new()
        cubin = code.startswith(b"\x7fELF")
        self.libraries[int(h)] = ptxsig.parse_entries(VECTOR_ADD if cubin else code)
        return (0, h)

    param_info = True
    param_info_error = 0  # a CUresult cuKernelGetParamInfo returns even in a context
    func_param_info = True

    def _layout(self, name: str, index: int) -> tuple[int, int, int]:
        params = next(lib[name] for lib in self.libraries.values() if name in lib).params
        if index >= len(params):
            return (1, 0, 0)
        return (0, params[index].offset, params[index].size)

    def cuKernelGetParamInfo(self, kernel, index):
        if not self.param_info:
            raise RuntimeError("Function cuKernelGetParamInfo not found")
        cur = self.base.current()
        self.param_info_contexts.append(cur)
        if not cur:
            return (201, 0, 0)  # library-kernel queries need a current context
        if self.param_info_error:
            return (self.param_info_error, 0, 0)
        return self._layout(self.kernels[int(kernel)][1], index)

    def cuFuncGetParamInfo(self, func, index):
        if not self.func_param_info:
            raise RuntimeError("Function cuFuncGetParamInfo not found")
        name, ctx = self.functions[int(func)]
        if ctx != self.base.current():
            return (400, 0, 0)
        return self._layout(name, index)

    def cuLibraryGetKernelCount(self, lib):
        return (0, len(self.libraries[int(lib)]))

    def cuLibraryEnumerateKernels(self, n, lib):
        names = list(self.libraries[int(lib)])[:n]
        return (0, [self.cuLibraryGetKernel(lib, x.encode())[1] for x in names])

    def cuKernelGetName(self, kernel):
        return (0, self.kernels[int(kernel)][1].encode())

    def cuLibraryGetKernel(self, lib, name: bytes):
        if name.decode() not in self.libraries[int(lib)]:
            return (500, None)
        h = self._new()
        self.kernels[int(h)] = (int(lib), name.decode())
        return (0, h)

    def cuKernelGetFunction(self, kernel):
        cur = self.base.current()
        if not cur:
            return (201, None)
        h = self._new()
        self.functions[int(h)] = (self.kernels[int(kernel)][1], cur)
        self.base.calls["cuKernelGetFunction"] += 1
        return (0, h)

    def cuLibraryUnload(self, lib):
        self.unloaded.append(int(lib))
        return (0,)

    def cuModuleLoadDataEx(self, image, n, keys, vals):
        cur = self.base.current()
        if not cur:
            return (201, None)
        if b"SILENT" in image:
            vals[2][:14] = b"diagnosed: bad"
            return (218, None)
        h = self._new()
        self.libraries[int(h)] = ptxsig.parse_entries(image)
        self.module_ctx = cur
        return (0, h)

    def cuModuleGetFunction(self, mod, name: bytes):
        if name.decode() not in self.libraries[int(mod)]:
            return (500, None)
        h = self._new()
        self.functions[int(h)] = (name.decode(), self.base.current())
        return (0, h)

    def cuModuleUnload(self, mod):
        self.unloaded.append(int(mod))
        return (0,)

    # launches
    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shm, hs, params, extra):
        return self._launch(f, (gx, gy, gz), (bx, by, bz), shm, hs, params, None)

    def cuLaunchKernelEx(self, cfg, f, params, extra):
        attrs: dict[str, Any] = {}
        for a in cfg.attrs[: cfg.numAttrs]:
            name = a.id.name[len("CU_LAUNCH_ATTRIBUTE_") :]
            v = a.value
            if name == "COOPERATIVE":
                attrs["cooperative"] = v.cooperative
            elif name == "CLUSTER_DIMENSION":
                attrs["cluster"] = (v.clusterDim.x, v.clusterDim.y, v.clusterDim.z)
            elif name == "PROGRAMMATIC_STREAM_SERIALIZATION":
                attrs["programmatic"] = v.programmaticStreamSerializationAllowed
            elif name == "PRIORITY":
                attrs["priority"] = v.priority
        grid = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ)
        block = (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ)
        return self._launch(f, grid, block, cfg.sharedMemBytes, cfg.hStream, params, attrs)

    def _launch(self, f, grid, block, shm, hs, params, attrs):
        """Record a launch; *attrs* ``None`` for ``cuLaunchKernel``, a dict for ``...Ex``."""
        name, ctx = self.functions[int(f)]
        cur = self.base.current()
        if ctx != cur:
            return (400,)
        if self.fail_next:
            code, self.fail_next = self.fail_next, 0
            return (code,)
        if block[0] * block[1] * block[2] > self.attrs["MAX_THREADS_PER_BLOCK"]:
            return (1,)
        sig = next(lib[name] for lib in self.libraries.values() if name in lib)
        ptrs: Any = (
            (ctypes.c_void_p * max(len(sig.params), 1)).from_address(params) if params else []
        )
        values = [ctypes.string_at(ptrs[i], p.size) for i, p in enumerate(sig.params)]
        stream = 0 if hs is None else int(hs)
        self.launches.append(
            dict(
                name=name,
                ctx=cur,
                grid=grid,
                block=block,
                shm=shm,
                stream=stream,
                values=values,
                call="cuLaunchKernel" if attrs is None else "cuLaunchKernelEx",
                attrs=attrs or {},
            )
        )
        if stream in self.capturing:
            self.capturing[stream] += 1
        return (0,)

    def cuFuncGetAttribute(self, attr, func):
        return (0, self.attrs.get(attr.name[len("CU_FUNC_ATTRIBUTE_") :], 7))

    def cuFuncSetAttribute(self, func, attr, value):
        self.attrs[attr.name[len("CU_FUNC_ATTRIBUTE_") :]] = value
        return (0,)

    def cuOccupancyMaxPotentialBlockSize(self, func, cb, shm, limit):
        assert cb is None
        return (0, 264, 768 if not limit else min(768, limit))

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, func, block, shm):
        self.occupancy_queries.append(("blocks", (block, shm)))
        return (0, 2048 // block)

    def cuOccupancyMaxActiveClusters(self, func, cfg):
        (a,) = cfg.attrs[: cfg.numAttrs]
        cluster = (a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z)
        self.occupancy_queries.append(("clusters", cluster))
        size = cluster[0] * cluster[1] * cluster[2]
        if size > 16 or (size > 8 and not self.attrs.get("NON_PORTABLE_CLUSTER_SIZE_ALLOWED")):
            return (912, 0)
        return (0, self.active_clusters)

    def cuPointerGetAttribute(self, attr, ptr):
        return (1, None)

    # graphs
    def cuStreamBeginCapture(self, hs, mode):
        self.capture_mode = mode
        self.capturing[int(hs)] = 0
        return (0,)

    def cuStreamEndCapture(self, hs):
        n = self.capturing.pop(int(hs))
        g = self._new()
        self.graph_nodes[int(g)] = n
        return (0, g)

    def cuGraphGetNodes(self, g, num):
        return (0, None, self.graph_nodes[int(g)])

    def cuGraphInstantiate(self, g, flags):
        return (0, self._new())

    def cuGraphDestroy(self, g):
        self.graph_nodes.pop(int(g))
        return (0,)

    def cuGraphLaunch(self, exe, hs):
        self.graph_launches.append((int(exe), int(hs), self.base.current()))
        return (0,)

    def cuGraphUpload(self, exe, hs):
        self.graph_uploads.append((int(exe), int(hs), self.base.current()))
        return (0,)

    def cuGraphExecDestroy(self, exe):
        self.exec_destroyed.append((int(exe), self.base.current()))
        return (0,)


_real = M.drv
for _name in (
    "CUjit_option",
    "CUfunction_attribute",
    "CUstreamCaptureMode",
    "CUpointer_attribute",
    "CUlaunchConfig",
    "CUlaunchAttribute",
    "CUlaunchAttributeID",
):
    setattr(ModuleDriver, _name, getattr(_real, _name))


@pytest.fixture
def fake(fake_driver, monkeypatch) -> ModuleDriver:
    """The module fake in every ctxkit module, over the context fake of conftest."""
    gc.collect()  # modules of earlier tests unload now, not into this test's records
    drv = ModuleDriver(fake_driver)
    swap_driver(monkeypatch, drv)
    monkeypatch.setattr(stream_mod, "_foreign_stream_int", lambda s: s.handle)
    return drv


@pytest.fixture
def mem_fake(fake_driver, monkeypatch) -> ModuleDriver:
    """The module fake with the memory fake underneath: ``ck.DeviceBuffer`` works.

    Device attributes, launches and occupancy come from the module fake; memory, peer
    access and pointer queries from tests/support/fakemem.py.
    """
    from ctxkit import _driver
    from ctxkit.memory import copies as _copies
    from ctxkit.memory import host as _hostmem
    from ctxkit.memory import managed as _managed
    from tests.support.fakemem import FakeMemDriver

    gc.collect()
    drv = ModuleDriver(fake_driver)
    mem = FakeMemDriver(drv)
    monkeypatch.setattr(mem, "cuDeviceGetAttribute", drv.cuDeviceGetAttribute, raising=False)
    swap_driver(monkeypatch, mem)
    monkeypatch.setattr(stream_mod, "_foreign_stream_int", lambda s: s.handle)
    monkeypatch.setattr(_managed, "_concurrent_managed", {})
    monkeypatch.setattr(_copies, "_peer_pairs", {})
    monkeypatch.setattr(_hostmem, "_strict", False)
    monkeypatch.setattr(_driver, "_raw_pointer_get_attribute", False)
    drv.mem = mem
    return drv


def load(text: str | bytes = VECTOR_ADD, **kw: Any) -> M.Module:
    return M.Module.load(text, **kw)


def as_u64(b: bytes) -> int:
    return int.from_bytes(b, "little")
