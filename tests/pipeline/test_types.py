"""Result and error types of ``ctxkit.pipeline``: no driver needed."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.pipeline import ChunkView, DeviceStats, PipelineError, RunStats


def test_chunk_view_describes_its_memory():
    v = ChunkView(0x1000, (4, 2), np.dtype(np.float32))
    assert v.size == 8 and v.nbytes == 32
    cai = v.__cuda_array_interface__
    assert cai["data"] == (0x1000, False) and cai["shape"] == (4, 2) and cai["typestr"] == "<f4"
    assert "ChunkView" in repr(v)


def test_stats_rates():
    d = DeviceStats(0, chunks=2, rows=10, nbytes=4_000_000_000, seconds=0.5)
    assert d.gbps == pytest.approx(8.0)
    assert DeviceStats(1).gbps == 0.0
    r = RunStats(2_000_000_000, 0.1, "pinned", [d])
    assert r.gbps == pytest.approx(20.0) and RunStats().gbps == 0.0


def test_pipeline_error_fields():
    e = PipelineError("boom", device=1, chunk=3, step="kernel")
    assert (e.device, e.chunk, e.step, e.poisoned) == (1, 3, "kernel", False)
    assert isinstance(e, ck.CudaError)


def test_pipeline_error_survives_pickling():
    e = pickle.loads(pickle.dumps(PipelineError("device 1, chunk 2", 1, 2, "h2d")))
    assert "chunk 2" in str(e)
