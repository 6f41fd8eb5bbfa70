"""Timelines of multi-device work (who ran what, where, and when) and NVTX ranges.

A :class:`Timeline` is a sorted list of :class:`Interval` (name, device, stream, chunk,
start and end in milliseconds on one host clock). It is built from plain numbers (so
it can be tested and loaded anywhere) or by a :class:`Recorder`, which collects host
intervals from :func:`time.perf_counter` and pairs of CUDA events, and maps each
device's event times onto the host clock through one reference event per device.

Export: :meth:`Timeline.to_chrome_trace` writes Chrome-trace JSON (open it in
https://ui.perfetto.dev or ``chrome://tracing``; one process per device, one thread
per stream or host thread); :meth:`Timeline.to_png` draws a Gantt chart when
matplotlib is installed (in a checkout ``pip install -e ".[plot]"``, from the package
index ``pip install "ctxkit-cuda[plot]"``).

NVTX ranges for Nsight Systems, in the ``ctxkit`` domain, are the other half of the
trace, and free when unused. ctxkit marks its chunk stages, copies, compiles and launches
with them, so a profile (``nsys profile python app.py``) shows ctxkit's work by name
beside the CUDA calls. They need the optional ``nvtx`` package (``pip install
"ctxkit-cuda[nvtx]"``, or ``[nvtx]`` in a checkout); without it -- or with
``CTXKIT_NVTX=0`` -- every NVTX function here does nothing and costs one check of a module
flag: :func:`nvtx_range` returns one shared do-nothing context manager and
:func:`nvtx_annotate` returns the function itself.

The ``nvtx`` package is imported at the first range, not when this module is imported.
Ranges opened with :func:`nvtx_range` belong to the calling thread (push/pop); a range
that starts in one thread and ends in another (a chunk handed from a feeder to a drainer)
uses :func:`nvtx_start_range` / :func:`nvtx_end_range`.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from . import _driver
from ._env import env_off

__all__ = [
    "NVTX_DOMAIN",
    "Filter",
    "Interval",
    "Recorder",
    "Timeline",
    "nvtx_annotate",
    "nvtx_enabled",
    "nvtx_end_range",
    "nvtx_mark",
    "nvtx_range",
    "nvtx_start_range",
    "set_nvtx_enabled",
]

HOST_PREFIX = "host"


@dataclass(frozen=True)
class Interval:
    """One stage of work: ``name`` ran on ``device``/``stream`` from ``start_ms`` to ``end_ms``.

    Attributes
    ----------
    name : str
        Stage name: ``"h2d"``, ``"kernel"``, ``"d2h"``, ``"fill"``, ``"drain"``,
        ``"prefetch"``, ``"wait"``, ``"stage:<name>"``...
    device : int
        Device ordinal (``-1`` for work tied to no device).
    stream : str
        The GPU stream (``"stream 0"``) or host thread (``"host <thread name>"``).
    chunk : int or None
        Index of the chunk the stage belongs to, ``None`` for stages outside a map.
    start_ms, end_ms : float
        Milliseconds since the recording started, on the host clock.
    """

    name: str
    device: int
    stream: str
    chunk: int | None
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        """``end_ms - start_ms``."""
        return self.end_ms - self.start_ms

    @property
    def category(self) -> str:
        """The name up to the first ``":"`` (``"stage:sum"`` -> ``"stage"``)."""
        return self.name.split(":", 1)[0]

    @property
    def is_host(self) -> bool:
        """True for intervals of a host thread (stream name starting with ``"host"``)."""
        return self.stream.startswith(HOST_PREFIX)

    def overlap_ms(self, other: Interval) -> float:
        """Length of the time both intervals cover (0 when disjoint)."""
        return max(0.0, min(self.end_ms, other.end_ms) - max(self.start_ms, other.start_ms))


#: A selection of intervals: ``None`` (all), a predicate, or a mapping from field name to
#: a value (equality), a set/list/tuple (membership) or a predicate on that field.
Filter = Mapping[str, Any] | Callable[[Interval], bool] | None

_FIELDS = tuple(f.name for f in fields(Interval))


def _field_test(key: str, want: Any) -> Callable[[Interval], bool]:
    if key not in _FIELDS:
        raise ValueError(f"unknown Interval field {key!r} in a filter; fields are {list(_FIELDS)}")
    if callable(want):
        return lambda iv: bool(want(getattr(iv, key)))
    if isinstance(want, (set, frozenset, list, tuple)):
        allowed = frozenset(want)
        return lambda iv: getattr(iv, key) in allowed
    return lambda iv: getattr(iv, key) == want


def matcher(flt: Filter = None, **fields_: Any) -> Callable[[Interval], bool]:
    """Turn a :data:`Filter` (plus field keywords, all ANDed) into a predicate."""
    tests = [_field_test(k, v) for k, v in fields_.items()]
    if isinstance(flt, Mapping):
        tests += [_field_test(k, v) for k, v in flt.items()]
    elif callable(flt):
        tests.append(flt)
    elif flt is not None:
        raise TypeError(
            "a filter is None, a mapping of Interval fields or a callable, "
            f"not {type(flt).__name__}"
        )
    return lambda iv: all(t(iv) for t in tests)


def _union_ms(intervals: Iterable[Interval]) -> float:
    """Time covered by at least one of *intervals* (overlaps counted once)."""
    total, covered = 0.0, float("-inf")  # covered: the end of what is counted so far
    for iv in sorted(intervals, key=lambda i: i.start_ms):
        if iv.end_ms > covered:
            total += iv.end_ms - max(iv.start_ms, covered)
            covered = iv.end_ms
    return total


class Timeline:
    """Intervals of one or more runs, sorted by start time.

    Parameters
    ----------
    intervals : iterable of Interval
        The stages; ``end_ms`` must not precede ``start_ms``.
    dropped : int
        How many recorded stages could not be resolved (e.g. their events never ran
        because the run failed); shown by :meth:`summary`.

    Attributes
    ----------
    intervals : tuple of Interval
        All intervals, sorted by start.
    dropped : int
        As given.
    """

    def __init__(self, intervals: Iterable[Interval] = (), *, dropped: int = 0) -> None:
        items = list(intervals)
        for iv in items:
            if not isinstance(iv, Interval):
                raise TypeError(f"Timeline holds Interval objects, not {type(iv).__name__}")
            if iv.end_ms < iv.start_ms:
                raise ValueError(f"interval ends before it starts: {iv}")
        items.sort(key=lambda i: (i.start_ms, i.end_ms, i.device, i.stream))
        self.intervals: tuple[Interval, ...] = tuple(items)
        self.dropped = int(dropped)

    def __len__(self) -> int:
        return len(self.intervals)

    def __iter__(self) -> Iterator[Interval]:
        return iter(self.intervals)

    def __repr__(self) -> str:
        return (
            f"<Timeline {len(self)} intervals, devices {self.devices()}, {self.duration_ms:.3f} ms>"
        )

    # --- selection ---------------------------------------------------------------

    def select(self, flt: Filter = None, **fields_: Any) -> Timeline:
        """The intervals matching *flt* and the field keywords (``select(name="h2d")``)."""
        return Timeline(filter(matcher(flt, **fields_), self.intervals), dropped=self.dropped)

    def names(self) -> list[str]:
        """Distinct stage names, sorted."""
        return sorted({iv.name for iv in self.intervals})

    def devices(self) -> list[int]:
        """Distinct device ordinals, sorted."""
        return sorted({iv.device for iv in self.intervals})

    def streams(self, device: int | None = None) -> list[str]:
        """Distinct streams (GPU streams first, then host threads), optionally of one device."""
        names = {iv.stream for iv in self.intervals if device is None or iv.device == device}
        return sorted(names, key=lambda n: (n.startswith(HOST_PREFIX), n))

    @property
    def start_ms(self) -> float:
        """Start of the earliest interval (0.0 when empty)."""
        return self.intervals[0].start_ms if self.intervals else 0.0

    @property
    def end_ms(self) -> float:
        """End of the latest interval (0.0 when empty)."""
        return max((iv.end_ms for iv in self.intervals), default=0.0)

    @property
    def duration_ms(self) -> float:
        """From the earliest start to the latest end."""
        return self.end_ms - self.start_ms

    # --- analysis ----------------------------------------------------------------

    def overlaps(
        self, a: Filter, b: Filter, *, min_overlap_ms: float = 0.0
    ) -> list[tuple[Interval, Interval]]:
        """Pairs ``(x, y)``, x matching *a* and y matching *b*, that run at the same time.

        Two intervals overlap when they share more than *min_overlap_ms*; an interval
        is never paired with itself. The result is truthy when any pair exists, so
        ``assert tl.overlaps({"name": "h2d"}, {"name": "kernel"})`` reads naturally.
        """
        xs = self.select(a).intervals
        ys = sorted(self.select(b).intervals, key=lambda i: i.start_ms)
        starts = [y.start_ms for y in ys]
        return [
            (x, y)
            for x in xs
            for y in ys[: bisect.bisect_left(starts, x.end_ms - min_overlap_ms)]
            if y is not x and x.overlap_ms(y) > min_overlap_ms
        ]

    def busy_ms(self, flt: Filter = None, **fields_: Any) -> float:
        """Time covered by at least one matching interval (overlaps counted once)."""
        return _union_ms(self.select(flt, **fields_).intervals)

    def breakdown(self) -> dict[int, dict[str, float]]:
        """Busy milliseconds per device and stage category (``{0: {"h2d": 3.1, ...}}``)."""
        out: dict[int, dict[str, float]] = {}
        for dev in self.devices():
            mine = [iv for iv in self.intervals if iv.device == dev]
            cats = sorted({iv.category for iv in mine})
            out[dev] = {c: _union_ms(iv for iv in mine if iv.category == c) for c in cats}
        return out

    def summary(self) -> str:
        """A few human-readable lines: span and busy time per stage for every device."""
        if not self.intervals:
            return "empty timeline"
        lines = [f"timeline: {len(self)} intervals over {self.duration_ms:.3f} ms"]
        for dev, cats in self.breakdown().items():
            mine = self.select(device=dev)
            parts = ", ".join(f"{c} {ms:.3f} ms" for c, ms in cats.items())
            label = f"device {dev}" if dev >= 0 else "host"
            lines.append(f"  {label}: {mine.start_ms:.3f}..{mine.end_ms:.3f} ms; busy: {parts}")
        if self.dropped:
            lines.append(f"  ({self.dropped} recorded stages could not be resolved)")
        return "\n".join(lines)

    # --- export ------------------------------------------------------------------

    def to_chrome_trace(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Chrome-trace JSON: ``"X"`` events, pid = device, tid = stream or host thread.

        Returns the JSON object and, when *path* is given, writes it there (open the
        file in https://ui.perfetto.dev or ``chrome://tracing``). Times are in
        microseconds, as the format requires.
        """
        events: list[dict[str, Any]] = []
        tids: dict[tuple[int, str], int] = {}
        for dev in self.devices():
            proc = {"ph": "M", "pid": dev}  # metadata: the names and order of the rows
            label = f"GPU {dev}" if dev >= 0 else "host"
            events.append({**proc, "name": "process_name", "args": {"name": label}})
            events.append({**proc, "name": "process_sort_index", "args": {"sort_index": dev}})
            for i, stream in enumerate(self.streams(dev)):
                tids[(dev, stream)] = i
                thread = {**proc, "tid": i}
                events.append({**thread, "name": "thread_name", "args": {"name": stream}})
                events.append({**thread, "name": "thread_sort_index", "args": {"sort_index": i}})
        for iv in self.intervals:  # a complete ("X") event each, in microseconds
            ts, dur = iv.start_ms * 1000.0, iv.duration_ms * 1000.0
            event = {"name": iv.name, "cat": iv.category, "ph": "X", "ts": ts, "dur": dur}
            where = {"pid": iv.device, "tid": tids[(iv.device, iv.stream)]}
            events.append({**event, **where, "args": {"chunk": iv.chunk, "stream": iv.stream}})
        other = {"generator": "ctxkit", "dropped": self.dropped}
        data = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
        if path is not None:
            Path(path).write_text(json.dumps(data), encoding="utf-8")
        return data

    @classmethod
    def from_chrome_trace(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> Timeline:
        """Rebuild a Timeline from :meth:`to_chrome_trace` output (a dict or a file path)."""
        data: Mapping[str, Any] = (
            source if isinstance(source, Mapping) else json.loads(Path(source).read_text("utf-8"))
        )
        if not isinstance(events := data.get("traceEvents"), list):
            raise ValueError("not a Chrome trace: no 'traceEvents' list")
        intervals = [_interval_of(ev) for ev in events if ev.get("ph") == "X"]
        other = data.get("otherData") or {}
        return cls(intervals, dropped=int(other.get("dropped", 0)))

    def to_png(
        self, path: str | os.PathLike[str], *, title: str | None = None, dpi: int = 120
    ) -> None:
        """Draw a Gantt chart (one row per device and stream) into a PNG file.

        Raises
        ------
        ImportError
            matplotlib is not installed (install the ``plot`` extra).
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as exc:
            raise ImportError(
                'Timeline.to_png needs matplotlib (pip install -e ".[plot]" in a checkout, '
                "or pip install matplotlib). Timeline.to_chrome_trace(path) needs nothing "
                "and opens in https://ui.perfetto.dev"
            ) from exc
        rows = [(d, s) for d in self.devices() for s in self.streams(d)]
        cats = sorted({iv.category for iv in self.intervals})
        palette = [
            "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
            "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
        ]  # fmt: skip
        color = {c: palette[i % len(palette)] for i, c in enumerate(cats)}
        fig = Figure(figsize=(12, max(2.0, 0.35 * len(rows) + 1.2)))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for y, (dev, stream) in enumerate(rows):
            row = self.select(device=dev, stream=stream)
            for cat in cats:
                bars = [(iv.start_ms, iv.duration_ms) for iv in row if iv.category == cat]
                if bars:
                    ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color[cat])
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"GPU {d} {s}" if d >= 0 else s for d, s in rows])
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
        ax.set_title(title or f"ctxkit timeline ({self.duration_ms:.2f} ms)")
        legend = [Patch(color=color[c], label=c) for c in cats]
        ax.legend(handles=legend, loc="upper right", fontsize="small")
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=dpi)


def _interval_of(ev: Mapping[str, Any]) -> Interval:
    """The Interval of one complete (``"X"``) Chrome-trace event."""
    args = ev.get("args") or {}
    stream = args.get("stream") or str(ev["tid"])  # to_chrome_trace writes the stream
    start, dur = float(ev["ts"]) / 1000.0, float(ev.get("dur", 0.0)) / 1000.0
    return Interval(ev["name"], int(ev["pid"]), stream, args.get("chunk"), start, start + dur)


class Recorder:
    """Collects host intervals and device event pairs during a run.

    Device times come from events: :meth:`calibrate` ties one completed reference
    event per device to the host clock, and each :meth:`mark` ``(start_event,
    end_event)`` is placed at ``reference host time + elapsed(reference, event)``.

    Parameters
    ----------
    elapsed_ms : callable, optional
        ``elapsed_ms(a, b)`` -> milliseconds from event *a* to event *b*; default
        ``a.elapsed_ms(b)`` (``ctxkit.Event``).
    clock : callable, optional
        Host clock in seconds (default :func:`time.perf_counter`).
    """

    def __init__(
        self,
        elapsed_ms: Callable[[Any, Any], float] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._elapsed = elapsed_ms or (lambda a, b: float(a.elapsed_ms(b)))
        self.clock = clock
        self.t0 = clock()
        self._host: list[Interval] = []
        self._marks: list[tuple[str, int, str, int | None, Any, Any]] = []
        self._refs: dict[int, tuple[Any, float]] = {}
        self._cached: Timeline | None = None

    def ms(self, host_s: float) -> float:
        """A host-clock time in seconds as milliseconds since the recording started."""
        return (host_s - self.t0) * 1000.0

    def host(
        self, name: str, device: int, stream: str, chunk: int | None, start_s: float, end_s: float
    ) -> None:
        """Add a host interval measured with the recorder's clock (seconds)."""
        self._host.append(Interval(name, device, stream, chunk, self.ms(start_s), self.ms(end_s)))
        self._cached = None

    @contextlib.contextmanager
    def host_span(
        self, name: str, device: int, chunk: int | None = None, stream: str | None = None
    ) -> Iterator[None]:
        """Time the ``with`` body as a host interval on the calling thread."""
        label = stream or f"{HOST_PREFIX} {threading.current_thread().name}"
        t = self.clock()
        try:
            yield
        finally:
            self.host(name, device, label, chunk, t, self.clock())

    def calibrate(self, device: int, ref_event: Any, host_s: float) -> None:
        """Record that *ref_event* of *device* completed at host time *host_s* (seconds)."""
        self._refs[device] = (ref_event, host_s)
        self._cached = None

    def calibrated(self, device: int) -> bool:
        """True once *device* has a reference event."""
        return device in self._refs

    def mark(
        self, name: str, device: int, stream: str, chunk: int | None, start: Any, end: Any
    ) -> None:
        """Add a device interval between two recorded events of *device*."""
        self._marks.append((name, device, stream, chunk, start, end))
        self._cached = None

    def timeline(self) -> Timeline:
        """Resolve everything recorded so far (events must have completed)."""
        if (cached := self._cached) is not None:
            return cached
        intervals = list(self._host)
        dropped = 0
        for name, dev, stream, chunk, start, end in list(self._marks):
            try:  # KeyError: the device was never calibrated; or an event never ran
                ref, ref_s = self._refs[dev]
                s = self.ms(ref_s) + self._elapsed(ref, start)
                e = self.ms(ref_s) + self._elapsed(ref, end)
            except Exception:
                dropped += 1
                continue
            intervals.append(Interval(name, dev, stream, chunk, s, max(s, e)))
        self._cached = Timeline(intervals, dropped=dropped)
        return self._cached


# --- NVTX ranges ----------------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


NVTX_DOMAIN = "ctxkit"


NVTX_ENV = "CTXKIT_NVTX"


def _nvtx_available() -> bool:
    try:
        return importlib.util.find_spec("nvtx") is not None
    except (ImportError, ValueError):
        return False


#: The one flag every call checks: the nvtx package is there and not switched off.
_nvtx_enabled: bool = _nvtx_available() and not env_off(NVTX_ENV)


_nvtx_domain: Any = None


#: The event attributes made so far, by (name, color).
_nvtx_attrs: dict[tuple[str, Any], Any] = {}


_nvtx_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_nvtx_lock")


_NULL_RANGE = contextlib.nullcontext()


def nvtx_enabled() -> bool:
    """True when ctxkit emits NVTX ranges (the ``nvtx`` package is installed and neither
    ``CTXKIT_NVTX=0`` nor :func:`set_nvtx_enabled` turned them off)."""
    return _nvtx_enabled


def set_nvtx_enabled(flag: bool = True) -> None:
    """Turn ctxkit's NVTX ranges on or off for the process (the default comes from the
    ``nvtx`` package being installed and ``CTXKIT_NVTX``).

    Functions decorated with :func:`nvtx_annotate` while ranges were off stay undecorated.

    Raises
    ------
    ImportError
        ``flag`` is true and the ``nvtx`` package is not installed.
    """
    global _nvtx_enabled
    if flag and not _nvtx_available():
        raise ImportError(
            'ctxkit NVTX ranges need the nvtx package: pip install "ctxkit-cuda[nvtx]" '
            '(or pip install nvtx; ".[nvtx]" in a ctxkit checkout)'
        )
    _nvtx_enabled = bool(flag)


def _nvtx_attributes(name: str, color: Any) -> tuple[Any, Any]:
    """``(domain, event attributes)`` for *name*/*color*. The ``ctxkit`` domain is made at
    the first use (importing ``nvtx``); ``(None, None)`` when that fails, and ranges are
    off from then on."""
    global _nvtx_domain, _nvtx_enabled
    if (dom := _nvtx_domain) is None:
        with _nvtx_lock:
            try:
                import nvtx

                dom = _nvtx_domain or nvtx.get_domain(NVTX_DOMAIN)
                dom.get_event_attributes  # noqa: B018 - the API ctxkit needs
            except Exception:
                _nvtx_enabled = False
                return None, None
            _nvtx_domain = dom
    if (attrs := _nvtx_attrs.get((name, color))) is None:
        attrs = dom.get_event_attributes(message=name, color=color)
        if len(_nvtx_attrs) < 4096:  # names and colors are few: a bound, not an eviction
            _nvtx_attrs[(name, color)] = attrs
    return dom, attrs


@contextlib.contextmanager
def _nvtx_pushed(name: str, color: Any) -> Iterator[None]:
    dom, attrs = _nvtx_attributes(name, color)
    if dom is None:
        yield
        return
    dom.push_range(attrs)
    try:
        yield
    finally:
        dom.pop_range()


def nvtx_range(name: str, color: Any = None) -> contextlib.AbstractContextManager[None]:
    """``with ctxkit.trace.nvtx_range("h2d", color="green"):`` -- an NVTX range of the calling
    thread around the block (push/pop, domain ``ctxkit``).

    *color* is an NVTX color: a name the ``nvtx`` package knows (``"blue"``,
    ``"green"``, ...) or a 0xAARRGGBB int. Without NVTX: a shared no-op.
    """
    return _nvtx_pushed(name, color) if _nvtx_enabled else _NULL_RANGE


def nvtx_annotate(name: str | None = None, color: Any = None) -> Callable[[F], F]:
    """Decorator: every call of the function is an NVTX range named *name* (default:
    the function's qualified name). Without NVTX the function is returned unchanged."""

    def deco(fn: F) -> F:
        if not _nvtx_enabled:
            return fn
        label: str = name or getattr(fn, "__qualname__", None) or repr(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with nvtx_range(label, color):  # a shared no-op once ranges are switched off
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return deco


def _nvtx_call(method: str, name: str, color: Any) -> Any:
    """``domain.<method>(attributes of name/color)``; ``None`` without NVTX."""
    if not _nvtx_enabled:
        return None
    dom, attrs = _nvtx_attributes(name, color)
    return None if dom is None else getattr(dom, method)(attrs)


def nvtx_start_range(name: str, color: Any = None) -> Any:
    """Start a range that may end in another thread; pass the result to
    :func:`nvtx_end_range`. ``None`` without NVTX."""
    return _nvtx_call("start_range", name, color)


def nvtx_end_range(handle: Any) -> None:
    """End a range of :func:`nvtx_start_range` (``None`` is ignored)."""
    if handle is not None and _nvtx_domain is not None:
        _nvtx_domain.end_range(handle)


def nvtx_mark(name: str, color: Any = None) -> None:
    """An instant NVTX marker (e.g. "kernel compiled")."""
    _nvtx_call("mark", name, color)
