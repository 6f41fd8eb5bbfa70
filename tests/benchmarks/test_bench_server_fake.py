"""benchmarks/bench_server.py end to end on the simulated GPU: the ctxkit side
(ContextExecutor workers, pinned arrays, prepared launches) and the raw cuda.bindings side
(pushed primary context, cuMemHostAlloc, async copies, cuLaunchKernel) serve their requests
through the fake's streams, which really copy and compute ``y = 2x + 1``; CuPy is absent
(tests/benchmarks/conftest.py), so the CuPy comparison takes its missing-baseline path. A
fake kernel that computes the wrong thing must fail the result CHECK. NVRTC really
compiles the kernel for both sides (no GPU needed). The numbers mean nothing."""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from tests.support.fakedriver import FakeHandle
from tests.support.fakegpu import FakeGPU, install_raw_calls

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SMALL = ["--threads", "3", "--requests", "6", "--rounds", "2", "--bytes", "4096"]


class ServerCalls:
    """The raw module and launch calls the fake GPU lacks: ``affine(x, y, n)`` runs on its
    stream as the real kernel would (``wrong`` makes it compute ``2x`` for the kernels of
    those modules: ``"raw"`` or ``"ctxkit"``). Launches and async copies need the stream's
    context current in the calling thread, as on the driver."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.raw_functions: set[int] = set()
        self.wrong: set[str] = set()
        self.refuse: set[str] = set()  # sides whose launches fail (CUDA_ERROR_INVALID_VALUE)
        self.launches: list[tuple[str, int, int, int]] = []  # (side, grid, block, stream)

    def cuModuleLoadData(self, image):
        assert bytes(image[:4]) == b"\x7fELF", "the raw side loads the cubin NVRTC made"
        return (0, FakeHandle(0x7000))

    def cuModuleGetFunction(self, mod, name):
        f = FakeHandle(0x7100 + len(self.raw_functions))
        self.raw_functions.add(int(f))
        self.gpu.kernel_names[int(f)] = name.decode()
        return (0, f)

    def cuModuleUnload(self, mod):
        return (0,)

    def cuStreamCreate(self, flags):
        return self.gpu.cuStreamCreateWithPriority(flags, 0)

    def in_context(self, stream) -> int:
        """0, or the driver's answer to an async call on *stream* from a thread without
        the stream's context current (the fake's copies do not ask)."""
        if not self.gpu.current():
            return 201  # CUDA_ERROR_INVALID_CONTEXT
        s = self.gpu.streams.get(int(stream))
        return 0 if s is not None and s.ctx == self.gpu.current() else 400  # INVALID_HANDLE

    def checked_copy(self, copy):
        def call(dst, src, n, stream):
            err = self.in_context(stream)
            return (err,) if err else copy(dst, src, n, stream)

        return call

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
        assert self.gpu.kernel_names[int(f)] == "affine"
        err = self.in_context(stream)
        if err:
            return (err,)
        side = "raw" if int(f) in self.raw_functions else "ctxkit"
        self.launches.append((side, gx, bx, int(stream)))
        ptrs = (ctypes.c_uint64 * 3).from_address(int(params))
        x, y = (ctypes.c_uint64.from_address(ptrs[i]).value for i in range(2))
        n = ctypes.c_int.from_address(ptrs[2]).value
        if gx * bx < n or side in self.refuse:
            return (1,)  # the grid does not cover the array: a bug in the benchmark
        add = np.float32(0 if side in self.wrong else 1)

        def kernel() -> None:
            src = np.frombuffer((ctypes.c_char * (n * 4)).from_address(x), np.float32)
            dst = np.frombuffer((ctypes.c_char * (n * 4)).from_address(y), np.float32)
            dst[:] = 2 * src + add

        self.gpu.launch(stream, kernel)
        return (0,)


@pytest.fixture
def bench(gpu, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_server

    calls = ServerCalls(gpu)
    install_raw_calls(monkeypatch, gpu, calls)
    for name in ("cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync"):
        monkeypatch.setattr(gpu, name, calls.checked_copy(getattr(gpu, name)))
    monkeypatch.setattr(bench_server, "drv", gpu)
    gpu.attrs["CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"] = 9
    gpu.attrs["CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"] = 0
    gpu.jitter = 0.0
    bench_server.calls = calls  # for the tests
    yield bench_server
    sys.modules.pop("bench_server", None)


def lines(text: str) -> dict[str, str]:
    """Verdict lines by name."""
    return {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith(("SUMMARY ", "CHECK "))}


def test_quick_run_serves_both_sides_and_skips_cupy(bench, gpu, capsys):
    assert bench.main(["--quick", *SMALL]) == 0
    text = capsys.readouterr().out
    print(text)
    got = lines(text)
    for side in ("ctxkit", "ctxkit_graph", "raw"):
        assert got[f"server.{side}_results"].endswith(" ok")
        assert "among 8 checked" in got[f"server.{side}_results"]  # 2 rounds x (3 + 1)
        rps = got[f"server.{side}_rps"]
        assert rps.endswith(" INFO") and "median of 2" in rps
        assert got[f"server.{side}_rps_1thread"].endswith(" INFO")
    for name in ("server.ctxkit_vs_raw", "server.ctxkit_graph_vs_raw"):
        assert got[name].endswith(" INFO") and "median of per-round ratios" in got[name]
    assert "server.ctxkit_graph_vs_cupy" not in got
    for name in ("server.ctxkit_vs_cupy", "server.cupy_rps", "server.cupy_rps_1thread"):
        assert got[name].endswith(" SKIP") and "CuPy is not installed" in got[name]
    assert "server.cupy_results" not in got
    # every request: a launch of the full grid on a serving thread's own stream
    launches = bench.calls.launches
    sides = {s for s, *_ in launches}
    assert sides == {"ctxkit", "raw"}
    assert {(g, b) for _, g, b, _ in launches} == {(4, 256)}  # 1024 floats
    assert all(s != 0 for *_, s in launches)  # never the legacy default stream
    per_round = 3 + 1  # threads of the many- and the 1-thread measurement
    warmup = per_round * min(6, bench.WARMUP_REQUESTS)
    captured = 3 * per_round  # the graph side launches once per thread, into its capture
    assert sum(s == "raw" for s, *_ in launches) == warmup + 2 * per_round * 6
    assert sum(s == "ctxkit" for s, *_ in launches) == warmup + 2 * per_round * 6 + captured
    for side, sides_streams in (("raw", 1), ("ctxkit", 2)):  # ctxkit: per call and graph
        streams = {h for s, *_, h in launches if s == side}
        assert len(streams) == sides_streams * 3 * per_round  # a stream per serving thread
    assert gpu.pageable_dma == []  # every copy was from/to pinned memory


def test_full_run_without_cupy_fails_the_comparison(bench, capsys):
    assert bench.main(SMALL) == 0  # a target FAIL; gpu-check and `ctxkit bench` count it
    got = lines(capsys.readouterr().out)
    cmp = got["server.ctxkit_vs_cupy"]
    assert cmp.endswith(" FAIL") and "baseline missing in a full run" in cmp
    assert got["server.cupy_rps"].endswith(" SKIP")
    assert got["server.ctxkit_results"].endswith(" ok")


@pytest.mark.parametrize("side", ["ctxkit", "raw"])
def test_a_wrong_response_fails_the_check_not_a_number(bench, capsys, side):
    bench.calls.wrong.add(side)
    assert bench.main(["--quick", *SMALL]) == 1
    text = capsys.readouterr().out
    got = lines(text)
    assert got[f"server.{side}_results"].endswith(" FAIL")
    assert "8.00 (<= 0.00" in got[f"server.{side}_results"]  # every response was wrong
    other = "raw" if side == "ctxkit" else "ctxkit"
    assert got[f"server.{other}_results"].endswith(" ok")
    assert got[f"server.{side}_rps"].startswith(f"SUMMARY server.{side}_rps n/a")
    assert got["server.ctxkit_vs_raw"].startswith("SUMMARY server.ctxkit_vs_raw n/a")
    assert "WRONG responses" in text


def test_verdicts_decide_on_the_median_of_per_round_ratios(bench):
    r = {"threads": 8, "requests": 100, "nbytes": 65536, bench.QUICK: False}
    for side, many in (("ctxkit", [90.0, 120.0, 100.0]), ("raw", [100.0] * 3),
                       ("cupy", [100.0, 100.0, 110.0])):  # fmt: skip
        r.update({f"{side}_many": many, f"{side}_one": [10.0] * 3})
        r.update({f"{side}_wrong": 0, f"{side}_checked": 27})
    got = {ln.name: ln for ln in bench.verdicts(r)}
    cmp = got["server.ctxkit_vs_cupy"]
    assert cmp.value == pytest.approx(0.909, abs=1e-3)  # ratios 0.9, 1.2, 0.909
    assert cmp.verdict == "FAIL" and "best 1.20x" in cmp.text()
    assert got["server.ctxkit_vs_raw"].value == pytest.approx(1.0)
    assert got["server.cupy_rps"].value == 100.0 and got["server.cupy_rps"].verdict == "INFO"
    r["ctxkit_many"] = [110.0, 120.0, 115.0]
    assert {ln.name: ln for ln in bench.verdicts(r)}["server.ctxkit_vs_cupy"].verdict == "PASS"
    r["cupy_wrong"] = 1
    got = {ln.name: ln for ln in bench.verdicts(r)}
    assert got["server.cupy_results"].verdict == "FAIL"
    assert got["server.ctxkit_vs_cupy"].value is None
    assert got["server.ctxkit_vs_cupy"].verdict == "FAIL"


def test_nvrtc_cubin_compiles_for_the_device_arch(bench):
    cubin = bench.nvrtc_cubin(bench.SOURCE, "sm_90")
    assert cubin[:4] == b"\x7fELF"
    with pytest.raises(RuntimeError, match="nvrtcCompileProgram failed"):
        bench.nvrtc_cubin("this is not CUDA", "sm_90")


def test_a_failing_call_in_a_serving_thread_is_raised_not_hung(bench, gpu):
    bench.calls.refuse.add("raw")
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed"):
        bench.main(["--quick", *SMALL])
    assert gpu.current() == 0  # nothing left pushed in this thread


class FakeCupyArray:
    """A CuPy device array on the host, with the checks of ``ndarray.set``/``get``."""

    def __init__(self, n: int, dtype) -> None:
        self.a = np.zeros(n, dtype)
        self.shape, self.dtype = self.a.shape, self.a.dtype

    def _same(self, arr) -> None:
        if not isinstance(arr, np.ndarray) or arr.dtype != self.dtype:
            raise TypeError("CuPy takes a numpy array of the same dtype")
        if arr.shape != self.shape:
            raise ValueError("Shape mismatch")

    def set(self, arr, stream=None):
        self._same(arr)
        assert stream is not None and stream.entered, "the copy runs on the thread's stream"
        self.a[...] = arr

    def get(self, stream=None, order="C", out=None, blocking=True):
        self._same(out)
        assert stream is not None and not blocking
        out[...] = self.a
        return out


def fake_cupy() -> tuple[types.ModuleType, types.ModuleType]:
    """Just the CuPy API bench_server uses (signatures as in CuPy 13), computing on the
    host: ``RawKernel`` calls take tuples for grid and block, as CuPy's do."""

    class Stream:
        def __init__(self, null=False, non_blocking=False, ptds=False):
            assert non_blocking
            self.entered = False

        def __enter__(self):
            self.entered = True
            return self

        def __exit__(self, *exc):
            self.entered = False

        def synchronize(self):
            return None

    class Device:
        def __init__(self, device=None):
            self.id = device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    class RawKernel:
        def __init__(self, code, name, options=(), backend="nvrtc", **kw):
            assert name in code
            self.compiled = False

        def compile(self, log_stream=None):
            self.compiled = True

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            assert self.compiled and isinstance(grid, tuple) and isinstance(block, tuple)
            x, y, n = args
            assert isinstance(n, np.int32) and grid[0] * block[0] >= n
            y.a[:n] = 2 * x.a[:n] + 1

    cp = types.ModuleType("cupy")
    cp.__version__ = "13.fake"
    cp.float32 = np.float32
    cp.RawKernel = RawKernel
    cp.empty = lambda shape, dtype=float, order="C": FakeCupyArray(shape, dtype)
    cp.cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, runtime=types.SimpleNamespace(getDeviceCount=lambda: 1)
    )
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=float, order="C": np.empty(shape, dtype)
    return cp, cupyx


