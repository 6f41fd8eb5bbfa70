"""A small program exercising ctxkit's core paths, for ``scripts/sanitizer.sh``.

Allocations, every copy direction, launches of the ``ptx/`` kernels (one uses shared
memory and atomics, for racecheck), prepared launches, a graph, streams and events with a
cross-device wait, a peer copy, managed memory, a ContextExecutor and a Pipeline, on every
device; each result is checked against numpy and everything is closed before exit, so a
leak check reports only real leaks. Sizes are small: under compute-sanitizer kernels run
10-100x slower.

    PYTHONPATH=. compute-sanitizer --tool memcheck python3 scripts/sanitizer_workload.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import ctxkit as ck  # noqa: E402
from ctxkit.compiler import kernel_source  # noqa: E402

N = 1 << 16
BLOCK = 256


def load() -> dict[str, Any]:
    names = {
        "vector_add.cu": ["vector_add"],
        "saxpy.cu": ["saxpy"],
        "scale.cu": ["scale_f32"],
        "reduce.cu": ["reduce_sum_f32"],
        "fill.cu": ["fill_f32"],
    }
    out: dict[str, Any] = {}
    with ck.bind(0):
        for file, kernels in names.items():
            mod = ck.Module.load(ck.compile(kernel_source(file), name=file))
            for k in kernels:
                out[k] = mod.function(k)
        ptx = ck.Module.load(kernel_source("vector_add_lowisa.ptx"))
        out["vector_add_ptx"] = ptx.function("vector_add_ptx")
    return out


def expect(what: str, ok: bool) -> None:
    if not ok:
        raise AssertionError(f"sanitizer workload: wrong result: {what}")


def per_device(ctx: ck.Context, k: dict[str, Any], rng: np.random.Generator) -> None:
    grid = (N + BLOCK - 1) // BLOCK
    a = rng.random(N, dtype=np.float32)
    b = rng.random(N, dtype=np.float32)
    with ctx:
        s = ck.Stream()
        da, db, dc = (ck.DeviceBuffer(N * 4) for _ in range(3))
        pin = ck.pinned_empty(N, np.float32)
        da.copy_from_host(a)
        np.copyto(pin, b)
        db.copy_from_host(pin, stream=s)
        k["vector_add"].launch(grid, BLOCK, da, db, dc, N, stream=s)
        dc.copy_to_host(pin, stream=s)
        s.synchronize()
        expect("vector_add", np.array_equal(pin, a + b))

        k["vector_add_ptx"].launch(grid, BLOCK, da, db, dc, N)
        expect("vector_add_ptx", np.array_equal(dc.copy_to_host(np.empty(N, np.float32)), a + b))

        k["saxpy"].launch(grid, BLOCK, np.float32(2.0), da, db, N)
        expect("saxpy", np.array_equal(db.copy_to_host(np.empty(N, np.float32)), 2 * a + b))

        total = ck.DeviceBuffer(4)
        total.memset(0)
        k["reduce_sum_f32"].launch(64, BLOCK, da, total, N)
        got = float(total.copy_to_host(np.empty(1, np.float32))[0])
        expect("reduce_sum_f32", abs(got - float(a.sum(dtype=np.float64))) < 1e-3 * N)

        arr = ck.device_array((N,), np.float32)
        prepared = k["fill_f32"].prepare(grid, BLOCK, arr, 1.0, N, stream=s)
        prepared()
        prepared.set_arg(1, 4.0)
        prepared()
        k["scale_f32"].launch(grid, BLOCK, arr, dc, N, np.float32(1.0), stream=s)  # loaded here
        with ck.capture(s) as graph:
            k["scale_f32"].launch(grid, BLOCK, arr, dc, N, np.float32(0.5), stream=s)
        graph.launch(s)
        s.synchronize()
        expect("prepared + graph", bool(np.all(dc.copy_to_host(np.empty(N, np.float32)) == 2.0)))

        dc.copy_from(da, stream=s)
        db[: N * 2].memset(0, stream=s)
        s.synchronize()
        expect("device copy", np.array_equal(dc.copy_to_host(np.empty(N, np.float32)), a))

        managed = ck.ManagedBuffer(N * 4)
        view = managed.as_numpy(np.float32)
        view[:] = a
        k["scale_f32"].launch(grid, BLOCK, managed, managed, N, np.float32(3.0))
        ctx.synchronize()
        expect("managed", np.array_equal(view, a * np.float32(3.0)))
        del view

        for obj in (graph, s, da, db, dc, total, arr.buffer, managed):
            obj.close()


def cross_device(ctxs: list[ck.Context], k: dict[str, Any]) -> None:
    c0, c1 = ctxs[0], ctxs[-1]
    x = np.arange(N, dtype=np.float32)
    with c0:
        s0, s1 = ck.Stream(c0), ck.Stream(c1)
        src, mid = ck.DeviceBuffer(N * 4, c0), ck.DeviceBuffer(N * 4, c0)
        dst, out = ck.DeviceBuffer(N * 4, c1), ck.DeviceBuffer(N * 4, c1)
        src.copy_from_host(x)
        k["scale_f32"].launch((N + BLOCK - 1) // BLOCK, BLOCK, src, mid, N, np.float32(2.0),
                              stream=s0)  # fmt: skip
        done = s0.record(timing=False)
        s1.wait(done)
        ck.copy_peer(dst, mid, stream=s1)
        with c1:
            k["scale_f32"].launch((N + BLOCK - 1) // BLOCK, BLOCK, dst, out, N,
                                  np.float32(3.0), stream=s1)  # fmt: skip
        s1.synchronize()
        expect("cross-device", np.array_equal(out.copy_to_host(np.empty(N, np.float32)), 6 * x))
        for obj in (s0, s1, src, mid, dst, out, done):
            obj.close()


def threads_and_pipeline(k: dict[str, Any]) -> None:
    def task(i: int) -> bool:
        buf = ck.DeviceBuffer(1024 * 4)
        k["fill_f32"].launch(4, BLOCK, buf, float(i), 1024)
        ok = bool(np.all(buf.copy_to_host(np.empty(1024, np.float32)) == i))
        buf.close()
        return ok

    with ck.ContextExecutor(0, max_workers=4) as ex:
        expect("executor", all(ex.map(task, range(32))))
    x = np.random.default_rng(3).random(1 << 20, dtype=np.float32)
    with ck.Pipeline(options=ck.PipelineOptions(chunk_bytes=1 << 20)) as p:
        out = p.map(k["scale_f32"], x, args=(np.float32(2.0),))
        expect("pipeline pageable", np.array_equal(out, 2 * x))
        pinned = ck.pinned_empty(x.shape, x.dtype)
        pinned[:] = x
        out = p.map(k["scale_f32"], pinned, args=(np.float32(3.0),))
        expect("pipeline pinned", np.array_equal(out, x * np.float32(3.0)))


def main() -> int:
    n = ck.device_count()
    if n == 0:
        print("no GPU: sanitizer_workload.py needs an NVIDIA GPU and driver", file=sys.stderr)
        return 2
    ctxs = [ck.registry.context(i) for i in range(n)]
    k = load()
    rng = np.random.default_rng(0)
    for ctx in ctxs:
        per_device(ctx, k, rng)
    cross_device(ctxs, k)
    threads_and_pipeline(k)
    print(f"sanitizer workload OK on {n} device(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
