"""The lease protocol between a DevicePool and its workers, on the fake driver: the real
worker loop (in a thread, over real pipes) frees lent memory when releases arrive with a
task or on their own and waits for the parent before a restart; a real pool (workers
without CUDA) sends releases to idle workers and with the next task to busy ones, closes
the parent's WorkerBuffers before a worker is told to exit or when it dies, places a
task with device arguments on the device that holds them, refuses one no device can map,
and keeps the arguments alive until the task is over."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import weakref
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import ContextClosedError, ContextPoisonedError
from ctxkit.memory import ipc
from ctxkit.procs import DevicePool, DeviceTaskError, WorkerBuffer, devmem, wire
from ctxkit.procs.pool import _serve
from tests.procs.pool_tasks import where_am_i
from tests.procs.proctools import gate_open, wait_for
from tests.procs.test_devmem_fake import Process, allocate

MP = multiprocessing.get_context("spawn")


def task(fn: Any, *args: Any) -> bytes:
    return wire.Payload.build("test", (fn, args, {}), None, False).data


def poisoned() -> None:
    raise ContextPoisonedError("a kernel faulted", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")


# --- the worker loop ------------------------------------------------------------------


class Loop:
    """The pool worker's loop (``_serve``) in a thread with the fake context bound, over
    real pipes."""

    def __init__(self, ctx: Any) -> None:
        self.task_r, self.task_w = MP.Pipe(duplex=False)
        self.result_r, self.result_w = MP.Pipe(duplex=False)
        self.leases = devmem.WorkerLeases()
        self.thread = threading.Thread(target=self._run, args=(ctx,), daemon=True)
        self.thread.start()

    def _run(self, ctx: Any) -> None:
        with ctx:
            _serve(self.task_r, self.result_w, 0, ctx, None, self.leases)

    def ask(self, msg: Any) -> tuple[Any, ...]:
        self.task_w.send(msg)
        assert self.result_r.poll(30), "the worker loop did not answer"
        return self.result_r.recv()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.thread.join(30)
        for c in (self.task_r, self.task_w, self.result_r, self.result_w):
            c.close()


def test_the_worker_frees_lent_memory_when_releases_arrive(vfake, vctx0):
    loop = Loop(vctx0)
    kind, tid, out, restart = loop.ask((1, task(allocate, 4096, 1), [], []))
    assert (kind, tid, out[0], restart) == ("result", 1, "ok", False)
    first, second = out[3]
    ptrs = [p for p, e in vfake.allocs.items() if e[1] in (4096, 24)]
    assert len(loop.leases) == 2 and len(ptrs) == 2

    loop.task_w.send(("release", [first]))  # on its own, while idle
    _kind, _tid, out, _ = loop.ask((2, task(int, 5), [], [second]))  # with the next task
    assert out[0] == "ok" and wire.decode(out[1], out[2]) == 5
    assert len(loop.leases) == 0
    gc.collect()
    assert not any(p in vfake.allocs for p in ptrs)  # freed in the worker's context
    loop.task_w.send(None)
    loop.close()
    assert not loop.thread.is_alive()


def test_a_restarting_worker_keeps_lent_memory_until_the_parent_says_stop(vfake, vctx0):
    loop = Loop(vctx0)
    leases = loop.ask((1, task(allocate, 4096, 1), [], []))[2][3]
    _kind, _tid, out, restart = loop.ask((2, task(poisoned), [], []))
    assert out[0] == "error" and restart is True
    loop.task_w.send(("release", leases[:1]))
    loop.thread.join(0.3)
    assert loop.thread.is_alive() and len(loop.leases) == 1  # still lending the other
    loop.task_w.send(None)
    loop.close()
    assert not loop.thread.is_alive()


def test_a_restarting_worker_that_lends_nothing_exits_at_once(vfake, vctx0):
    loop = Loop(vctx0)
    assert loop.ask((1, task(poisoned), [], []))[3] is True
    loop.close()
    assert not loop.thread.is_alive()


def test_a_worker_frees_what_it_lent_when_it_exits(vfake, vctx0):
    loop = Loop(vctx0)
    loop.ask((1, task(allocate, 4096, 1), [], []))
    loop.task_w.send(None)
    loop.close()
    gc.collect()
    assert not [e for e in vfake.allocs.values() if e[1] == 4096]


# --- the pool's side ------------------------------------------------------------------


class Recorder:
    """A worker's task pipe that records what the pool sends (and sends it on)."""

    def __init__(self, conn: Any, watch: Any = None) -> None:
        self.conn = conn
        self.sent: list[Any] = []
        self.watch = watch
        self.closed_at_stop: bool | None = None

    def send(self, msg: Any) -> None:
        if msg is None and self.watch is not None:
            self.closed_at_stop = self.watch.closed
        self.sent.append(msg)
        self.conn.send(msg)

    def close(self) -> None:
        self.conn.close()

    def releases(self) -> list[Any]:
        return [m for m in self.sent if m is not None and m[0] == "release"]


def lend(pool: DevicePool, ctx: Any, lease: int = 7) -> tuple[WorkerBuffer, Any]:
    """A WorkerBuffer of the pool's worker of device 0 (its memory made here, exported
    as if by that worker)."""
    src = ck.DeviceBuffer(4096, context=ctx)
    src.memset(4)
    with Process("the-worker").acting():
        handle = ipc.export_buffer(src)
    pid = pool.pids[0]
    assert pid is not None
    buf = pool._book.adopt((0, pid), handle, lease, "the-worker")
    return buf, src


