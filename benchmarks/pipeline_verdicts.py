"""The verdicts of benchmarks/bench_pipeline.py: its SUMMARY and CHECK lines from its
measurements, as pure functions (no GPU; tested on canned numbers by
tests/benchmarks/test_verdicts.py).

Targets (one H200 and, for the 2-GPU lines, two H200s of one host), all on medians:

* the cold first call: a fresh process maps a 1 GiB float32 array (pageable in and out,
  compile cache warm, array made before the clock) >= 2x faster than PyTorch's best cold
  path, each side in fresh processes;
* first calls on arrays never seen, in a warm process (GB/s of input + output): a new
  Pipeline per call >= 45 GB/s and >= 1.4x torch's pinned path, not slower than the naive
  pattern when both write fresh pageable outputs, a long-lived Pipeline fed fresh arrays
  >= 55 GB/s, and on 2 GPUs fresh arrays scaling >= 0.9x the raw pinned pipeline's own
  scaling;
* the same arrays again (pin on reuse, ``in=held, out=held``; GB/s of input): >= 30 GB/s,
  >= 5.5x the naive pattern reusing its arrays, >= 0.97x the fastest explicit path given
  the same advantage (the caller page-locking the arrays once with ``ck.register_host``),
  >= 0.95x the raw pinned pipeline (rounds taking turns with it); 2 GPUs >= 1.8x 1 GPU;
* pinned arrays >= 0.95x the raw pinned pipeline.

A comparison whose baseline (torch) is missing FAILs in a full run and SKIPs in a quick
one; the targets set for 1 GiB arrays print NOT MEASURED on smaller ones
(benchmarks/verdictlines.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from verdictlines import (
    QUICK,
    Line,
    check,
    info,
    median,
    median_info,
    median_target,
    missing_baseline,
    not_measured,
    skipped,
    target,
)

HELD = "in=held, out=held"
IO = "GB/s in+out"


#: The explicit host paths of the held comparison: each maps the same reused pageable
#: arrays and locks nothing across calls, so none can hold pages as ``"auto"`` does (pin on
#: reuse). Beating them alone is won by construction: the target compares auto with the
#: fastest of them and :data:`CALLER_HELD`, the explicit path with the same advantage.
OTHER_PATHS = (
    "staged",
    "register",
    "in-register-out-staged",
    "in-staged-out-register",
    "staged_after_register",
    "register_dynamic",
)

#: The caller page-locks the same arrays once (``ck.register_host``) and maps them again
#: and again: held pages without pin on reuse (path ``"pinned"``), timed after the same
#: one untimed call as auto's held calls.
CALLER_HELD = "register_host"

#: Auto's held calls in the rounds that take turns with :data:`CALLER_HELD`'s.
BESIDE_CALLER = "ctxkit_1gpu_auto_beside_register_host"


def _ratio(
    r: Mapping[str, Any], name: str, num: str, den: str, op: str | None, limit: float, what: str
) -> Line:
    """``num / den`` on medians (target when *op* is given); best runs beside."""
    a, b = r[num], r[den]
    value = median(a) / median(b)
    note = f"{what}; medians of {len(a)} and {len(b)}; best {max(a) / max(b):.2f}x"
    return info(name, value, "x", note) if op is None else target(name, value, op, limit, "x", note)


def _held_check(r: Mapping[str, Any], nd: int) -> Line:
    path = r.get(f"path_ctxkit_{nd}gpu_pageable_auto", "")
    return check(
        f"pipeline.{nd}gpu_repeated_is_held",
        1.0 if path == HELD else 0.0,
        ">=",
        1,
        "",
        f"1 = the repeated-call line measured {HELD} (it measured {path or 'nothing'})",
    )


#: First-call targets that are set for 1 GiB float32 arrays: NOT MEASURED when the
#: first-call section ran on smaller ones (``--quick``, ``--first-call-gb``).
SIZED_TARGETS = (
    "pipeline.1gpu_first_call_new_pipeline_gbps",
    "pipeline.1gpu_first_call_vs_torch_pinned",
    "pipeline.1gpu_long_lived_fresh_arrays_gbps",
)


def _for_size(line: Line, gib: float) -> Line:
    if line.name not in SIZED_TARGETS or line.op is None or gib >= 1.0 - 1e-9:
        return line
    got = "n/a" if line.value is None else f"{line.value:.2f}"
    return not_measured(
        line.name,
        f"the target {line.op} {line.limit:g} {line.unit} is for 1 GiB arrays, this run "
        f"used {gib:.2f} GiB (it measured {got}; {line.note})",
    )


def first_call_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The first-call targets (GB/s in+out, medians); NOT MEASURED, never a pass, when
    the section ran on arrays smaller than the 1 GiB they are set for."""
    gib = r.get("first_call_gib", 1.0)
    return [_for_size(line, gib) for line in _first_call_lines(r)]


