"""The verdicts of benchmarks/bench_pipeline.py: its SUMMARY and CHECK lines from its
measurements, as pure functions (no GPU; tested on canned numbers by
tests/benchmarks/test_verdicts.py).

Targets (one H200 and, for the 2-GPU lines, two H200s of one host), all on medians:

* first calls on arrays never seen (GB/s of input + output): a new Pipeline per
  call >= 45 GB/s and >= 1.4x torch's pinned path, not slower than the naive pattern on
  fresh arrays, a long-lived Pipeline fed fresh arrays >= 55 GB/s, and on 2 GPUs fresh
  arrays scaling >= 0.9x the raw pinned pipeline's own scaling;
* the same arrays again (pin on reuse, ``in=held, out=held``; GB/s of input): >= 30 GB/s,
  >= 5.5x the naive pattern reusing its arrays, >= 0.97x the fastest other host path,
  >= 0.95x the raw pinned pipeline (rounds taking turns with it); 2 GPUs >= 1.8x 1 GPU;
* pinned arrays >= 0.95x the raw pinned pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from verdictlines import Line, check, info, median, median_info, median_target, skipped, target

HELD = "in=held, out=held"
IO = "GB/s in+out"


#: Paths of the held (pin on reuse) comparison that are not ``"auto"`` itself.
OTHER_PATHS = (
    "staged",
    "register",
    "in-register-out-staged",
    "in-staged-out-register",
    "staged_after_register",
    "register_dynamic",
)


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


#: First-call targets that are set for 1 GiB float32 arrays: information when the
#: first-call section ran on smaller ones (``--quick``, ``--first-call-gb``).
SIZED_TARGETS = (
    "pipeline.1gpu_first_call_new_pipeline_gbps",
    "pipeline.1gpu_first_call_vs_torch_pinned",
    "pipeline.1gpu_long_lived_fresh_arrays_gbps",
)


def _for_size(line: Line, gib: float) -> Line:
    if line.name not in SIZED_TARGETS or line.op is None or gib >= 1.0 - 1e-9:
        return line
    note = f"{line.note}; the target {line.op} {line.limit:g} is for 1 GiB, this run {gib:.2f} GiB"
    return dataclasses.replace(line, op=None, limit=None, note=note)


def first_call_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The first-call targets (GB/s in+out, medians); information, not targets, when the
    section ran on arrays smaller than the 1 GiB they are set for."""
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
        lines.append(skipped("pipeline.1gpu_first_call_vs_torch_pinned", r.get("torch_note", "")))
    lines.append(
        _ratio(
            r,
            "pipeline.1gpu_first_call_vs_naive_chunked",
            "new_pipeline_1gpu_io",
            "naive_1gpu_8chunk_fresh_io",
            ">=",
            1.0,
            "both on fresh arrays, naive 8 chunks; not slower than the naive pattern",
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


def held_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """Repeated calls on the same arrays (pin on reuse: in=held, out=held), 1 GPU."""
    held = r["ctxkit_1gpu_pageable_auto"]
    others = {
        p: r[f"ctxkit_1gpu_pageable_{p}"] for p in OTHER_PATHS if r.get(f"ctxkit_1gpu_pageable_{p}")
    }
    fastest = max(others, key=lambda p: median(others[p]))
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
            median(held) / median(others[fastest]),
            ">=",
            0.97,
            "x",
            f"auto ({HELD}) vs the fastest other host path, {fastest} "
            f"{median(others[fastest]):.1f} GB/s; medians",
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
    lines += first_call_verdicts(r) + held_verdicts(r) + two_gpu_verdicts(r)
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
