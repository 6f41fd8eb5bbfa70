"""``python -m ctxkit demo`` end to end on the simulated GPU (tests/support/fakegpu.py):
every variant runs, every result is checked, the table and the traces come out, a wrong
result or a failing peer exits 1."""

from __future__ import annotations

import argparse
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.cli import demo as _demo
from ctxkit.cli.demo import run_demo


class FakeScaleKernel:
    """Stands in for the compiled ``scale_f32``: ``launch`` for the naive pattern, a map
    body (``p(ctx, stream, d_in, d_out, n, alpha)``) for Pipeline."""

    def __init__(self, gpu, error: float = 1.0) -> None:
        self.gpu = gpu
        self.error = error

    def launch(self, grid, block, d_in, d_out, n, alpha, stream=None):
        assert grid >= 1 and block == 256

        def kernel():
            src = np.frombuffer((ctypes.c_char * (n * 4)).from_address(d_in), np.float32)
            dst = np.frombuffer((ctypes.c_char * (n * 4)).from_address(d_out), np.float32)
            dst[:] = src * np.float32(alpha * self.error)

        self.gpu.launch(stream, kernel)

    def __call__(self, ctx, stream, d_in, d_out, n, alpha):
        self.launch(1, 256, d_in.ptr, d_out.ptr, n, alpha, stream=stream)


def _args(tmp_path, **kw):
    base = {"size_mb": 1.0, "devices": None, "trace": str(tmp_path / "demo.json"), "quick": False}
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def no_peers(monkeypatch):
    """Neither CuPy nor torch, whatever this machine has."""
    monkeypatch.setattr(_demo, "cupy_peer", lambda: (None, "CuPy (not installed: test)"))
    monkeypatch.setattr(_demo, "torch_peers", lambda x: ({}, "torch rows (not installed: test)"))


def _fake_kernel(monkeypatch, gpu, error=1.0):
    obj = SimpleNamespace(target="cubin", arch="sm_90", from_cache=True)
    monkeypatch.setattr(
        _demo, "load_scale_kernel", lambda: (obj, FakeScaleKernel(gpu, error), 0.01)
    )


def test_demo_runs_every_variant_checks_them_and_writes_both_traces(
    gpu, monkeypatch, tmp_path, capsys, no_peers
):
    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_args(tmp_path)) == 0
    text = capsys.readouterr().out
    for label in _demo.LABELS.values():
        if "torch" not in label and "CuPy" not in label:
            assert label in text, label
    assert "skipped: CuPy (not installed: test)" in text
    assert "skipped: torch rows (not installed: test)" in text
    assert "vs naive" in text and "GPU 1: " in text and "per device (ctxkit repeated" in text
    assert "OK: every result matches numpy exactly" in text
    for name in ("demo.json", "demo-first-call.json"):
        back = ck.trace.Timeline.from_chrome_trace(tmp_path / name)
        assert back.devices() == [0, 1] and {"h2d", "kernel", "d2h"} <= set(back.names())


def test_demo_reports_a_wrong_result_and_exits_1(gpu, monkeypatch, tmp_path, capsys, no_peers):
    _fake_kernel(monkeypatch, gpu, error=1.5)
    assert run_demo(_args(tmp_path, devices=1, quick=True, trace=None)) == 1
    text = capsys.readouterr().out
    assert "VERIFY FAILED (naive)" in text and "VERIFY FAILED (first_call)" in text
    assert "FAILED: results differ from numpy for naive, first_call, fresh" in text
    assert not list(tmp_path.iterdir())  # trace=None: no files


def test_demo_compares_with_the_peers_and_checks_their_results_too(
    gpu, monkeypatch, tmp_path, capsys
):
    """Peers are measured like the ctxkit rows: every call checked, a wrong peer fails
    the demo, and the ratios are against torch's pinned path."""
    calls = {"cupy": 0, "torch": 0, "torch_pinned": 0}

    def peer(key, factor):
        def run(x):
            calls[key] += 1
            return x * np.float32(factor)

        return run, f"fake {key}"

    monkeypatch.setattr(_demo, "cupy_peer", lambda: (peer("cupy", 2.0), ""))
    monkeypatch.setattr(
        _demo,
        "torch_peers",
        lambda x: ({"torch": peer("torch", 3.0), "torch_pinned": peer("torch_pinned", 2.0)}, ""),
    )
    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_args(tmp_path, devices=1, quick=True, trace=None)) == 1
    text = capsys.readouterr().out
    assert calls == {"cupy": 2, "torch": 2, "torch_pinned": 2}  # warm-up + 1 timed call
    assert "VERIFY FAILED (torch)" in text
    assert "FAILED: results differ from numpy for torch\n" in text
    assert "vs torch pinned" in text and "skipped" not in text
    (pinned_line,) = [ln for ln in text.splitlines() if _demo.LABELS["torch_pinned"] in ln]
    assert "1.00x" in pinned_line and "(fake torch_pinned)" in pinned_line


def test_demo_rejects_bad_devices_and_sizes(gpu, monkeypatch, tmp_path, capsys, no_peers):
    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_args(tmp_path, devices=3)) == 1
    assert "--devices must be 1..2, got 3" in capsys.readouterr().err
    assert run_demo(_args(tmp_path, size_mb=-4.0)) == 1
    assert "--size-mb must be a positive number of MiB, got -4.0" in capsys.readouterr().err


def test_demo_repeated_arrays_are_held_by_pin_on_reuse(
    gpu, monkeypatch, tmp_path, capsys, no_peers
):
    from ctxkit.pipeline import pincache as _pincache

    monkeypatch.setattr(_pincache, "_process", None)
    monkeypatch.setattr(_pincache, "MIN_HOLD_BYTES", 1 << 20)
    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_args(tmp_path, size_mb=8.0, devices=2, trace=None, quick=True)) == 0
    text = capsys.readouterr().out
    (row,) = [ln for ln in text.splitlines() if _demo.LABELS["repeated"] in ln]
    assert row.endswith("(in=held, out=held)")
    assert "per device (ctxkit repeated, in=held, out=held)" in text
    assert gpu.register_calls and not gpu.registered  # locked by pin on reuse, then released


def test_demo_reports_the_pinned_pool_once_it_was_used(
    gpu, monkeypatch, tmp_path, capsys, no_peers
):
    from ctxkit.memory import pinned

    pool = pinned.PinnedPool(budget=64 << 20)
    monkeypatch.setattr(pinned, "_process_pool", pool)
    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_args(tmp_path, devices=1, quick=True, trace=None)) == 0
    out = capsys.readouterr().out
    # the pipelines' staging buffers come from the process pool: the demo says how it went
    assert "pinned pool:" in out and "(budget 64 MiB)" in out
    assert pool.stats().allocations >= 1


def test_a_peer_that_fails_is_skipped_with_its_error(gpu, monkeypatch, tmp_path, capsys):
    def broken(x):
        raise RuntimeError("CUDA driver version is insufficient")

    def no_torch(x):
        raise OSError("libtorch_cuda.so: cannot open shared object file")

    monkeypatch.setattr(_demo, "cupy_peer", lambda: ((broken, "CuPy 13"), ""))
    monkeypatch.setattr(_demo, "torch_peers", no_torch)
    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_args(tmp_path, devices=1, quick=True, trace=None)) == 0
    text = capsys.readouterr().out
    assert "skipped: CuPy cp.asnumpy(cp.asarray(x) * 2) (failed: RuntimeError(" in text
    assert "skipped: torch rows (failed: OSError(" in text and "vs naive" in text
