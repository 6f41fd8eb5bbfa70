"""Every benchmark's verdict logic (``verdicts(results)`` of benchmarks/bench_*.py) on canned
measurements: each target and check line PASSes on good numbers and FAILs on bad ones, so a
verdict that is always True (or decided on another quantity than its line prints) fails
here. No GPU: the verdict functions are pure."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from verdictlines import Line, emit

from tests.support.helpers import load_file_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MiB = 1 << 20


def load(name: str) -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        return load_file_module(BENCH / f"bench_{name}.py", f"verdicts_under_test_{name}")
    finally:
        sys.path.remove(str(BENCH))


def by_name(lines: list[Line]) -> dict[str, Line]:
    names = [ln.name for ln in lines]
    assert len(names) == len(set(names)), f"duplicate line names: {names}"
    return {ln.name: ln for ln in lines}


# --- canned measurements -----------------------------------------------------------------


def context_good() -> dict[str, Any]:
    r: dict[str, Any] = {
        "raw": [0.40, 0.42, 0.44],
        "raw_checked": [0.45, 0.46, 0.47],
        "raw_with": [0.60, 0.62, 0.64],
        "enter": [0.48, 0.50, 0.52],
        "enter_current": [0.50, 0.52, 0.55],
        "reenter": [0.10, 0.12, 0.20],
        "bind_cold": [0.50, 0.52, 0.54],
        "bind_hot": [0.10, 0.20, 0.25],
        "enter_fresh": [0.50, 0.52, 0.55],
        "torch_device": [0.70, 0.72, 0.75],
        "torch_note": "torch 2.5",
    }
    for n in (1, 2, 4, 8):
        r[f"raw_threads{n}"] = [100_000.0 * n] * 3
        for mode in ("launch", "prepared", "executor"):
            r[f"{mode}_threads{n}"] = [96_000.0 * n] * 3
    return r


def launch_good() -> dict[str, Any]:
    r: dict[str, Any] = {
        "kernel_launch": [5.0, 5.1, 5.2],
        "prepared": [3.6, 3.7, 3.8],
        "raw_address": [3.0, 3.1, 3.2],
        "raw_tuple": [4.0, 4.1, 4.2],
        "cupy": [5.8, 5.9, 6.0],
        "cuda_core": [5.2, 5.3, 5.4],
        "current_stream": [5.0, 5.15, 5.2],
        "cupy_note": "CuPy 13",
        "cuda_core_note": "cuda.core 0.3 (cuda.core.experimental)",
        "current_stream_note": "with stream:",
        "two_buffers": [5.5, 5.6, 5.7],
        "two_buffers_event_floor": [6.7, 6.8, 6.9],
        "torch_cupy": [6.0, 6.2, 6.4],
        "foreign_note": "torch 2.5 tensor + CuPy 13 array",
    }
    for nodes, mine, raw in ((100, 0.70, 0.60), (1000, 0.47, 0.46)):
        r[f"graph{nodes}_steady_ctxkit"] = [mine - 0.02, mine, mine + 0.05]
        r[f"graph{nodes}_steady_raw"] = [raw - 0.01, raw, raw + 0.02]
        for label in ("first", "first_upload"):
            r[f"graph{nodes}_{label}_ctxkit"] = 2.0
            r[f"graph{nodes}_{label}_raw"] = 1.9
    return r


def memory_good() -> dict[str, Any]:
    pinned = {}
    for d in ("h2d", "d2h", "h2d_async", "d2h_async"):
        pinned[f"raw_{d}"] = [0.0050, 0.0051, 0.0052]
        pinned[f"ck_{d}"] = [0.0050, 0.0051, 0.0052]
    copies = {
        "raw": [0.0060, 0.0061, 0.0062],
        "ctxkit": [0.0060, 0.0061, 0.0062],
        "raw_async": [0.0055, 0.0056, 0.0057],
        "ctxkit_async": [0.0055, 0.0056, 0.0057],
    }
    return {
        "pinned": pinned,
        "async_pageable": [(0.040, 0.050), (0.041, 0.050), (0.039, 0.050)],
        "async_pinned": [(0.0001, 0.050)] * 3,
        "warned": True,
        "peer_size": 256 * MiB,
        "peer": {"no peer access": copies, "peer access": copy.deepcopy(copies)},
        "peer_ok": True,
        "peer_note": "",
        "alloc_1mib_ctxkit": [2.0, 2.1, 2.2],
        "alloc_1mib_ctxkit_sync": [7.0] * 3,
        "alloc_1mib_cupy": [1.8, 1.83, 1.9],
        "alloc_1mib_torch": [2.2, 2.23, 2.3],
        "alloc_256mib_ctxkit": [2.5] * 3,
        "alloc_256mib_ctxkit_sync": [900.0] * 3,
        "alloc_256mib_cupy": [2.0] * 3,
        "alloc_256mib_torch": [2.4] * 3,
        "free_busy_kernel_ms": 100.0,
        "free_busy_sync_ms": 99.0,
        "free_busy_ordered_ms": 0.02,
    }


def compile_good() -> dict[str, Any]:
    def runs(n: int, **kw: Any) -> list[dict[str, Any] | None]:
        return [dict(kw) for _ in range(n)]

    return {
        "cold": runs(3, total_ms=150.0, compile_ms=140.0, load_ms=10.0, cached=False),
        "warm": runs(7, total_ms=1.5, compile_ms=0.3, load_ms=1.2, cached=True),
        "raw_cold": runs(3, total_ms=140.0, cached=False),
        "raw_warm": runs(7, total_ms=1.0, cached=True),
        "cupy_cold": runs(3, total_ms=300.0),
        "cupy_warm": runs(7, total_ms=2.0),
        "warm_hit_ms": [0.02] * 50,
        "warm_hit_cached": True,
        "warm_hit_headers_ms": [0.5] * 50,
        "warm_hit_headers_cached": True,
    }


def procs_good() -> dict[str, Any]:
    return {
        "startup_full_s": [2.0, 2.1, 2.2],
        "startup_plain_s": [1.5, 1.6, 1.7],
        "gpus": 1,
        "pool_s": [150e-6] * 3,
        "ppe_s": [120e-6] * 3,
        "pool_tps": [9000.0] * 3,
        "ppe_tps": [8000.0] * 3,
        "shm_speedups": {64: 0.5, 16384: 3.0},
        "shm_crossover_kib": 256,
        "repeats": 3,
        "mpi": {"e2e_s": 0.1, "device_s": 0.05},
        "pipeline_s": 0.08,
        "mpi_nbytes": 1 << 30,
    }


HELD = "in=held, out=held"


def pipeline_good(two_gpus: bool = True) -> dict[str, Any]:
    r: dict[str, Any] = {
        "counts": [1, 2] if two_gpus else [1],
        "size_gib": 2.0,
        "host_memcpy_best": 38.0,
        "host_memcpy_repeats": 3,
        "register_best": {"reg": 50.0, "unreg": 60.0, "both": 25.0, "one_thread": 10.0},
        "torch_note": "torch 2.5",
        "new_pipeline_1gpu_io": [46.0, 48.0, 50.0],
        "new_pipeline_1gpu_pageable_out_io": [14.0, 15.0, 16.0],
        "torch_pinned_1gpu_io": [31.0, 32.0, 33.0],
        "naive_1gpu_8chunk_fresh_io": [8.0, 9.0, 10.0],
        "fresh_1gpu_io": [56.0, 58.0, 60.0],
        "ctxkit_1gpu_pageable_auto": [44.0, 45.0, 46.0],
        "path_ctxkit_1gpu_pageable_auto": HELD,
        "naive_1gpu_1chunk": [5.0] * 3,
        "naive_1gpu_8chunk": [7.5, 8.0, 8.2],
        "ctxkit_1gpu_pageable_staged": [20.0, 21.0, 22.0],
        "ctxkit_1gpu_pageable_register": [8.0, 9.0, 10.0],
        "ctxkit_1gpu_pageable_in-register-out-staged": [12.0] * 3,
        "ctxkit_1gpu_pageable_in-staged-out-register": [12.0] * 3,
        "ctxkit_1gpu_pageable_staged_after_register": [20.0] * 3,
        "ctxkit_1gpu_pageable_register_dynamic": [9.0] * 3,
        "ctxkit_1gpu_pageable_auto_new_out": [30.0] * 3,
        "ctxkit_1gpu_register_host": [45.0, 45.5, 46.0],
        "path_ctxkit_1gpu_register_host": "pinned",
        "ctxkit_1gpu_auto_beside_register_host": [44.5, 45.0, 46.0],
        "path_ctxkit_1gpu_auto_beside_register_host": HELD,
        "ctxkit_1gpu_auto_first_call": [9.0],
        "ctxkit_1gpu_auto_second_call": [9.5],
        "path_ctxkit_1gpu_auto_first_call": "in=staged, out=staged",
        "raw_1gpu_pinned": [46.0, 46.5, 47.0],
        "ctxkit_1gpu_pinned": [45.5, 46.0, 46.5],
        "raw_1gpu_pinned_4events": [46.0] * 3,
        "ctxkit_1gpu_pinned_notrace": [46.0] * 3,
        "ctxkit_1gpu_held": [45.0, 45.5, 46.0],
        "path_ctxkit_1gpu_held": HELD,
        "managed_1gpu": [30.0] * 3,
        "cold_ms": {
            "ctxkit": [400.0, 420.0, 450.0],
            "ctxkit_default_out": [380.0, 400.0, 430.0],
            "torch": [880.0, 900.0, 940.0],
            "torch_pinned": [980.0, 1000.0, 1050.0],
        },
        "cold_missing": {},
        "cold_errors": [],
        "cold_cached": True,
        "cold_gib": 1.0,
        "first_call_gib": 1.0,
    }
    if two_gpus:
        r |= {
            "fresh_2gpu_io": [100.0, 104.0, 108.0],
            "ctxkit_2gpu_pageable_auto": [82.0, 84.0, 86.0],
            "path_ctxkit_2gpu_pageable_auto": HELD,
            "naive_2gpu_8chunk": [8.0] * 3,
            "ctxkit_2gpu_auto_first_call": [12.0],
            "raw_2gpu_pinned": [80.0, 82.0, 84.0],
            "ctxkit_2gpu_pinned": [80.0, 81.0, 83.0],
            "ctxkit_2gpu_held": [80.0, 81.0, 82.0],
            "path_ctxkit_2gpu_held": HELD,
            "managed_2gpu": [50.0] * 3,
        }
    return r


GOOD: dict[str, Callable[[], dict[str, Any]]] = {
    "context": context_good,
    "launch": launch_good,
    "memory": memory_good,
    "compile": compile_good,
    "procs": procs_good,
    "pipeline": pipeline_good,
}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change of the measurements: set ``r[a][b]...`` (*path* ``"a/b"``) to *value*."""

    def change(r: dict[str, Any]) -> None:
        *head, last = path.split("/")
        d: Any = r
        for k in head:
            d = d[k]
        if isinstance(d, list):
            d[int(last)] = value
        else:
            d[last] = value

    return change