def test_with_cupy_the_comparison_is_made(bench, monkeypatch, capsys):
    cp, cupyx = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    served: set[str] = set()
    serve = bench.CupySide.serve

    def counted(self, gate, requests):
        served.add(threading.current_thread().name)
        return serve(self, gate, requests)

    monkeypatch.setattr(bench.CupySide, "serve", counted)
    assert bench.main(SMALL) == 0
    got = lines(capsys.readouterr().out)
    assert got["server.cupy_results"].endswith(" ok")
    assert got["server.cupy_rps"].endswith(" INFO")
    cmp = got["server.ctxkit_vs_cupy"]
    assert cmp.endswith((" PASS", " FAIL")) and "median of per-round ratios" in cmp
    assert served and not any(name.startswith("ctxkit") for name in served)
    assert got["server.ctxkit_graph_vs_cupy"].endswith(" INFO")


def test_graph_lines_compare_replayed_requests_with_raw_and_cupy(bench):
    r = {"threads": 8, "requests": 100, "nbytes": 65536, bench.QUICK: False}
    for side, many in (("ctxkit", [90.0] * 3), ("ctxkit_graph", [150.0, 130.0, 140.0]),
                       ("raw", [100.0] * 3), ("cupy", [70.0] * 3)):  # fmt: skip
        r.update({f"{side}_many": many, f"{side}_one": [10.0] * 3})
        r.update({f"{side}_wrong": 0, f"{side}_checked": 27})
    got = {ln.name: ln for ln in bench.verdicts(r)}
    assert got["server.ctxkit_graph_vs_raw"].value == pytest.approx(1.4)
    assert got["server.ctxkit_graph_vs_cupy"].value == pytest.approx(2.0)
    assert got["server.ctxkit_graph_vs_raw"].verdict == "INFO"
    r["ctxkit_graph_wrong"] = 2
    got = {ln.name: ln for ln in bench.verdicts(r)}
    assert got["server.ctxkit_graph_results"].verdict == "FAIL"
    assert got["server.ctxkit_graph_vs_raw"].value is None