def spy(pool: DevicePool, ordinal: int = 0, watch: Any = None) -> Recorder:
    slot = pool._by_key[ordinal]
    with pool._lock:
        rec = Recorder(slot.task_w, watch)
        slot.task_w = rec
    return rec


@pytest.fixture
def pool():
    with DevicePool([0], _bind=False) as p:
        p.submit(int).result(60)  # the worker is up
        yield p


def test_a_release_reaches_an_idle_worker_on_its_own(vfake, vctx0, pool):
    buf, _src = lend(pool, vctx0)
    rec = spy(pool)
    assert (buf.copy_to_host() == 4).all()
    buf.close()
    wait_for(lambda: rec.releases(), 30, "the release message")
    assert rec.releases() == [("release", [7])]


def test_a_busy_worker_gets_its_releases_with_the_next_task(vfake, vctx0, pool, tmp_path):
    gate = str(tmp_path / "go")
    buf, _src = lend(pool, vctx0)
    rec = spy(pool)
    busy = pool.submit(gate_open, gate)
    wait_for(lambda: pool._by_key[0].state == "busy", 30, "the worker to be busy")
    nxt = pool.submit(int, 3)
    del buf
    gc.collect()
    pool._wake()
    wait_for(lambda: pool._by_key[0].releases == [7], 30, "the release to be queued")
    assert rec.releases() == []  # not while the worker runs a task
    open(gate, "w").close()
    busy.result(60)
    assert nxt.result(60) == 3
    tasks = [m for m in rec.sent if m is not None and m[0] != "release"]
    assert tasks[-1][3] == [7]  # carried by the next task


def test_shutdown_closes_worker_buffers_before_the_worker_is_told_to_exit(vfake, vctx0):
    pool = DevicePool([0], _bind=False)
    pool.submit(int).result(60)
    buf, _src = lend(pool, vctx0)
    arr = ck.DeviceArray(buf, (1024,), np.float32)
    rec = spy(pool, watch=buf)
    syncs = len(vfake.calls("ctxsync"))
    pool.shutdown(wait=True)
    assert rec.sent[-1] is None and rec.closed_at_stop is True
    assert len(vfake.calls("ctxsync")) > syncs  # its context synchronized first
    for obj in (buf, arr):
        with pytest.raises(ContextClosedError, match=r"shut down.*device 0 \(pid \d+\)"):
            obj.copy_to_host()
    assert not any(vfake.ipc_opens.values())


def test_a_dead_workers_buffers_are_closed_with_the_reason(vfake, vctx0, pool):
    buf, _src = lend(pool, vctx0)
    pid = pool.pids[0]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: buf.closed, 30, "the buffer to be closed")
    with pytest.raises(ContextClosedError, match=r"its worker was killed by SIGKILL"):
        buf.copy_to_host()
    wait_for(lambda: pool.pids[0] not in (None, pid), 60, "a replacement worker")
    assert pool.submit(int, 2).result(60) == 2


def test_terminate_closes_worker_buffers(vfake, vctx0):
    pool = DevicePool([0], _bind=False)
    pool.submit(int).result(60)
    buf, _src = lend(pool, vctx0)
    pool.terminate()
    with pytest.raises(ContextClosedError, match="terminated"):
        buf.copy_to_host()


def test_a_task_goes_to_the_device_that_holds_its_memory(vfake, vctx0, vctx1):
    buf = ck.DeviceBuffer(4096, context=vctx1)
    with DevicePool([0, 1], _bind=False) as pool:
        assert [pool.submit_to(d, where_am_i).result(60) for d in (0, 1)] == [0, 1]  # both up
        assert {pool.submit(where_am_i).result(60) for _ in range(4)} == {0, 1}
        for _ in range(3):
            # the worker (no CUDA here) cannot map it: the error says where it ran
            err = pool.submit(where_am_i, buf).exception(60)
            assert isinstance(err, DeviceTaskError) and err.device == 1
        assert vfake.calls("ctxsync")[-1][1] == vctx1.handle  # synchronized at submit


def test_a_task_no_pool_device_can_map_is_refused_at_submit(vfake, vctx1, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # isolate=True reads it
    buf = ck.DeviceBuffer(4096, context=vctx1)
    vfake.no_peer = True
    with DevicePool([0], _bind=False) as pool:
        with pytest.raises(
            ValueError, match=r"no device of this pool \[0\].*cuDeviceCanAccessPeer"
        ):
            pool.submit(where_am_i, buf)
        with pytest.raises(ValueError, match=r"cuDeviceCanAccessPeer\(0, 1\) is 0"):
            pool.submit_to(0, where_am_i, buf)
    vfake.no_peer = False
    with DevicePool([0], _bind=False, isolate=True) as pool:
        with pytest.raises(ValueError, match="isolate=True"):
            pool.submit_to(0, where_am_i, buf)


def test_device_arguments_are_kept_alive_until_the_task_is_over(vfake, vctx0, pool, tmp_path):
    gate = str(tmp_path / "go")
    buf = ck.DeviceBuffer(4096, context=vctx0)
    alive = weakref.ref(buf)
    first = pool.submit(gate_open, gate)
    queued = pool.submit(where_am_i, buf)
    del buf
    gc.collect()
    assert alive() is not None  # queued: the parent holds it
    open(gate, "w").close()
    first.result(60)
    queued.exception(60)
    gc.collect()
    assert alive() is None  # the task is over: let go