#: For every target and check line: one change of the good measurements that must make
#: that line FAIL (other lines may fail with it).
FAIL_CASES: dict[str, dict[str, Callable[[dict[str, Any]], None]]] = {
    "context": {
        "context.with_vs_raw_pair": _set("enter", [0.66, 0.66, 0.66]),
        "context.reenter_us": _set("reenter", [0.5, 0.5, 0.5]),
        "registry.bind_cold_vs_raw": _set("bind_cold", [0.9, 0.9, 0.9]),
        "registry.bind_hot_us": _set("bind_hot", [0.86, 0.86, 0.86]),
        "context.with_vs_torch_device": _set("enter_current", [0.90, 0.92, 0.94]),
        "registry.executor_vs_raw_threads": _set("executor_threads4", [200_000.0] * 3),
        "threads.launch_vs_raw": _set("launch_threads2", [150_000.0] * 3),
        "threads.prepared_vs_raw": _set("prepared_threads1", [90_000.0] * 3),
        "context.with_fresh_thread_vs_raw_pair": _set("enter_fresh", [0.70, 0.70, 0.70]),
    },
    "launch": {
        "launch.prepared_vs_cupy": _set("prepared", [6.4, 6.5, 6.6]),
        "launch.kernel_launch_vs_cupy": _set("kernel_launch", [9.0, 9.1, 9.2]),
        "launch.kernel_launch_vs_cuda_core": _set("cuda_core", [4.2, 4.3, 4.4]),
        "launch.prepared_vs_cuda_core": _set("prepared", [5.6, 5.7, 5.8]),
        "launch.current_stream_vs_explicit": _set("current_stream", [6.0, 6.1, 6.2]),
        "launch.graph_node_vs_raw": _set("graph1000_steady_ctxkit", [0.9, 0.9, 0.9]),
        "launch.foreign_args_vs_ctxkit_buffers": _set("torch_cupy", [7.5, 7.6, 7.7]),
    },
    "memory": {
        "memory.pinned_h2d_vs_raw": _set("pinned/ck_h2d_async", [0.0060, 0.0061, 0.0062]),
        "memory.pinned_d2h_vs_raw": _set("pinned/ck_d2h", [0.0060, 0.0061, 0.0062]),
        "memory.pageable_async_warned": _set("warned", False),
        "memory.pinned_async_blocked_fraction": _set("async_pinned", [(0.04, 0.05)] * 3),
        "memory.peer_staged_vs_raw": _set("peer/no peer access/ctxkit", [0.008] * 3),
        "memory.peer_p2p_vs_raw": _set("peer/peer access/ctxkit", [0.008] * 3),
        "memory.peer_staged_gbps": _set("peer/no peer access/raw_async", [0.0001] * 3),
        "memory.peer_p2p_gbps": _set("peer/peer access/ctxkit_async", [0.0002] * 3),
        "memory.peer_data_ok": _set("peer_ok", False),
        "memory.alloc_1mib_vs_cupy": _set("alloc_1mib_ctxkit", [6.86] * 3),
        "memory.alloc_1mib_vs_torch": _set("alloc_1mib_torch", [1.2] * 3),
        "memory.alloc_256mib_vs_cupy": _set("alloc_256mib_cupy", [1.5] * 3),
        "memory.alloc_256mib_vs_torch": _set("alloc_256mib_ctxkit", [3.5] * 3),
        "memory.free_while_busy_ordered_ms": _set("free_busy_ordered_ms", 98.0),
        "memory.sections_ok": _set("section_errors", ["allocation: OutOfMemoryError: ..."]),
    },
    "compile": {
        "compile.child_runs_ok": _set("raw_cold/1", None),
        "compile.warm_runs_from_cache": _set("warm/3", {"total_ms": 1.5, "cached": False}),
        "compile.warm_new_process": _set("warm", [{"total_ms": 2.5, "cached": True}] * 7),
        "compile.warm_vs_cupy_warm": _set("cupy_warm", [{"total_ms": 1.0}] * 7),
        "compile.warm_hits_from_cache": _set("warm_hit_headers_cached", False),
        "compile.warm_hit_in_process_ms": _set("warm_hit_ms", [0.06] * 50),
        "compile.warm_hit_1500_headers_ms": _set("warm_hit_headers_ms", [41.0] * 50),
    },
    "procs": {
        "procs.startup_all_gpus": _set("startup_full_s", [3.4, 3.5, 3.6]),
        "procs.pool_task_overhead": _set("pool_s", [200e-6] * 3),
    },
    "pipeline": {
        "pipeline.1gpu_first_call_new_pipeline_gbps": _set(
            "new_pipeline_1gpu_io", [9.3, 13.0, 11.9]
        ),
        "pipeline.1gpu_first_call_vs_torch_pinned": _set("torch_pinned_1gpu_io", [40.0] * 3),
        "pipeline.1gpu_first_call_vs_naive_chunked": _set("naive_1gpu_8chunk_fresh_io", [60.0] * 3),
        "pipeline.1gpu_long_lived_fresh_arrays_gbps": _set("fresh_1gpu_io", [25.0, 26.0, 27.0]),
        "pipeline.1gpu_repeated_held_gbps": _set("ctxkit_1gpu_pageable_auto", [20.0] * 3),
        "pipeline.1gpu_repeated_is_held": _set(
            "path_ctxkit_1gpu_pageable_auto", "in=staged, out=staged"
        ),
        "pipeline.1gpu_repeated_held_vs_naive_chunked": _set("naive_1gpu_8chunk", [10.0] * 3),
        "pipeline.1gpu_auto_vs_fastest_other_path": _set("ctxkit_1gpu_pageable_staged", [50.0] * 3),
        "pipeline.1gpu_register_host_is_pinned": _set(
            "path_ctxkit_1gpu_register_host", "in=staged, out=staged"
        ),
        "pipeline.1gpu_auto_beside_register_host_is_held": _set(
            "path_ctxkit_1gpu_auto_beside_register_host", "in=staged, out=staged"
        ),
        "pipeline.1gpu_cold_first_call_vs_torch_cold": _set("cold_ms/ctxkit", [480.0] * 3),
        "pipeline.1gpu_cold_children_ok": _set("cold_errors", ["torch: exited with status 1"]),
        "pipeline.1gpu_cold_compile_cache_warm": _set("cold_cached", False),
        "pipeline.1gpu_vs_ceiling": _set("raw_1gpu_pinned", [60.0] * 3),
        "pipeline.1gpu_ceiling_rounds_held": _set("path_ctxkit_1gpu_held", "in=staged"),
        "pipeline.2gpu_ceiling_rounds_held": _set("path_ctxkit_2gpu_held", "in=staged"),
        "pipeline.2gpu_scaling": _set("ctxkit_2gpu_pageable_auto", [60.0] * 3),
        "pipeline.2gpu_repeated_is_held": _set("path_ctxkit_2gpu_pageable_auto", "in=staged"),
        "pipeline.2gpu_fresh_scaling_vs_raw": _set("fresh_2gpu_io", [60.0] * 3),
        "pipeline.pinned_vs_raw_1gpu": _set("ctxkit_1gpu_pinned", [40.0] * 3),
        "pipeline.pinned_vs_raw_2gpu": _set("ctxkit_2gpu_pinned", [70.0] * 3),
    },
}


