"""Pin on reuse on real GPUs: reused arrays held and released, only their own bytes
registered (copies of a heap neighbour, of slices of the array and of the rest of its
owner by ctxkit, PyTorch and CuPy still work), one registration serving pipelines on
several devices, and freed memory never left registered (inside a stream capture,
after the registering context closed)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.memory.host import host_pointer_kind
from ctxkit.pipeline import Pipeline
from ctxkit.pipeline.staging import relaxed_capture
from tests.pipeline.gpu_support import (  # noqa: F401
    PAGE,
    PATH_NAMES,
    assert_held,
    assert_unregistered,
    foreign_buffer,
    kern,
    lanes,
    need_devices,
    random_array,
)


@pytest.mark.parametrize("ndev", [1, pytest.param(2, marks=pytest.mark.multigpu), "green2"])
def test_pin_on_reuse_holds_reused_arrays_and_releases_them(kern, ndev):
    n = (64 << 20) // 4 + 5
    x = random_array(n, np.float32, 21)
    out = np.zeros_like(x)
    with Pipeline(lanes(ndev)) as p:
        paths = []
        for _ in range(3):
            out[:] = 0
            p.map(kern["scale_f32"], x, out, args=(2.0,))
            np.testing.assert_array_equal(out, x * np.float32(2))
            paths.append(p.last_stats.path)
        assert paths == [PATH_NAMES["staged"]] + ["in=held, out=held"] * 2
        assert_held(x, out)
        assert p.pinned_bytes == x.nbytes + out.nbytes
        ptr = int(x.ctypes.data)
        del x
        gc.collect()
        assert host_pointer_kind(ptr) == "pageable"  # unlocked before numpy freed it
        assert p.release_pinned() == out.nbytes and p.pinned_bytes == 0
        assert_unregistered(out)
        y = random_array(n, np.float32, 22)
        p.map(kern["scale_f32"], y, out, args=(3.0,))
        p.map(kern["scale_f32"], y, out, args=(3.0,))
        assert p.last_stats.path == "in=held, out=held"
        np.testing.assert_array_equal(out, y * np.float32(3))
    assert_unregistered(y, out)  # close() unlocked them


def _row(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``before``, ``x``, ``after`` back to back in one buffer, each its own memory owner,
    as glibc places heap arrays of 8-32 MiB after a large free: x (16 MiB and a few bytes,
    held by pin on reuse) shares its first page with the end of ``before`` and its last
    page with the start of ``after`` (1 MiB and a few bytes each)."""
    n, m = (16 << 20) // 4 + 5, (1 << 20) // 4 + 3
    raw = np.empty(n + 2 * m + 2 * PAGE, np.float32)
    s = -int(raw.ctypes.data) % PAGE + 16
    before, x, after = (
        np.frombuffer(raw.data, np.float32, count=k, offset=s + 4 * off)
        for k, off in ((m, 0), (n, m), (m, m + n))
    )
    x[:] = random_array(n, np.float32, seed)
    assert all(int(a.ctypes.data) % PAGE for a in (before, x, after))
    return before, x, after


def _copy_through_the_gpu(copier: str, b: np.ndarray, want: np.ndarray) -> None:
    """Copy *b* to the device and back into *b* with *copier*'s own pageable copies."""
    if copier == "torch":
        torch = pytest.importorskip("torch")
        t = torch.from_numpy(b).to("cuda")
        b[:] = 0
        torch.from_numpy(b).copy_(t)  # D2H straight into b, through a cpu tensor over it
        torch.cuda.synchronize()
    elif copier == "cupy":
        cp = pytest.importorskip("cupy")
        d = cp.asarray(b)
        b[:] = 0
        d.get(out=b)
        cp.cuda.Device().synchronize()
    elif copier == "to_device":
        d = ck.to_device(b, context=ck.registry.context(0))
        b[:] = 0
        np.copyto(b, d.to_host().reshape(b.shape))
    else:
        buf = ck.DeviceBuffer(b.nbytes, context=ck.registry.context(0))
        buf.copy_from_host(b)
        np.testing.assert_array_equal(buf.copy_to_host().view(np.float32), want)
        b[:] = 0
        buf.copy_to_host(b)
        buf.close()
    np.testing.assert_array_equal(b, want)


