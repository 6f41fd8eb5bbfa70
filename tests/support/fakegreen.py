"""Green contexts (SM partitions) for the fake GPU (tests/support/fakegpu.py).

Modelled on the driver's rules, so the CPU suite catches what the GPU would refuse:

* ``cuDeviceGetDevResource`` gives the device's SMs (:attr:`GreenRules.sm_total`, ids
  ``0..n-1``); with :attr:`report_granularity` the resource carries
  ``minSmPartitionSize``/``smCoscheduledAlignment`` (CUDA 13), else it has ``smCount``
  only (12.x bindings);
* ``cuDevSmResourceSplitByCount`` makes up to *nbGroups* equal groups of *minCount* SMs
  rounded up to the granularity, plus the remaining SMs; a split's output cannot be split
  again (``CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION``) except through a green context
  made of it (``cuGreenCtxGetDevResource``); ``cuDevSmResourceSplit`` exists from driver
  13.1 (:attr:`driver_code`) and takes one SM count per group;
* ``cuGreenCtxCreate`` needs ``CU_GREEN_CTX_DEFAULT_STREAM``, retains the primary
  context and gives a green context whose ``cuCtxFromGreenCtx`` is a context of its own
  (a distinct handle); ``cuGreenCtxDestroy`` releases the primary context, and the
  context is destroyed;
* ``cuGreenCtxStreamCreate`` refuses a stream without ``CU_STREAM_NON_BLOCKING``
  (``CUDA_ERROR_INVALID_VALUE``); :meth:`GreenRules.sms_of` tells which SMs a stream's work runs
  on: its green context's, or all of them (legacy and ``cuStreamCreate`` streams);
* work on the legacy default stream while a green context is current is recorded in
  :attr:`legacy_in_green` (the real driver runs it on every SM, outside the partition).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cuda.bindings import driver as _real

from tests.support.fakedriver import FakeHandle

INVALID_VALUE = 1
INVALID_CONTEXT = 201
INVALID_RESOURCE_CONFIGURATION = 915
STREAM_NON_BLOCKING = 1


@dataclass
class FakeSmResource:
    """A ``CUdevResource`` of SMs: ``.sm.smCount`` and the SM ids."""

    ids: tuple[int, ...]
    split_output: bool = False
    granularity: tuple[int, int] | None = None
    sm: Any = field(init=False)

    def __post_init__(self) -> None:
        sm = type("FakeSm", (), {})()
        sm.smCount = len(self.ids)
        if self.granularity is not None:
            sm.minSmPartitionSize, sm.smCoscheduledAlignment = self.granularity
        self.sm = sm


@dataclass
class FakeGreen:
    """A live green context: its SMs, device and CUcontext handle."""

    ids: tuple[int, ...]
    device: int
    ctx: int
    destroyed: bool = False


class GreenRules:
    """Mixed into FakeGPU (which supplies the context fake, ``streams`` and ``_Stream``)."""

    CUdevResourceType = _real.CUdevResourceType
    CUgreenCtxCreate_flags = _real.CUgreenCtxCreate_flags
    CU_DEV_SM_RESOURCE_GROUP_PARAMS = _real.CU_DEV_SM_RESOURCE_GROUP_PARAMS

    def init_green(self) -> None:
        self.sm_total = 132
        self.granularity = (8, 8)
        self.report_granularity = True
        self.driver_code = 13000  # cuDriverGetVersion: 13.0 (the H200's driver 580)
        self.greens: dict[int, FakeGreen] = {}  # CUgreenCtx value -> its state
        self.green_of_ctx: dict[int, int] = {}  # CUcontext value -> CUgreenCtx value
        self.stream_green: dict[int, int] = {}  # stream handle -> CUgreenCtx value
        self.legacy_in_green: list[str] = []
        self.splits: list[str] = []  # which split API ran, and how

    # --- what tests ask --------------------------------------------------------------

    def sms_of(self, stream: Any) -> tuple[int, ...]:
        """The SMs work on *stream* (a handle or ctxkit Stream) runs on."""
        h = int(getattr(stream, "handle", stream))
        g = self.stream_green.get(h)
        return self.greens[g].ids if g is not None else tuple(range(self.sm_total))

    def live_greens(self) -> list[FakeGreen]:
        return [g for g in self.greens.values() if not g.destroyed]

    # --- driver API ------------------------------------------------------------------

    def cuDriverGetVersion(self) -> tuple[int, int]:
        return (0, self.driver_code)

    def _legacy(self, what: str, unsafe: bool = True) -> int:
        if self.current() in self.green_of_ctx:
            self.legacy_in_green.append(what)
        return super()._legacy(what, unsafe)  # type: ignore[misc, no-any-return]

    def _resource(self, ids: tuple[int, ...], split_output: bool) -> FakeSmResource:
        gran = self.granularity if self.report_granularity else None
        return FakeSmResource(ids, split_output, gran)

    def cuDeviceGetDevResource(self, dev: Any, kind: Any) -> tuple[int, Any]:
        if kind != _real.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM:
            return (914, None)
        return (0, self._resource(tuple(range(self.sm_total)), False))

    def cuGreenCtxGetDevResource(self, green: Any, kind: Any) -> tuple[int, Any]:
        g = self.greens.get(int(green))
        if g is None or g.destroyed:
            return (INVALID_CONTEXT, None)
        return (0, self._resource(g.ids, False))

    def _rounded(self, count: int) -> int:
        low, step = self.granularity
        return -(-max(count, low) // step) * step

    def cuDevSmResourceSplitByCount(
        self, nb: int, res: Any, flags: int, min_count: int
    ) -> tuple[int, Any, int, Any]:
        if res.split_output or not 0 <= min_count <= len(res.ids):
            return (INVALID_RESOURCE_CONFIGURATION, None, 0, None)
        size = self._rounded(min_count)
        made = min(nb, len(res.ids) // size)
        self.splits.append(f"ByCount({nb}, {min_count}) -> {made} x {size}")
        groups = [self._resource(res.ids[i * size : (i + 1) * size], True) for i in range(made)]
        groups += [FakeSmResource(())] * (nb - made)  # unfilled entries of the array
        rest = self._resource(res.ids[made * size :], True)
        return (0, groups, made, rest)

    def cuDevSmResourceSplit(
        self, nb: int, res: Any, flags: int, params: list[Any]
    ) -> tuple[int, Any, Any]:
        if self.driver_code < 13010:
            raise RuntimeError('Function "cuDevSmResourceSplit" not found')
        counts = [int(p.smCount) for p in params]
        if res.split_output or len(counts) != nb or any(c % 2 or c < 2 for c in counts):
            return (INVALID_RESOURCE_CONFIGURATION, None, None)
        if sum(counts) > len(res.ids):
            return (INVALID_RESOURCE_CONFIGURATION, None, None)
        self.splits.append(f"Split({counts})")
        groups, at = [], 0
        for c in counts:
            groups.append(self._resource(res.ids[at : at + c], True))
            at += c
        return (0, groups, self._resource(res.ids[at:], True))

    def cuDevResourceGenerateDesc(self, resources: list[Any], n: int) -> tuple[int, Any]:
        if n != len(resources) or not resources or not resources[0].ids:
            return (INVALID_VALUE, None)
        return (0, tuple(i for r in resources for i in r.ids))

    def cuGreenCtxCreate(self, desc: Any, dev: Any, flags: Any) -> tuple[int, Any]:
        if int(flags) != int(_real.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM):
            return (INVALID_VALUE, None)
        d = int(dev)
        with self._lock:  # type: ignore[attr-defined]
            self.primary_refs[d] += 1  # type: ignore[attr-defined]
        ctx = next(self._ids)  # type: ignore[attr-defined]
        green = FakeHandle(next(self._ids))  # type: ignore[attr-defined]
        self.ctx_device[ctx] = d  # type: ignore[attr-defined]
        self.greens[int(green)] = FakeGreen(tuple(desc), d, ctx)
        self.green_of_ctx[ctx] = int(green)
        return (0, green)

    def cuCtxFromGreenCtx(self, green: Any) -> tuple[int, Any]:
        g = self.greens.get(int(green))
        if g is None or g.destroyed:
            return (INVALID_CONTEXT, None)
        return (0, FakeHandle(g.ctx))

    def cuGreenCtxStreamCreate(self, green: Any, flags: int, priority: int) -> tuple[int, Any]:
        g = self.greens.get(int(green))
        if g is None or g.destroyed:
            return (INVALID_CONTEXT, None)
        if not int(flags) & STREAM_NON_BLOCKING:
            return (INVALID_VALUE, None)  # "CU_STREAM_NON_BLOCKING must be specified"
        h = FakeHandle(next(self._handles))  # type: ignore[attr-defined]
        self.streams[int(h)] = self.make_stream(g.ctx, int(flags))  # type: ignore[attr-defined]
        self.stream_green[int(h)] = int(green)
        return (0, h)

    def cuGreenCtxDestroy(self, green: Any) -> tuple[int]:
        g = self.greens.get(int(green))
        if g is None or g.destroyed:
            return (INVALID_CONTEXT,)
        g.destroyed = True
        self.destroyed.add(g.ctx)  # type: ignore[attr-defined]
        return self.cuDevicePrimaryCtxRelease(FakeHandle(g.device))  # type: ignore[attr-defined, no-any-return]