def verdict_lines(bench: str, r: dict[str, Any]) -> dict[str, Line]:
    return by_name(load(bench).verdicts(r))


@pytest.mark.parametrize("bench", sorted(GOOD))
def test_good_measurements_pass_every_target_and_check(bench):
    lines = verdict_lines(bench, GOOD[bench]())
    judged = {n: ln for n, ln in lines.items() if ln.op is not None}
    assert judged, bench
    assert {n: ln.text() for n, ln in judged.items() if ln.ok is not True} == {}
    assert all(ln.text().endswith((" PASS", " ok", " INFO", " SKIP")) for ln in lines.values())


@pytest.mark.parametrize("bench", sorted(GOOD))
def test_every_target_and_check_has_a_failing_case(bench):
    """A new target without a canned failure would go untested: list it in FAIL_CASES."""
    lines = verdict_lines(bench, GOOD[bench]())
    assert {n for n, ln in lines.items() if ln.op is not None} == set(FAIL_CASES[bench])


@pytest.mark.parametrize(
    ("bench", "name"), [(b, n) for b, cases in sorted(FAIL_CASES.items()) for n in cases]
)
def test_bad_measurement_fails_its_line(bench, name, capsys):
    r = GOOD[bench]()
    FAIL_CASES[bench][name](r)
    line = verdict_lines(bench, r)[name]
    assert line.verdict == "FAIL", line.text()
    assert line.text().endswith(" FAIL")
    assert emit([line]) == (1 if line.kind == "check" else 0)
    assert capsys.readouterr().out.strip() == line.text()


