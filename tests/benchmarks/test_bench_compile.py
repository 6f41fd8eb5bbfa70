"""benchmarks/bench_compile.py's in-process warm-hit measurement, on the CPU (NVRTC with an
explicit arch): it times calls that really come from the cache, through the public
``ctxkit.compile``, with the header tree it builds, and leaves ``CTXKIT_CACHE_DIR`` as it
found it."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.helpers import load_file_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
bench = load_file_module(BENCH / "bench_compile.py", "bench_compile_under_test")


def test_header_tree_has_every_header_in_subdirectories(tmp_path):
    root = bench.make_header_tree(tmp_path / "inc", 250, per_dir=100)
    headers = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.cuh"))
    assert len(headers) == 250
    assert headers[0] == "d00/h0000.cuh" and headers[-1] == "d02/h0249.cuh"
    assert "CTXKIT_BENCH_H7 7" in (root / "d00" / "h0007.cuh").read_text()


def test_warm_hits_are_timed_cache_hits_of_the_public_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(tmp_path / "user-cache"))
    monkeypatch.setattr(bench, "WARM_HIT_HEADERS", 40)
    import ctxkit as ck

    calls = []
    real = ck.compile
    monkeypatch.setattr(ck, "compile", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    r = bench.bench_warm_hits(tmp_path, 4, arch="sm_90")
    assert os.environ["CTXKIT_CACHE_DIR"] == str(tmp_path / "user-cache")
    assert not (tmp_path / "user-cache").exists()  # the measurement used its own cache
    assert len(r["warm_hit_ms"]) == 4 and len(r["warm_hit_headers_ms"]) == 4
    assert r["warm_hit_cached"] is True and r["warm_hit_headers_cached"] is True
    assert all(t > 0 for t in r["warm_hit_ms"] + r["warm_hit_headers_ms"])
    assert len(calls) == 10  # one filling call and four timed calls, twice
    assert calls[-1]["include_dirs"] == [str(tmp_path / "include")]
    assert len(list((tmp_path / "include").rglob("*.cuh"))) == 40
