"""The table of ``python -m ctxkit demo``, as pure functions (tested on canned numbers).

A :class:`Row` holds one variant's GB/s -- input plus output bytes per second -- of each
timed call; :func:`format_table` lays the rows side by side, each against PyTorch's
pinned path (:func:`baseline_row`; the naive pattern without PyTorch).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LABELS",
    "ROW_ORDER",
    "Row",
    "baseline_row",
    "choose_size_mb",
    "format_table",
    "io_gbps",
    "trace_paths",
]


GiB = 1 << 30


#: Row keys, in the order the table lists them.
ROW_ORDER = (
    "naive",
    "cupy",
    "torch",
    "torch_pinned",
    "first_call",
    "fresh",
    "repeated",
    "pinned",
)


LABELS = {
    "naive": "naive pattern, 8 chunks per device",
    "cupy": "CuPy cp.asnumpy(cp.asarray(x) * 2)",
    "torch": 'torch (from_numpy(x).to("cuda") * 2).cpu()',
    "torch_pinned": "torch pin_memory() + non-blocking, cached pinned out",
    "first_call": "ctxkit first call: new Pipeline, fresh x, default out",
    "fresh": "ctxkit long-lived Pipeline, fresh x, default out",
    "repeated": "ctxkit repeated (same arrays)",
    "pinned": "ctxkit pinned arrays",
}


@dataclass(frozen=True)
class Row:
    """One variant of the table: GB/s (input + output bytes) of each timed call."""

    key: str
    gpus: int
    gbps: tuple[float, ...]
    note: str = ""

    @property
    def label(self) -> str:
        """The variant's name in the table."""
        return LABELS.get(self.key, self.key)

    @property
    def best(self) -> float:
        """The fastest call's GB/s (0.0 without calls)."""
        return max(self.gbps, default=0.0)

    @property
    def median(self) -> float:
        """The median call's GB/s (0.0 without calls)."""
        return statistics.median(self.gbps) if self.gbps else 0.0


def io_gbps(in_bytes: int, out_bytes: int, seconds: float) -> float:
    """Gigabytes (1e9) of input plus output per second."""
    return (in_bytes + out_bytes) / seconds / 1e9 if seconds > 0 else 0.0


def baseline_row(rows: Sequence[Row]) -> Row | None:
    """What the table compares with: PyTorch's pinned path, else the naive pattern."""
    by_key = {r.key: r for r in rows if r.gbps}
    return by_key.get("torch_pinned") or by_key.get("naive")


def _ordered(rows: Sequence[Row]) -> list[Row]:
    rank = {k: i for i, k in enumerate(ROW_ORDER)}
    return sorted(rows, key=lambda r: rank.get(r.key, len(rank)))


def format_table(rows: Sequence[Row], skipped: Sequence[str] = (), title: str = "") -> list[str]:
    """The side-by-side table as lines: variant, GPUs, best and median GB/s (input +
    output bytes), every call, and the best against :func:`baseline_row`'s best."""
    base = baseline_row(rows)
    vs = f"vs {'torch pinned' if base and base.key == 'torch_pinned' else 'naive'}"
    width = max([len(r.label) for r in rows] + [len("variant")])
    lines = [title] if title else []
    lines.append(f"  {'variant':{width}s}  GPUs  best GB/s  median  {vs:>15s}  calls (GB/s)")
    for r in _ordered(rows):
        ratio = f"{r.best / base.best:.2f}x" if base and base.best else "-"
        calls = " ".join(f"{g:.1f}" for g in r.gbps)
        note = f"  ({r.note})" if r.note else ""
        lines.append(
            f"  {r.label:{width}s}  {r.gpus:4d}  {r.best:9.1f}  {r.median:6.1f}  "
            f"{ratio:>15s}  {calls}{note}"
        )
    lines.extend(f"  skipped: {s}" for s in skipped)
    return lines


def choose_size_mb(
    requested: float | None, quick: bool, gpu_bytes: Sequence[int], host_bytes: int | None
) -> float:
    """The input size in MiB: *requested*, else 1024 where every GPU has 8 GiB and the
    host 16 GiB (the variants hold several copies of the input), else 256; ``--quick``
    caps it at 64.

    Raises
    ------
    ValueError
        *requested* is not a positive number.
    """
    if requested is None:
        roomy = min(gpu_bytes, default=0) >= 8 * GiB and (host_bytes or 0) >= 16 * GiB
        size = 1024.0 if roomy else 256.0
    else:
        size = float(requested)
        if not size > 0:
            raise ValueError(f"--size-mb must be a positive number of MiB, got {requested!r}")
    return min(size, 64.0) if quick else size


def trace_paths(path: str) -> tuple[Path, Path]:
    """Where the timelines go: the repeated call's at *path*, the first call's beside it
    (``NAME-first-call.json``)."""
    main = Path(path)
    return main, main.with_name(f"{main.stem}-first-call{main.suffix or '.json'}")
