"""Peer access between two devices: copies in both directions without and with peer
access (fresh owned contexts, so nothing was enabled before), idempotent enabling that
leaves no pending error, and a kernel on device 0 reading device 1's memory directly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.memory as memory
from ctxkit._driver import drv
from ctxkit.errors import CudaError

pytestmark = pytest.mark.multigpu

N = (1 << 20) + 3


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def pair() -> Iterator[SimpleNamespace]:
    """Two owned contexts (devices 0 and 1) with a buffer each; closed afterwards."""
    a, b = ck.Context.create(0), ck.Context.create(1)
    try:
        yield SimpleNamespace(
            a=a,
            b=b,
            buf_a=ck.DeviceBuffer(N, context=a),
            buf_b=ck.DeviceBuffer(N, context=b),
            p2p=ck.Device(0).can_access_peer(1) and ck.Device(1).can_access_peer(0),
        )
    finally:
        a.close()
        b.close()


def check_both_directions(p: SimpleNamespace, expect_direct: bool, seed: int) -> None:
    data = rand(N, seed)
    with p.a:
        p.buf_a.copy_from_host(data)
        assert ck.copy_peer(p.buf_b, p.buf_a) is expect_direct
    with p.b:
        np.testing.assert_array_equal(p.buf_b.copy_to_host(), data)
        p.buf_b[: N // 2].memset(7)
        assert ck.copy_peer(p.buf_a, p.buf_b) is expect_direct
    with p.a:
        got = p.buf_a.copy_to_host()
    assert (got[: N // 2] == 7).all()
    np.testing.assert_array_equal(got[N // 2 :], data[N // 2 :])
    # asynchronous, on a stream of either side, at odd offsets
    with p.a:
        s_a = ck.Stream()
        p.buf_a.copy_from_host(data)
        assert ck.copy_peer(p.buf_b[3:1003], p.buf_a[5:1005], stream=s_a) is expect_direct
        s_a.synchronize()
    with p.b:
        s_b = ck.Stream()
        assert ck.copy_peer(p.buf_a[11:], p.buf_b[11:], stream=s_b) is expect_direct
        s_b.synchronize()
        b_now = p.buf_b.copy_to_host()
    np.testing.assert_array_equal(b_now[3:1003], data[5:1005])
    with p.a:
        a_now = p.buf_a.copy_to_host()
    np.testing.assert_array_equal(a_now[11:], b_now[11:])
    np.testing.assert_array_equal(a_now[:11], data[:11])


def test_copies_without_then_with_peer_access(pair):
    p = pair
    check_both_directions(p, expect_direct=False, seed=1)
    if not p.p2p:
        with pytest.raises(CudaError, match="cannot access") as info:
            ck.enable_peer_access(p.a, p.b)
        assert info.value.name == "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"
        return
    ck.enable_peer_access(p.a, p.b)
    ck.enable_peer_access(p.a, p.b)  # idempotent
    ck.enable_peer_access(p.b, p.a)
    assert memory.peer_access_enabled(p.a, p.b) and memory.peer_access_enabled(p.b, p.a)
    for ctx in (p.a, p.b):  # no error left pending in either context
        with ctx:
            assert drv.cuCtxSynchronize()[0] == 0
            assert drv.cuMemGetInfo()[0] == 0
    check_both_directions(p, expect_direct=True, seed=2)


def test_copy_peer_without_a_stream_returns_after_the_copy(pair):
    """copy_peer(stream=None) has completed when it returns, with and without peer
    access: 512 MiB cannot cross in less than n / 2 TB/s (no NVLink/PCIe path of one
    direction is that fast), while a call that only enqueued returns in microseconds
    (the first GPU run's benchmark timed 9529 GB/s that way)."""
    p = pair
    n = 512 << 20
    src = ck.DeviceBuffer(n, context=p.a)
    dst = ck.DeviceBuffer(n, context=p.b)
    try:
        with p.a:
            src.memset(9)
        for enable in (False, True):
            if enable:
                if not p.p2p:
                    break
                ck.enable_peer_access(p.a, p.b)
                ck.enable_peer_access(p.b, p.a)
            with p.a:
                ck.copy_peer(dst, src)  # warm-up
                t0 = time.perf_counter()
                ck.copy_peer(dst, src)
                took = time.perf_counter() - t0
            assert took >= n / 2e12, f"returned after {took * 1e6:.1f} us (peer access {enable})"
        with p.b:
            assert (dst[: 1 << 20].copy_to_host() == 9).all()
            assert (dst[n - (1 << 20) :].copy_to_host() == 9).all()
    finally:
        p.a.synchronize()
        p.b.synchronize()
        dst.close()
        src.close()


def test_device_to_device_copy_across_devices(pair):
    p = pair
    data = rand(N, 3)
    with p.a:
        p.buf_a.copy_from_host(data)
        p.buf_b.copy_from(p.buf_a)  # other device: routed through copy_peer
        arr_b = p.buf_b.view()
    with p.b:
        np.testing.assert_array_equal(arr_b.to_host(), data)


def test_kernel_reads_peer_memory_directly(pair):
    p = pair
    if not p.p2p:
        pytest.skip("devices 0 and 1 have no peer access")
    from ctxkit.compiler import kernel_source

    with p.a:
        spin = ck.Module.load(ck.compile(kernel_source("spin.cu"))).function("spin_then_copy")
    n = 4096
    x = np.arange(n, dtype=np.float32)
    src_b = ck.device_array(n, np.float32, p.b)
    with p.b:
        src_b.copy_from_host(x)
    ck.enable_peer_access(p.a, p.b)
    with p.a:
        out_a = ck.device_array(n, np.float32)
        spin.launch(16, 256, 0, src_b, out_a, n)  # device 0 reads device 1's memory
        p.a.synchronize()
        np.testing.assert_array_equal(out_a.to_host(), x)


def test_registry_contexts_enable_twice():
    if not ck.Device(0).can_access_peer(1):
        pytest.skip("devices 0 and 1 have no peer access")
    ck.enable_peer_access(0, 1)
    ck.enable_peer_access(0, 1)
    ck.registry.context(0).synchronize()
    assert memory.peer_access_enabled(0, 1)