# --- the specific ways a verdict used to mislead (issue 19) ------------------------------


def test_targets_decide_on_the_median_not_a_lucky_best_run():
    r = pipeline_good()
    r["ctxkit_1gpu_pageable_auto"] = [90.0, 30.0, 30.0]  # one lucky run of three
    line = verdict_lines("pipeline", r)["pipeline.1gpu_repeated_held_vs_naive_chunked"]
    assert line.verdict == "FAIL" and line.value == pytest.approx(30.0 / 8.0)
    assert "best" in line.note and "median" in line.note
    r = context_good()
    r["enter"] = [0.30, 0.70, 0.70]
    assert verdict_lines("context", r)["context.with_vs_raw_pair"].verdict == "FAIL"


def test_first_call_is_judged_on_first_calls_not_on_held_pages():
    """Held pages at 46 GB/s must not hide a 2.25 GB/s first call (the old headline)."""
    r = pipeline_good()
    r["new_pipeline_1gpu_io"] = r["new_pipeline_1gpu_pageable_out_io"] = [2.25 * 2] * 3
    lines = verdict_lines("pipeline", r)
    assert lines["pipeline.1gpu_first_call_new_pipeline_gbps"].verdict == "FAIL"
    assert lines["pipeline.1gpu_first_call_vs_naive_chunked"].verdict == "FAIL"
    assert lines["pipeline.1gpu_repeated_held_gbps"].verdict == "PASS"
    assert "held" in lines["pipeline.1gpu_repeated_held_gbps"].note