def _first_call_lines(r: Mapping[str, Any]) -> list[Line]:
    lines = [
        median_target(
            "pipeline.1gpu_first_call_new_pipeline_gbps",
            r["new_pipeline_1gpu_io"],
            ">=",
            45,
            IO,
            "ck.Pipeline([0]).map(k, x), a new Pipeline per call, fresh x, default out",
        ),
    ]
    if r.get("new_pipeline_1gpu_pageable_out_io"):
        lines.append(
            median_info(
                "pipeline.1gpu_first_call_pageable_out_gbps",
                r["new_pipeline_1gpu_pageable_out_io"],
                IO,
                'the same with out="pageable" (fresh output pages, drained through staging)',
            )
        )
    warm = r.get("warmup_round_io", {}).get("new_pipeline_1gpu_io")
    if warm is not None:
        lines.append(
            info(
                "pipeline.1gpu_first_call_warmup_gbps",
                warm,
                IO,
                "the untimed warm-up call before those: its output block is new to the pool",
            )
        )
    if r.get("torch_pinned_1gpu_io"):
        lines.append(
            _ratio(
                r,
                "pipeline.1gpu_first_call_vs_torch_pinned",
                "new_pipeline_1gpu_io",
                "torch_pinned_1gpu_io",
                ">=",
                1.4,
                "same fresh arrays, calls taking turns",
            )
        )
    else:
        lines.append(
            missing_baseline(
                r,
                "pipeline.1gpu_first_call_vs_torch_pinned",
                ">=",
                1.4,
                "x",
                r.get("torch_note") or "torch not measured",
            )
        )
    lines.append(
        _ratio(
            r,
            "pipeline.1gpu_first_call_vs_naive_chunked",
            "new_pipeline_1gpu_pageable_out_io",
            "naive_1gpu_8chunk_fresh_io",
            ">=",
            1.0,
            'both on fresh arrays writing fresh np.empty_like outputs (ctxkit out="pageable"), '
            "naive 8 chunks; not slower than the naive pattern",
        )
    )
    lines.append(
        median_target(
            "pipeline.1gpu_long_lived_fresh_arrays_gbps",
            r["fresh_1gpu_io"],
            ">=",
            55,
            IO,
            "one Pipeline, a fresh x every call, default out",
        )
    )
    if r.get("fresh_1gpu_plain_copy_io"):
        lines.append(
            _ratio(
                r,
                "pipeline.1gpu_long_lived_streaming_vs_plain_copy",
                "fresh_1gpu_io",
                "fresh_1gpu_plain_copy_io",
                None,
                0,
                "the same long-lived calls with the staging copies made by np.copyto, taking turns",
            )
        )
    return lines


#: The cold first call's sides (benchmarks/pipeline_cold.py): what each times.
COLD_SIDES = {
    "ctxkit": 'ck.Pipeline([0]).map(k, x, out="pageable")',
    "ctxkit_default_out": "ck.Pipeline([0]).map(k, x), default out",
    "torch": "torch.from_numpy(x).cuda() * 2 .cpu()",
    "torch_pinned": "torch pin_memory() in, a pinned output",
}
COLD_TARGET = "pipeline.1gpu_cold_first_call_vs_torch_cold"