@pytest.mark.parametrize("copier", ["ctxkit", "torch", "cupy"])
@pytest.mark.parametrize("side", ["before", "after"])
def test_neighbour_of_a_held_array_is_copied_by_anyone(kern, side, copier):
    if copier != "ctxkit":
        pytest.importorskip(copier)
    before, x, after = _row(25)
    b = before if side == "before" else after
    out = np.zeros_like(x)
    with Pipeline([0]) as p:
        for _ in range(2):
            p.map(kern["scale_f32"], x, out, args=(2.0,))
        assert p.last_stats.path == "in=held, out=held"
        assert_held(x)  # not the bytes before it, on the page x shares with before
        want = random_array(b.size, np.float32, 26)
        b[:] = want
        _copy_through_the_gpu(copier, b, want)
        out[:] = 0
        p.map(kern["scale_f32"], x, out, args=(3.0,))  # x is still held and correct
        assert p.last_stats.path == "in=held, out=held"
        np.testing.assert_array_equal(out, x * np.float32(3))
    assert_unregistered(before, x, after)


@pytest.mark.parametrize("copier", ["ctxkit", "to_device", "torch", "cupy"])
@pytest.mark.parametrize("piece", ["whole", "head", "tail", "middle", "owner", "owner-tail"])
def test_slices_of_a_held_array_and_its_owner_are_copied_by_anyone(kern, piece, copier):
    """A map of ``buf[:n]``: any copy that starts inside what pin on reuse registered
    (a tail slice, the rest of the owner) must not run past the registration's end."""
    if copier in ("torch", "cupy"):
        pytest.importorskip(copier)
    n, m = (16 << 20) // 4 + 5, (1 << 20) // 4 + 3
    buf = random_array(n + m, np.float32, 27)
    x, out = buf[:n], np.zeros(n, np.float32)
    with Pipeline([0]) as p:
        for _ in range(2):
            p.map(kern["scale_f32"], x, out, args=(2.0,))
        assert p.last_stats.path == "in=held, out=held"
        assert_held(x)
        views = {
            "whole": x,
            "head": x[:5000],
            "tail": x[-5000:],
            "middle": x[3000:-3000],
            "owner": buf,
            "owner-tail": buf[n // 2 :],
        }
        b = views[piece]
        want = random_array(b.size, np.float32, 28)
        b[:] = want
        _copy_through_the_gpu(copier, b, want)
        out[:] = 0
        p.map(kern["scale_f32"], x, out, args=(3.0,))
        assert p.last_stats.path == "in=held, out=held"
        np.testing.assert_array_equal(out, x * np.float32(3))
    assert_unregistered(buf)


def test_neighbours_sharing_a_page_are_both_held_and_stay_correct(kern):
    n = (32 << 20) // 4 + 5  # not a whole number of pages: x and out share one
    raw = random_array(2 * n + 64, np.float32, 23)
    x, out = (np.frombuffer(raw.data, np.float32, count=n, offset=4 * k) for k in (16, 16 + n))
    assert int(out.ctypes.data) % PAGE
    z = random_array(n, np.float32, 24)
    with (
        Pipeline(need_devices(1), options=ck.PipelineOptions(chunk_bytes=4 << 20)) as pa,
        Pipeline(need_devices(1)) as pb,
    ):
        for _ in range(3):
            out[:] = 0
            pa.map(kern["scale_f32"], x, out, args=(2.0,))
            np.testing.assert_array_equal(out, x * np.float32(2))
        assert pa.last_stats.path == "in=held, out=held"
        assert_held(x, out)  # two registrations on the page they share, no byte twice
        assert pa.release_pinned() > 0
        for _ in range(2):
            pa.map(kern["scale_f32"], z, x, args=(1.0,))  # x held for pa only
            pb.map(kern["scale_f32"], z, out, args=(3.0,))  # out held for pb only
        assert pb.last_stats.path == "in=held, out=held"
        np.testing.assert_array_equal(x, z)
        np.testing.assert_array_equal(out, z * np.float32(3))
        pa.release_pinned()
        out[:] = 0
        pb.map(kern["scale_f32"], z, out, args=(3.0,))
        assert pb.last_stats.path == "in=held, out=held"
        np.testing.assert_array_equal(out, z * np.float32(3))
    assert_unregistered(x, out, z)


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_pin_on_reuse_array_dying_inside_a_capture_is_unregistered_at_once(kern, mode):
    n = (32 << 20) // 4
    raw, over = foreign_buffer(n, 31)
    out = np.zeros(n, np.float32)
    ctx = ck.registry.context(0)
    buf = ck.DeviceBuffer(1 << 20, context=ctx)
    with Pipeline([0]) as p:
        for _ in range(2):
            p.map(kern["scale_f32"], over[PAGE : PAGE + n], out, args=(2.0,))
        assert p.last_stats.path == "in=held, out=held"
        ptr = int(over[PAGE:].ctypes.data)  # its first byte
        assert host_pointer_kind(ptr) == "pinned"
        with ctx:
            s = ck.Stream()
            kern["fill_f32"].preload()
            with ck.capture(s, mode=mode) as graph:
                kern["fill_f32"].launch(64, 256, buf, 7.0, 1 << 18, stream=s)
                del over
                gc.collect()
                with relaxed_capture():  # the query itself must not disturb the capture
                    during = host_pointer_kind(ptr)  # unregistered now, not at the end
            graph.launch(s)
            s.synchronize()
            got = buf.copy_to_host().view(np.float32)
        assert during == "pageable"
        assert (got == 7.0).all()  # the capture was not invalidated
        again = np.frombuffer(raw, np.float32)[PAGE : PAGE + n]
        assert not ck.is_pinned(again)
        p.map(kern["scale_f32"], again, out, args=(3.0,))
        np.testing.assert_array_equal(out, again * np.float32(3))
    buf.close()


@pytest.mark.multigpu
def test_pin_on_reuse_registration_serves_a_pipeline_on_another_device(kern):
    n = (32 << 20) // 4 + 5
    x = random_array(n, np.float32, 32)
    out = np.zeros_like(x)
    with Pipeline([0]) as p, Pipeline([1]) as q:
        for _ in range(2):
            p.map(kern["scale_f32"], x, out, args=(2.0,))
        assert p.last_stats.path == "in=held, out=held"
        q.map(kern["scale_f32"], x, out, args=(3.0,))  # DMAs pages registered for p
        assert q.last_stats.path == "in=held, out=held"
        np.testing.assert_array_equal(out, x * np.float32(3))
        p.close()
        assert_held(x)
        assert q.pinned_bytes == x.nbytes
        q.map(kern["scale_f32"], x, out, args=(2.0,))
        np.testing.assert_array_equal(out, x * np.float32(2))
    assert_unregistered(x, out)


def test_pin_on_reuse_unregisters_after_its_registering_context_closed(kern):
    n = (32 << 20) // 4
    x = random_array(n, np.float32, 33)
    out = np.zeros_like(x)
    own = ck.Context.create(0)
    try:
        with Pipeline([own]) as p, Pipeline([0]) as q:
            for _ in range(2):
                p.map(kern["scale_f32"], x, out, args=(2.0,))
            q.map(kern["scale_f32"], x, out, args=(3.0,))
            p.close()
            own.close()
            q.map(kern["scale_f32"], x, out, args=(2.0,))
            np.testing.assert_array_equal(out, x * np.float32(2))
            ptr = int(x.ctypes.data)
            del x
            gc.collect()
            assert host_pointer_kind(ptr) == "pageable"
    finally:
        own.close()