def test_auto_is_compared_with_the_explicit_path_that_holds_the_pages_too():
    """No per-call path can hold pages; auto beating them alone is won by construction
    (issue 30 item 1). The caller holding the same arrays (ck.register_host) can."""
    r = pipeline_good()
    lines = verdict_lines("pipeline", r)
    line = lines["pipeline.1gpu_auto_vs_fastest_other_path"]
    assert line.value == pytest.approx(45.0 / 45.5) and line.verdict == "PASS"
    assert "register_host" in line.note
    per_call = lines["pipeline.1gpu_held_vs_fastest_per_call_path"]
    assert per_call.op is None and per_call.value == pytest.approx(45.0 / 21.0)
    assert "staged" in per_call.note  # staged is the fastest path that locks nothing
    r["ctxkit_1gpu_register_host"] = [50.0] * 3  # the caller's pages beat auto's by 10%
    line = verdict_lines("pipeline", r)[line.name]
    assert line.verdict == "FAIL" and line.value == pytest.approx(0.9)


def test_auto_beside_the_caller_held_rounds_decides_the_held_comparison():
    """Auto's calls that took turns with the caller-held ones are compared with them, not
    auto's own earlier block: a slower phase of the host cannot fall on one side only."""
    r = pipeline_good()
    r["ctxkit_1gpu_pageable_auto"] = [30.0] * 3  # an earlier, noisier block
    line = verdict_lines("pipeline", r)["pipeline.1gpu_auto_vs_fastest_other_path"]
    assert line.verdict == "PASS" and line.value == pytest.approx(45.0 / 45.5)
    assert "in turn" in line.note
    r["ctxkit_1gpu_auto_beside_register_host"] = [40.0] * 3
    line = verdict_lines("pipeline", r)[line.name]
    assert line.verdict == "FAIL" and line.value == pytest.approx(40.0 / 45.5)


def test_the_graph_target_uses_the_size_fixed_in_advance_against_the_raw_graph():
    """The time per node is the driver's (INFO); ctxkit is judged against the raw graph."""
    r = launch_good()
    r["graph100_steady_ctxkit"] = [0.1, 0.1, 0.1]  # the small graph would pass
    r["graph1000_steady_ctxkit"] = [0.8, 0.8, 0.8]
    lines = verdict_lines("launch", r)
    line = lines["launch.graph_node_vs_raw"]
    assert line.verdict == "FAIL" and line.value == pytest.approx(0.8 / 0.46)
    assert "1000-node" in line.note
    assert lines["launch.graph_node_us"].verdict == "INFO"


def test_blocked_fraction_is_information_and_the_warning_is_the_target():
    r = memory_good()
    lines = verdict_lines("memory", r)
    frac = lines["memory.pageable_async_blocked_fraction"]
    assert frac.verdict == "INFO" and frac.value == pytest.approx(0.8)
    warned = lines["memory.pageable_async_warned"]
    assert (warned.value, warned.verdict) == (1.0, "PASS")