def cold_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The first call of a fresh process vs PyTorch's best cold path (ms, medians of the
    rounds; each call in its own process): ``cold_ms`` maps a side of :data:`COLD_SIDES`
    to its times, ``cold_missing`` a side to why it could not run (torch missing),
    ``cold_errors`` lists the children that failed, ``cold_cached`` says every ctxkit
    child compiled from the cache."""
    if "cold_ms" not in r:
        if r.get(QUICK):
            return [not_measured(COLD_TARGET, "a quick run starts no fresh processes")]
        return [target(COLD_TARGET, None, ">=", 2.0, "x", "the cold section did not run")]
    ms, gib = r["cold_ms"], r.get("cold_gib", 1.0)
    lines = [
        median_info(
            f"pipeline.1gpu_cold_{side}_ms",
            ms[side],
            "ms",
            f"{COLD_SIDES[side]}, {gib:.2f} GiB float32, a fresh process per call"
            + _warm_beside(r, side),
            higher=False,
        )
        for side in COLD_SIDES
        if ms.get(side)
    ]
    torch = {s: ms[s] for s in ("torch", "torch_pinned") if ms.get(s)}
    if not torch:
        missing = r.get("cold_missing", {})
        reason = missing.get("torch") or missing.get("torch_pinned") or "torch not measured"
        lines.append(missing_baseline(r, COLD_TARGET, ">=", 2.0, "x", reason))
    else:
        best = min(torch, key=lambda s: median(torch[s]))
        mine = ms.get("ctxkit") or []
        lines.append(
            target(
                COLD_TARGET,
                median(torch[best]) / median(mine) if mine else None,
                ">=",
                2.0,
                "x",
                f"torch's best cold path ({COLD_SIDES[best]}) {median(torch[best]):.0f} ms vs "
                f"{COLD_SIDES['ctxkit']} {median(mine):.0f} ms; medians of {len(torch[best])} "
                f"and {len(mine)} fresh processes; best runs {min(torch[best]):.0f} and "
                f"{min(mine, default=math.nan):.0f} ms",
            )
        )
    errors = r.get("cold_errors", [])
    lines += [
        check(
            "pipeline.1gpu_cold_children_ok",
            0.0 if errors else 1.0,
            ">=",
            1,
            "",
            "1 = every fresh process ran and returned y = 2x"
            + (": " + "; ".join(errors) if errors else ""),
        ),
        check(
            "pipeline.1gpu_cold_compile_cache_warm",
            1.0 if r.get("cold_cached") else 0.0,
            ">=",
            1,
            "",
            "1 = every ctxkit process found the kernel in the compile cache",
        ),
    ]
    return lines


def _warm_beside(r: Mapping[str, Any], side: str) -> str:
    """The same call in the benchmark's warm process, in ms, when it was measured on
    the same size."""
    key = {
        "ctxkit": "new_pipeline_1gpu_pageable_out_io",
        "ctxkit_default_out": ("new_pipeline_1gpu_io"),
    }.get(side)
    if key is None or not r.get(key) or r.get("first_call_gib") != r.get("cold_gib", 1.0):
        return ""
    nbytes = 2 * r["first_call_gib"] * (1 << 30)
    return f"; in the warm process {nbytes / (median(r[key]) * 1e9) * 1e3:.0f} ms (median)"


def held_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """Repeated calls on the same arrays (pin on reuse: in=held, out=held), 1 GPU."""
    held = r["ctxkit_1gpu_pageable_auto"]
    per_call = {
        p: r[f"ctxkit_1gpu_pageable_{p}"] for p in OTHER_PATHS if r.get(f"ctxkit_1gpu_pageable_{p}")
    }
    fastest_per_call = max(per_call, key=lambda p: median(per_call[p]))
    caller = r[f"ctxkit_1gpu_{CALLER_HELD}"]
    beside = r.get(BESIDE_CALLER) or held
    vs_caller = median(beside) / median(caller)
    vs_per_call = median(held) / median(per_call[fastest_per_call])
    first = r["ctxkit_1gpu_auto_first_call"][0]
    return [
        median_target(
            "pipeline.1gpu_repeated_held_gbps",
            held,
            ">=",
            30,
            "GB/s",
            f"same arrays again, {HELD}; GB/s of input",
        ),
        _held_check(r, 1),
        _ratio(
            r,
            "pipeline.1gpu_repeated_held_vs_naive_chunked",
            "ctxkit_1gpu_pageable_auto",
            "naive_1gpu_8chunk",
            ">=",
            5.5,
            f"{HELD} vs naive 8 chunks reusing its arrays",
        ),
        target(
            "pipeline.1gpu_auto_vs_fastest_other_path",
            min(vs_caller, vs_per_call),
            ">=",
            0.97,
            "x",
            f"auto ({HELD}) vs the caller holding the pages (ck.register_host) "
            f"{vs_caller:.3f}x ({median(beside):.1f} vs {median(caller):.1f} GB/s, rounds "
            f"taken in turn on arrays of the same size) and vs the fastest path that locks "
            f"nothing across calls ({fastest_per_call}) {vs_per_call:.2f}x; the lower decides; "
            "medians",
        ),
        _caller_held_check(r),
        check(
            "pipeline.1gpu_auto_beside_register_host_is_held",
            1.0 if r.get(f"path_{BESIDE_CALLER}") == HELD else 0.0,
            ">=",
            1,
            "",
            f"1 = auto's calls taking turns with the caller-held ones measured {HELD} (they "
            f"measured {r.get(f'path_{BESIDE_CALLER}') or 'nothing'})",
        ),
        info(
            "pipeline.1gpu_held_vs_fastest_per_call_path",
            median(held) / median(per_call[fastest_per_call]),
            "x",
            f"what holding pages buys: auto vs the fastest path that locks nothing across "
            f"calls, {fastest_per_call}; medians",
        ),
        info(
            "pipeline.1gpu_pageable_first_call_gbps",
            first,
            "GB/s",
            f"one call: first auto call on the {r['size_gib']:.2f} GiB arrays, out given "
            f"({r.get('path_ctxkit_1gpu_auto_first_call', '?')})",
        ),
        info(
            "pipeline.1gpu_pageable_second_call_gbps",
            r["ctxkit_1gpu_auto_second_call"][0],
            "GB/s",
            "one call: locks the pages",
        ),
        info(
            "pipeline.1gpu_first_call_vs_staged_ceiling",
            first / (r.get("host_copy_best", r["host_memcpy_best"]) / 2),
            "x",
            "staged ceiling = best host copy / 2",
        ),
        median_info(
            "pipeline.1gpu_ceiling_gbps",
            r["raw_1gpu_pinned"],
            "GB/s",
            "raw cuda.bindings pinned pipeline",
        ),
        *_vs_ceiling(r, 1, ">=", 0.95),
    ]


def _caller_held_check(r: Mapping[str, Any]) -> Line:
    path = r.get(f"path_ctxkit_1gpu_{CALLER_HELD}", "")
    return check(
        f"pipeline.1gpu_{CALLER_HELD}_is_pinned",
        1.0 if path == "pinned" else 0.0,
        ">=",
        1,
        "",
        f"1 = the caller-held line moved page-locked memory directly (path pinned; it "
        f"measured {path or 'nothing'})",
    )


def _vs_ceiling(r: Mapping[str, Any], nd: int, op: str | None, limit: float) -> list[Line]:
    """The held path vs the raw pinned pipeline: on the rounds that took turns with it
    (``ctxkit_<nd>gpu_held``, with a CHECK that they were held) when measured, else on
    the held-path measurement taken apart from it."""
    name = f"pipeline.{nd}gpu_vs_ceiling"
    if not r.get(f"ctxkit_{nd}gpu_held"):
        return [
            _ratio(
                r,
                name,
                f"ctxkit_{nd}gpu_pageable_auto",
                f"raw_{nd}gpu_pinned",
                op,
                limit,
                f"{HELD} vs the raw pinned pipeline, measured apart",
            )
        ]
    path = r.get(f"path_ctxkit_{nd}gpu_held", "")
    return [
        _ratio(
            r,
            name,
            f"ctxkit_{nd}gpu_held",
            f"raw_{nd}gpu_pinned",
            op,
            limit,
            f"{HELD} vs the raw pinned pipeline, interleaved rounds",
        ),
        check(
            f"pipeline.{nd}gpu_ceiling_rounds_held",
            1.0 if path == HELD else 0.0,
            ">=",
            1,
            "",
            f"1 = the interleaved held rounds measured {HELD} (they measured {path or 'nothing'})",
        ),
    ]


def two_gpu_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """Scaling to 2 GPUs, held and fresh, against the raw pipeline's own scaling."""
    if "ctxkit_2gpu_pageable_auto" not in r:
        reason = "needs 2 GPUs"
        return [
            skipped("pipeline.2gpu_scaling", reason),
            skipped("pipeline.2gpu_fresh_scaling_vs_raw", reason),
        ]
    raw_scaling = median(r["raw_2gpu_pinned"]) / median(r["raw_1gpu_pinned"])
    fresh_scaling = median(r["fresh_2gpu_io"]) / median(r["fresh_1gpu_io"])
    return [
        median_info(
            "pipeline.2gpu_repeated_held_gbps", r["ctxkit_2gpu_pageable_auto"], "GB/s", HELD
        ),
        _held_check(r, 2),
        _ratio(
            r,
            "pipeline.2gpu_scaling",
            "ctxkit_2gpu_pageable_auto",
            "ctxkit_1gpu_pageable_auto",
            ">=",
            1.8,
            f"{HELD}, 2 GPUs vs 1",
        ),
        _ratio(
            r,
            "pipeline.2gpu_repeated_held_vs_naive_chunked",
            "ctxkit_2gpu_pageable_auto",
            "naive_2gpu_8chunk",
            None,
            0,
            "naive reusing its arrays",
        ),
        info(
            "pipeline.2gpu_pageable_first_call_gbps",
            r["ctxkit_2gpu_auto_first_call"][0],
            "GB/s",
            "one call",
        ),
        median_info("pipeline.2gpu_long_lived_fresh_arrays_gbps", r["fresh_2gpu_io"], IO),
        target(
            "pipeline.2gpu_fresh_scaling_vs_raw",
            fresh_scaling / raw_scaling,
            ">=",
            0.9,
            "x",
            f"fresh arrays scale {fresh_scaling:.2f}x from 1 to 2 GPUs, the raw pinned "
            f"pipeline {raw_scaling:.2f}x; medians",
        ),
        median_info("pipeline.2gpu_ceiling_gbps", r["raw_2gpu_pinned"], "GB/s"),
        *_vs_ceiling(r, 2, None, 0),
    ]


def verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The SUMMARY and CHECK lines of this benchmark from its measurements (pure).

    *r* maps measurement names to lists of GB/s (one per call or round; input bytes, or
    input + output for the ``*_io`` first-call measurements), ``path_<name>`` to the
    host path a measurement took, and ``counts``, ``size_gib``, ``host_memcpy_best``,
    ``register_best``, ``torch_note``.
    """
    reps = r.get("host_memcpy_repeats", 0)
    lines = [
        info(
            "pipeline.host_memcpy_best",
            r["host_memcpy_best"],
            "GB/s",
            f"best thread count, best of {reps}; its median "
            f"{r.get('host_memcpy_best_median', math.nan):.1f} GB/s",
        )
    ]
    if r.get("host_streaming_best"):
        lines.append(
            info(
                "pipeline.host_streaming_copy_best",
                r["host_streaming_best"],
                "GB/s",
                f"ctxkit's staging copy ({r.get('streaming_copy', '?')}), pageable->pinned, best "
                f"thread count, best of {reps}; its median "
                f"{r.get('host_streaming_best_median', math.nan):.1f} GB/s",
            )
        )
    reg = r.get("register_best") or {}
    if reg.get("both"):
        lines += [
            info("pipeline.register_gbps_best", reg["reg"], "GB/s", f"best of {reps}, best setup"),
            info("pipeline.unregister_gbps_best", reg["unreg"], "GB/s", f"best of {reps}"),
            info("pipeline.register_unregister_gbps_best", reg["both"], "GB/s", f"best of {reps}"),
        ]
        if reg.get("one_thread"):
            lines.append(
                info(
                    "pipeline.register_thread_scaling",
                    reg["both"] / reg["one_thread"],
                    "x",
                    "best vs 1 thread",
                )
            )
    lines += cold_verdicts(r) + first_call_verdicts(r) + held_verdicts(r)
    lines += two_gpu_verdicts(r)
    for nd in r["counts"]:
        lines.append(
            _ratio(
                r,
                f"pipeline.pinned_vs_raw_{nd}gpu",
                f"ctxkit_{nd}gpu_pinned",
                f"raw_{nd}gpu_pinned",
                ">=",
                0.95,
                "interleaved rounds",
            )
        )
        best = max(r[f"ctxkit_{nd}gpu_pinned"]) / max(r[f"raw_{nd}gpu_pinned"])
        lines.append(info(f"pipeline.pinned_vs_raw_best_{nd}gpu", best, "x", "best rounds"))
    nd = r["counts"][-1]
    lines.append(
        _ratio(
            r,
            f"pipeline.um_vs_explicit_pinned_{nd}gpu",
            f"managed_{nd}gpu",
            f"ctxkit_{nd}gpu_pinned",
            None,
            0,
            "map_managed vs pinned map",
        )
    )
    return lines
