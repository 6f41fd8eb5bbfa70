"""Reliability: a 64-thread x 5,000-operation stress over three contexts, and exit safety.

The stress binds and unbinds contexts in random nests (``with ctx``, ``ck.bind`` by context
and by ordinal, ``push``/``pop``), allocates and frees small buffers (also while another
context is current, and from threads with nothing current), launches small kernels on
per-thread streams and checks their results, and synchronizes streams. After every
operation the driver's current context (``cuCtxGetCurrent``) must be the one the thread
expects; at the end no thread may have a push left over, and the device memory this process
holds (NVML's per-process figure: other test workers use the device meanwhile) must be back
to its baseline. The baseline is taken after a short warm-up round of the same stress (same
threads, fewer operations): the driver reserves memory per context lazily the first time
it is busy (kernel loading, stream and launch resources; measured after a one-operation warm-up
on H200/CUDA 13.0: 66 MiB on a device with two contexts, 32 MiB with one) and keeps it; only
growth in a second round is a leak. ``CTXKIT_STRESS_THREADS`` /
``CTXKIT_STRESS_OPS`` / ``CTXKIT_STRESS_WARMUP_OPS`` change the size.

Run with ``-s`` to see the figures (they are also recorded as junit properties).
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.compiler import kernel_source
from ctxkit.context import Context, thread_state
from tests.support.helpers import process_device_memory, raw_current

REPO = Path(__file__).resolve().parents[2]
THREADS = int(os.environ.get("CTXKIT_STRESS_THREADS", "64"))
OPS = int(os.environ.get("CTXKIT_STRESS_OPS", "5000"))
WARMUP_OPS = int(os.environ.get("CTXKIT_STRESS_WARMUP_OPS", "200"))
MAX_DEPTH = 6
SCRATCH = 2048  # float32 elements per thread and context
MEMORY_TOLERANCE = 8 << 20
#: Operation mix: binds dominate (the point of the test), device work is sized for ~2 min.
WEIGHTS = {"push": 30, "pop": 30, "alloc": 8, "free": 6, "launch": 14, "sync": 8, "verify": 4}


@pytest.fixture(scope="module")
def fill() -> Any:
    with ck.bind(0):
        return ck.Module.load(ck.compile(kernel_source("fill.cu"), name="fill.cu")).function(
            "fill_f32"
        )


@pytest.fixture(scope="module")
def pool() -> Any:
    """Three contexts on (up to) two devices: the primaries plus owned ones to make three."""
    n = min(2, ck.device_count())
    primaries = [ck.registry.context(i) for i in range(n)]
    owned = [Context.create(0) for _ in range(3 - n)]
    yield [*primaries, *owned]
    for c in owned:
        c.close()


class Walker:
    """One stress thread: random operations, checked against its own expectations."""

    def __init__(self, seed: int, pool: list[Context], fill: Any, ops: int = OPS) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.pool = pool
        self.fill = fill
        self.stack: list[Context] = []
        self.streams = {c.handle: ck.Stream(c) for c in pool}
        self.scratch = {c.handle: ck.DeviceBuffer(SCRATCH * 4, c) for c in pool}
        self.expected: dict[int, float] = {}
        self.live: list[tuple[ck.DeviceBuffer, np.ndarray]] = []
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        names = list(WEIGHTS)
        self.choices = self.rng.choices(names, [WEIGHTS[o] for o in names], k=ops)

    def top(self) -> Context | None:
        return self.stack[-1] if self.stack else None

    # --- operations ------------------------------------------------------------------

    def push(self) -> None:
        if len(self.stack) >= MAX_DEPTH:
            return self.pop()
        c = self.rng.choice(self.pool)
        how = self.rng.randrange(4)
        if how == 0:
            c.__enter__()
        elif how == 1:
            ck.bind(c).__enter__()
        elif how == 2 and c.is_primary:
            got = ck.bind(c.device.ordinal).__enter__()
            if got is not c:
                self.problems.append(f"bind({c.device.ordinal}) gave {got!r}, not {c!r}")
        else:
            c.push()
        self.stack.append(c)
        return None

    def pop(self) -> None:
        if not self.stack:
            return self.push()
        c = self.stack.pop()
        if self.rng.random() < 0.5:
            c.__exit__(None, None, None)
        else:
            c.pop()
        return None

    def alloc(self) -> None:
        top = self.top()
        n = self.rng.randrange(1, 4096)
        if top is None:
            try:
                ck.DeviceBuffer(n)
            except ck.NoCurrentContextError:
                self.counts["expected_no_context"] += 1
                return
            self.problems.append("DeviceBuffer() with no current context did not raise")
            return
        data = np.frombuffer(self.rng.randbytes(n), np.uint8)
        buf = ck.DeviceBuffer(n)
        if buf.context != top:
            self.problems.append(f"buffer allocated in {buf.context!r}, current is {top!r}")
        buf.copy_from_host(data)
        self.live.append((buf, data))
        if len(self.live) > 4:
            self.free()

    def free(self) -> None:
        if not self.live:
            return
        buf, data = self.live.pop(self.rng.randrange(len(self.live)))
        if self.top() is not None:
            got = buf.copy_to_host()
            if not np.array_equal(got, data):
                self.problems.append(f"buffer {buf!r} lost its contents")
        buf.close()  # freed in its own context, whatever is current (or nothing)

    def launch(self) -> None:
        top = self.top()
        value = float(self.rng.randrange(1, 1 << 20))
        if top is None:  # the kernel binds its stream's context, and leaves nothing current
            c = self.pool[0]
            self.fill.launch(
                1, 128, self.scratch[c.handle], value, SCRATCH, stream=self.streams[c.handle]
            )
            self.expected[c.handle] = value
            self.counts["implicit_bind"] += 1
            if raw_current():
                self.problems.append("a launch with no current context left one current")
            return
        blocks = self.rng.randrange(1, 5)
        stream = self.streams[top.handle]
        self.fill.launch(blocks, 128, self.scratch[top.handle], value, SCRATCH, stream=stream)
        self.expected[top.handle] = value

    def sync(self) -> None:
        c = self.rng.choice(self.pool)
        if self.top() is None:  # the stream binds its own context for the call
            self.streams[c.handle].synchronize()
            self.counts["implicit_bind"] += 1
            if raw_current():
                self.problems.append("Stream.synchronize with no context left one current")
            return
        self.streams[c.handle].synchronize()

    def verify(self) -> None:
        if self.top() is None:
            return
        c = self.rng.choice(self.pool)
        self.check_scratch(c)

    def check_scratch(self, c: Context) -> None:
        self.streams[c.handle].synchronize()
        want = self.expected.get(c.handle)
        if want is None:
            return
        got = self.scratch[c.handle].copy_to_host(np.empty(SCRATCH, np.float32))
        if not np.all(got == np.float32(want)):
            self.problems.append(f"kernel result in {c!r}: {got[:4]} != {want}")
        self.counts["verified"] += 1

    # --- the walk --------------------------------------------------------------------

    def run(self) -> None:
        st = thread_state()
        for i, op in enumerate(self.choices):
            getattr(self, op)()
            self.counts[op] += 1
            want = self.stack[-1].handle if self.stack else 0
            got = raw_current()
            if got != want:
                self.problems.append(f"op {i} ({op}): driver {got:#x} != expected {want:#x}")
                break
            if len(st.stack) != len(self.stack):
                self.problems.append(
                    f"op {i} ({op}): ctxkit records {len(st.stack)} pushes, "
                    f"the walk made {len(self.stack)}"
                )
                break
        while self.stack:
            self.pop()
        with self.pool[0]:
            for c in self.pool:
                self.check_scratch(c)
            for buf, _ in self.live:
                buf.close()
            for stream in self.streams.values():
                stream.close()
            for scratch in self.scratch.values():
                scratch.close()
        self.live.clear()
        if raw_current() != 0 or st.stack:
            self.problems.append(f"leaked pushes: driver {raw_current():#x}, ctxkit {st.stack}")


def _held(pool: list[Context]) -> dict[int, int]:
    """Device memory this process holds per device (NVML's per-process figure; where NVML
    is missing, total minus free: then other processes' use on the device counts too)."""
    gc.collect()
    held = {}
    for c in pool:
        d = c.device
        mine = process_device_memory(d.pci_bus_id)
        if mine is None:
            free, total = c.memory_info()
            mine = total - free
        held[d.ordinal] = mine
    return held


def _warm_up(pool: list[Context], fill: Any) -> None:
    """One of each operation in every context: alloc/free, a launch on the default stream
    and on a created stream, stream and context synchronize, stream destroy."""
    for c in pool:
        with c:
            buf = ck.DeviceBuffer(SCRATCH * 4)
            fill.launch(1, 128, buf, 1.0, SCRATCH)
            stream = ck.Stream()
            fill.launch(4, 128, buf, 2.0, SCRATCH, stream=stream)
            stream.synchronize()
            c.synchronize()
            stream.close()
            buf.close()


class Round:
    """*threads* Walkers of *ops* operations each, run at once; what they found."""

    def __init__(self, pool: list[Context], fill: Any, threads: int, ops: int, seed0: int) -> None:
        self.walkers: list[Walker] = []
        self.crashes: list[str] = []
        lock = threading.Lock()

        def body(seed: int) -> None:
            try:
                w = Walker(seed, pool, fill, ops)
                with lock:
                    self.walkers.append(w)
                w.run()
            except BaseException as exc:
                with lock:
                    self.crashes.append(f"seed {seed}: {type(exc).__name__}: {exc}")

        seeds = range(seed0, seed0 + threads)
        workers = [threading.Thread(target=body, args=(s,), name=f"stress-{s}") for s in seeds]
        t0 = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        self.seconds = time.perf_counter() - t0
        self.problems = [p for w in self.walkers for p in w.problems]
        self.totals: Counter[str] = Counter()
        for w in self.walkers:
            self.totals.update(w.counts)


def _mib(before: dict[int, int], after: dict[int, int]) -> dict[int, float]:
    return {d: round((after[d] - before[d]) / 2**20, 1) for d in before}


@pytest.mark.slow
def test_thread_stress(pool: list[Context], fill: Any, record_property: Any) -> None:
    main_before = (raw_current(), len(thread_state().stack))
    _warm_up(pool, fill)
    start = _held(pool)
    warm = Round(pool, fill, THREADS, WARMUP_OPS, seed0=THREADS)
    baseline = _held(pool)
    run = Round(pool, fill, THREADS, OPS, seed0=0)
    after = _held(pool)
    delta = {d: after[d] - baseline[d] for d in baseline}
    figures = {
        "threads": THREADS,
        "ops_per_thread": OPS,
        "seconds": round(run.seconds, 1),
        "ops": sum(run.totals[o] for o in WEIGHTS),
        "mismatches": len(run.problems),
        "crashes": len(run.crashes),
        "warmup_ops_per_thread": WARMUP_OPS,
        "warmup_reserved_mib": _mib(start, baseline),
        "memory_delta_mib": _mib(baseline, after),
        "memory_held_mib": {d: round(v / 2**20, 1) for d, v in after.items()},
        **{k: v for k, v in sorted(run.totals.items())},
    }
    for k, v in figures.items():
        record_property(k, v)
    print(f"\nRELIABILITY stress {figures}")
    for r in (warm, run):
        assert r.crashes == []
        assert r.problems == []
        assert len(r.walkers) == THREADS
    assert (raw_current(), len(thread_state().stack)) == main_before
    for d, v in delta.items():
        assert v <= MEMORY_TOLERANCE, (
            f"device {d}: {v / 2**20:.1f} MiB not back after the stress "
            f"(the warm-up round had already reserved {figures['warmup_reserved_mib'][d]} MiB)"
        )


@pytest.mark.slow
def test_exit_safety() -> None:
    runs = os.environ.get("CTXKIT_EXIT_SAFETY_RUNS", "2")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/exit_safety.py"), "--runs", runs, "--jobs", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "runs clean" in proc.stdout