def test_sanity_bounds_are_checks_not_performance_lines():
    lines = verdict_lines("memory", memory_good())
    for name in ("memory.peer_staged_gbps", "memory.peer_p2p_gbps", "memory.peer_data_ok"):
        assert lines[name].kind == "check", name
        assert lines[name].text().startswith(f"CHECK {name} ") and lines[name].verdict == "ok"


def test_the_event_floor_is_shown_beside_the_foreign_target_and_judges_nothing():
    r = launch_good()
    lines = verdict_lines("launch", r)
    floor = lines["launch.event_order_floor_vs_ctxkit_buffers"]
    assert floor.verdict == "INFO" and floor.value == pytest.approx(6.8 / 5.6)
    r["two_buffers_event_floor"] = [60.0, 60.0, 60.0]
    assert all(ln.verdict != "FAIL" for ln in verdict_lines("launch", r).values())


def test_optional_comparisons_skip_with_their_reason_in_a_quick_run():
    r = launch_good() | {"quick": True}
    for key in ("cupy", "cuda_core", "current_stream", "torch_cupy", "two_buffers"):
        del r[key]
    r["cuda_core_note"] = "cuda.core is not installed (cuda.core: ModuleNotFoundError)"
    lines = verdict_lines("launch", r)
    line = lines["launch.prepared_vs_cuda_core"]
    assert line.verdict == "SKIP" and "cuda.core is not installed" in line.text()
    for name in (
        "launch.prepared_vs_cupy",
        "launch.current_stream_vs_explicit",
        "launch.foreign_args_vs_ctxkit_buffers",
    ):
        assert lines[name].verdict == "SKIP"
    r = context_good() | {"quick": True}
    del r["torch_device"]
    r["torch_note"] = "torch is not installed (ModuleNotFoundError)"
    line = verdict_lines("context", r)["context.with_vs_torch_device"]
    assert line.verdict == "SKIP" and "torch is not installed" in line.text()


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    """A change of the measurements: *key* was not measured."""
    return lambda r: r.pop(key, None)


#: Every comparison target whose baseline (CuPy, torch, cuda.core) can be missing: the
#: change of the good measurements that removes it.
MISSING_BASELINES: dict[str, dict[str, Callable[[dict[str, Any]], None]]] = {
    "compile": {"compile.warm_vs_cupy_warm": lambda r: r.update(cupy_warm=[], cupy_cold=[])},
    "context": {"context.with_vs_torch_device": _drop("torch_device")},
    "launch": {
        "launch.prepared_vs_cupy": _drop("cupy"),
        "launch.kernel_launch_vs_cupy": _drop("cupy"),
        "launch.kernel_launch_vs_cuda_core": _drop("cuda_core"),
        "launch.prepared_vs_cuda_core": _drop("cuda_core"),
        "launch.current_stream_vs_explicit": _drop("current_stream"),
        "launch.foreign_args_vs_ctxkit_buffers": _drop("torch_cupy"),
    },
    "memory": {
        f"memory.alloc_{size}_vs_{who}": _drop(f"alloc_{size}_{who}")
        for size in ("1mib", "256mib")
        for who in ("cupy", "torch")
    },
    "pipeline": {
        "pipeline.1gpu_first_call_vs_torch_pinned": lambda r: r.pop("torch_pinned_1gpu_io"),
        "pipeline.1gpu_cold_first_call_vs_torch_cold": lambda r: r.update(
            cold_ms={"ctxkit": [400.0] * 3}, cold_missing={"torch": "torch is not installed"}
        ),
    },
}


@pytest.mark.parametrize(
    ("bench", "name"), [(b, n) for b, cases in sorted(MISSING_BASELINES.items()) for n in cases]
)
def test_a_missing_baseline_fails_a_full_run_and_skips_a_quick_one(bench, name):
    """The GPU machine has every baseline: a full run that misses one FAILs, it does not
    SKIP into a pass (issue 30 item 2); a quick run may skip it."""
    r = GOOD[bench]()
    MISSING_BASELINES[bench][name](r)
    line = verdict_lines(bench, r)[name]
    assert line.verdict == "FAIL" and "baseline missing in a full run" in line.text(), line.text()
    line = verdict_lines(bench, r | {"quick": True})[name]
    assert line.verdict == "SKIP" and "comparison not made (quick run)" in line.text()


def test_every_comparison_that_can_skip_is_listed_as_a_missing_baseline():
    """A comparison target that prints SKIP in a quick run and is not in MISSING_BASELINES
    would skip unseen: list it (or make it a hardware skip, 'needs 2 GPUs')."""
    for bench, cases in MISSING_BASELINES.items():
        r = GOOD[bench]()
        for change in cases.values():
            change(r)
        skips = {n for n, ln in verdict_lines(bench, r | {"quick": True}).items() if ln.reason}
        hardware = {n for n in skips if "needs 2 GPUs" in verdict_lines(bench, r)[n].text()}
        info_only = {"compile.cold_vs_cupy_cold"}
        assert skips - hardware - info_only == set(cases), bench


