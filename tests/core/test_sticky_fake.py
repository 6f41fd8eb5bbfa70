"""Sticky errors and public names of memory/stream on the fake driver."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.memory as memory
from ctxkit import stream
from ctxkit.errors import (
    ContextPoisonedError,
)
from ctxkit.memory import (
    DeviceBuffer,
)
from ctxkit.stream import Event, Stream
from tests.support.fakemem import (  # noqa: F401
    HOST_ALREADY_REGISTERED,
    HOST_NOT_REGISTERED,
    ILLEGAL_ADDRESS,
    INVALID_CONTEXT,
    INVALID_HANDLE,
    INVALID_VALUE,
    NOT_READY,
    OK,
    OUT_OF_MEMORY,
    PAGE,
    PEER_ALREADY,
    ctx0,
    ctx1,
    fake,
    in_thread,
    rand_bytes,
)

# sticky errors
# ======================================================================================


def test_sticky_error_poisons_every_context_of_the_process(fake, ctx0, ctx1):
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(8)
    with ctx1:
        other = Stream()
    fake.sticky[ctx0.handle] = ILLEGAL_ADDRESS
    with ctx1:  # device 0's objects bind their own context
        with pytest.raises(ContextPoisonedError, match="ILLEGAL_ADDRESS"):
            s.synchronize()
        assert ctx0.poisoned
        n = len(fake.log)
        for op in (
            lambda: DeviceBuffer(8, context=ctx0),
            lambda: Stream(ctx0),
            lambda: Event(context=ctx0),
            s.synchronize,
            ctx0.synchronize,
            lambda: ck.pinned_empty(4, context=ctx0),
            lambda: buf.copy_to_host(),
        ):
            with pytest.raises(ContextPoisonedError):
                op()
        assert len(fake.log) == n  # failed fast: no driver call reached
        with pytest.raises(ContextPoisonedError, match="separate processes"):
            other.synchronize()  # device 1 is poisoned too: the fault is process-wide
        assert ctx1.poisoned
    buf = None
    gc.collect()  # freeing in a poisoned context is skipped, silently
    assert fake.calls("free") == []


def test_sticky_error_from_a_copy_inside_the_context(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(8)
        fake.sticky[ctx0.handle] = ILLEGAL_ADDRESS
        with pytest.raises(ContextPoisonedError):
            buf.copy_from_host(np.zeros(8, np.uint8))
        with pytest.raises(ContextPoisonedError):
            buf.copy_to_host()
    assert ctx0.poisoned


def test_bench_memory_peer_section_waits_and_syncs_before_freeing(fake, monkeypatch, capsys):
    """benchmarks/bench_memory.py's peer section (the first GPU run faulted device 0 after
    it): every copy is awaited, both contexts are synchronized before peer access is
    enabled and before the buffers are freed, and the bytes arrive."""
    from pathlib import Path

    from tests.support.helpers import load_file_module

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory.py"
    bench = load_file_module(path, "bench_memory_under_test")
    monkeypatch.setattr(bench, "PEER_SIZE", 64 << 10)
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    lines = {ln.name: ln for ln in bench.peer_verdicts(bench.bench_peer(2, 2))}
    assert lines["memory.peer_data_ok"].text().startswith("CHECK memory.peer_data_ok 1.00 ")
    assert lines["memory.peer_data_ok"].verdict == "ok"
    for key in ("staged", "p2p"):
        assert lines[f"memory.peer_{key}_vs_raw"].text().startswith("SUMMARY ")
        assert lines[f"memory.peer_{key}_gbps"].kind == "check"
    log = [(call, ctx) for call, ctx, _ in fake.log]
    frees = [i for i, (call, _) in enumerate(log) if call == "free"]
    assert len(frees) == 2
    for ctx in (c0, c1):
        assert ("ctxsync", ctx.handle) in log[: frees[0]]
    first_enable = next(i for i, (call, _) in enumerate(log) if call == "enablepeer")
    assert {("ctxsync", c0.handle), ("ctxsync", c1.handle)} <= set(log[:first_enable])
    assert not any(fake.legacy.values())
    peer_calls = fake.calls("Peer") + fake.calls("PeerAsync")
    assert peer_calls and all(c[1] == c1.handle for c in peer_calls)


def test_public_names_are_exported():
    for name in (
        "DeviceBuffer",
        "DeviceArray",
        "device_array",
        "pinned_empty",
        "pinned_zeros",
        "register_host",
        "is_pinned",
        "ManagedBuffer",
        "enable_peer_access",
        "copy_peer",
        "Stream",
        "Event",
    ):
        assert getattr(ck, name) is getattr(memory if hasattr(memory, name) else stream, name)