def test_one_gpu_skips_the_two_gpu_targets():
    lines = verdict_lines("pipeline", pipeline_good(two_gpus=False))
    for name in ("pipeline.2gpu_scaling", "pipeline.2gpu_fresh_scaling_vs_raw"):
        assert lines[name].verdict == "SKIP" and "2 GPUs" in lines[name].text()
    assert not any(n.startswith("pipeline.2gpu_") and ln.op for n, ln in lines.items())
    r = memory_good()
    for key in ("peer", "peer_size", "peer_ok"):
        del r[key]
    r["peer_note"] = "needs two devices"
    lines = verdict_lines("memory", r)
    assert lines["memory.peer_staged_vs_raw"].verdict == "SKIP"
    assert "memory.peer_data_ok" not in lines


def test_executor_line_is_the_worst_thread_count():
    r = context_good()
    r["executor_threads8"] = [0.94 * 800_000.0] * 3
    line = verdict_lines("context", r)["registry.executor_vs_raw_threads"]
    assert line.value == pytest.approx(0.94) and line.verdict == "FAIL"
    assert "8 threads 0.94x" in line.note


def test_thread_lines_say_how_8_threads_compare_with_1_raw_thread():
    r = context_good()
    lines = verdict_lines("context", r)
    assert lines["threads.prepared_8_vs_raw_1"].value == pytest.approx(0.96 * 8)
    assert lines["threads.raw_8_vs_raw_1"].verdict == "INFO"
    del r["launch_threads1"], r["launch_threads2"], r["launch_threads4"], r["launch_threads8"]
    lines = verdict_lines("context", r)
    assert lines["threads.launch_vs_raw"].verdict == "SKIP"
    assert "NOT MEASURED" in lines["threads.launch_vs_raw"].reason


def test_the_python_launch_floor_is_information_at_its_worst_thread_count():
    r = context_good()
    assert "threads.python_floor_vs_raw" not in verdict_lines("context", r)
    for n in (1, 2, 4, 8):
        r[f"raw_python_threads{n}"] = [99_000.0 * n] * 3
    r["raw_python_threads2"] = [0.9 * 200_000.0] * 3
    line = verdict_lines("context", r)["threads.python_floor_vs_raw"]
    assert line.verdict == "INFO" and line.value == pytest.approx(0.9)
    assert "2 threads 0.90x" in line.note


def test_a_target_that_could_not_be_measured_fails():
    r = compile_good()
    r["warm"] = [None] * 7
    lines = verdict_lines("compile", r)
    assert lines["compile.warm_new_process"].value is None
    assert lines["compile.warm_new_process"].verdict == "FAIL"
    assert lines["compile.child_runs_ok"].verdict == "FAIL"


def test_mpi_failure_is_a_failed_check_and_a_missing_mpi_a_skip():
    r = procs_good()
    r["mpi"] = "no mpiexec on PATH (pip install mpich)"
    assert verdict_lines("procs", r)["procs.mpi_vs_pipeline"].verdict == "SKIP"
    r["mpi"] = "mpi_pipeline.py failed (rc 1): Traceback\n  boom"
    line = verdict_lines("procs", r)["procs.mpi_example_ok"]
    assert line.verdict == "FAIL" and "\n" not in line.text()
    r = procs_good()
    r["pipeline_s"] = "Pipeline.map returned a wrong result"
    assert verdict_lines("procs", r)["procs.pipeline_result_ok"].verdict == "FAIL"


def test_streaming_copy_lines_are_information_shown_only_when_measured():
    r = pipeline_good()
    lines = verdict_lines("pipeline", r)
    assert "pipeline.host_streaming_copy_best" not in lines
    assert "pipeline.1gpu_long_lived_streaming_vs_plain_copy" not in lines
    r |= {
        "host_streaming_best": 60.0,
        "host_streaming_best_median": 58.0,
        "host_copy_best": 60.0,
        "streaming_copy": "non-temporal stores (llvmlite)",
        "fresh_1gpu_plain_copy_io": [50.0, 52.0, 54.0],
    }
    lines = verdict_lines("pipeline", r)
    host = lines["pipeline.host_streaming_copy_best"]
    assert host.op is None and host.value == 60.0 and "non-temporal" in host.note
    ratio = lines["pipeline.1gpu_long_lived_streaming_vs_plain_copy"]
    assert ratio.op is None and ratio.value == pytest.approx(58.0 / 52.0)
    ceiling = lines["pipeline.1gpu_first_call_vs_staged_ceiling"]
    assert ceiling.value == pytest.approx(9.0 / 30.0)  # the first auto call / (best copy / 2)


def test_the_held_ceiling_ratio_uses_the_rounds_taken_in_turns_with_raw():
    r = pipeline_good()
    r["ctxkit_1gpu_pageable_auto"] = [38.0] * 3  # measured apart, at a worse moment
    line = verdict_lines("pipeline", r)["pipeline.1gpu_vs_ceiling"]
    assert line.value == pytest.approx(45.5 / 46.5) and line.verdict == "PASS"
    assert "interleaved" in line.note
    del r["ctxkit_1gpu_held"]
    lines = verdict_lines("pipeline", r)
    assert lines["pipeline.1gpu_vs_ceiling"].value == pytest.approx(38.0 / 46.5)
    assert "measured apart" in lines["pipeline.1gpu_vs_ceiling"].note
    assert "pipeline.1gpu_ceiling_rounds_held" not in lines


def test_first_call_targets_set_for_one_gib_are_not_measured_on_smaller_arrays():
    """A quick run's 256 MiB first calls print NOT MEASURED (a SKIP), never an INFO line
    a reader takes for a result or a PASS (issue 30 item 3)."""
    r = pipeline_good()
    r["new_pipeline_1gpu_io"] = [20.0] * 3  # would fail its 45 GB/s target
    r["first_call_gib"] = 0.25
    lines = verdict_lines("pipeline", r)
    for name in (
        "pipeline.1gpu_first_call_new_pipeline_gbps",
        "pipeline.1gpu_first_call_vs_torch_pinned",
        "pipeline.1gpu_long_lived_fresh_arrays_gbps",
    ):
        text = lines[name].text()
        assert lines[name].verdict == "SKIP" and text.endswith(" SKIP"), name
        assert "NOT MEASURED" in text and "is for 1 GiB arrays, this run used 0.25 GiB" in text
    assert "it measured 20.00" in lines["pipeline.1gpu_first_call_new_pipeline_gbps"].text()
    assert lines["pipeline.1gpu_first_call_vs_naive_chunked"].op == ">="  # any size
    r["first_call_gib"] = 1.0
    assert verdict_lines("pipeline", r)["pipeline.1gpu_first_call_new_pipeline_gbps"].verdict == (
        "FAIL"
    )


def test_first_call_vs_naive_compares_fresh_pageable_outputs_on_both_sides():
    """The naive pattern writes a fresh np.empty_like output; the pipeline's default out
    is a reused pinned-pool block. The target compares ctxkit with out="pageable" (a
    fresh np.empty_like too), not the default (issue 30 item 5)."""
    r = pipeline_good()
    r["new_pipeline_1gpu_io"] = [50.0] * 3  # the pooled output: fast
    r["new_pipeline_1gpu_pageable_out_io"] = [8.0] * 3  # like the naive side: slower
    line = verdict_lines("pipeline", r)["pipeline.1gpu_first_call_vs_naive_chunked"]
    assert line.verdict == "FAIL" and line.value == pytest.approx(8.0 / 9.0)
    assert 'out="pageable"' in line.note


def test_the_cold_first_call_is_a_target_against_torchs_best_cold_path():
    r = pipeline_good()
    lines = verdict_lines("pipeline", r)
    line = lines["pipeline.1gpu_cold_first_call_vs_torch_cold"]
    assert (line.op, line.limit) == (">=", 2.0)
    assert line.value == pytest.approx(900.0 / 420.0) and line.verdict == "PASS"
    assert ".cuda() * 2 .cpu()" in line.note and "best runs 880 and 400 ms" in line.note
    assert lines["pipeline.1gpu_cold_ctxkit_ms"].value == 420.0
    assert lines["pipeline.1gpu_cold_torch_pinned_ms"].value == 1000.0
    warm = lines["pipeline.1gpu_cold_ctxkit_ms"].note
    assert "in the warm process 143 ms" in warm  # 2 GiB at 15 GB/s in+out
    r["cold_ms"]["torch_pinned"] = [700.0] * 3  # now torch's best cold path
    line = verdict_lines("pipeline", r)[line.name]
    assert line.value == pytest.approx(700.0 / 420.0) and line.verdict == "FAIL"
    assert "pin_memory" in line.note
    del r["cold_ms"]["ctxkit"]  # every ctxkit process failed
    r["cold_errors"] = ["ctxkit: exited with status 1: boom"]
    lines = verdict_lines("pipeline", r)
    assert lines[line.name].verdict == "FAIL" and lines[line.name].value is None
    assert lines["pipeline.1gpu_cold_children_ok"].verdict == "FAIL"
    assert "boom" in lines["pipeline.1gpu_cold_children_ok"].text()


def test_the_cold_first_call_is_not_measured_in_a_quick_run_and_fails_when_missing():
    r = pipeline_good()
    for key in ("cold_ms", "cold_missing", "cold_errors", "cold_cached", "cold_gib"):
        del r[key]
    line = verdict_lines("pipeline", r | {"quick": True})[
        "pipeline.1gpu_cold_first_call_vs_torch_cold"
    ]
    assert line.verdict == "SKIP" and "NOT MEASURED" in line.text()
    line = verdict_lines("pipeline", r)["pipeline.1gpu_cold_first_call_vs_torch_cold"]
    assert line.verdict == "FAIL"
