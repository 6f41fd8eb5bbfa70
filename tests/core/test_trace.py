"""Timeline, Chrome-trace export and the event Recorder, built from plain numbers."""

from __future__ import annotations

import json
import sys

import pytest

from ctxkit.trace import Interval, Recorder, Timeline, matcher


def iv(name, device, stream, chunk, start, end):
    return Interval(name, device, stream, chunk, float(start), float(end))


@pytest.fixture
def tl() -> Timeline:
    return Timeline(
        [
            iv("kernel", 0, "stream 0", 0, 2, 5),
            iv("h2d", 0, "stream 0", 0, 0, 2),
            iv("h2d", 0, "stream 1", 1, 2, 4),
            iv("kernel", 0, "stream 1", 1, 5, 6),
            iv("fill", 0, "host ctxkit-stage_0", 1, 0.5, 1.5),
            iv("h2d", 1, "stream 0", 2, 1, 3),
            iv("stage:sum", 1, "stage", None, 3, 7),
        ]
    )


def test_interval_properties():
    a = iv("stage:sum", 0, "host t", 3, 1.0, 4.0)
    assert a.duration_ms == 3.0
    assert a.category == "stage"
    assert a.is_host
    assert not iv("h2d", 0, "stream 0", 0, 0, 1).is_host
    assert a.overlap_ms(iv("x", 0, "s", 0, 3.5, 9)) == 0.5
    assert a.overlap_ms(iv("x", 0, "s", 0, 4.0, 9)) == 0.0


def test_timeline_sorted_and_basic_queries(tl):
    starts = [i.start_ms for i in tl]
    assert starts == sorted(starts)
    assert len(tl) == 7
    assert tl.names() == ["fill", "h2d", "kernel", "stage:sum"]
    assert tl.devices() == [0, 1]
    assert tl.streams(0) == ["stream 0", "stream 1", "host ctxkit-stage_0"]
    assert tl.start_ms == 0.0 and tl.end_ms == 7.0 and tl.duration_ms == 7.0
    assert "7 intervals" in repr(tl)


def test_empty_timeline():
    empty = Timeline()
    assert len(empty) == 0
    assert empty.duration_ms == 0.0
    assert empty.summary() == "empty timeline"
    assert not empty.overlaps(None, None)
    assert empty.to_chrome_trace()["traceEvents"] == []


def test_timeline_rejects_bad_intervals():
    with pytest.raises(ValueError, match="ends before it starts"):
        Timeline([iv("h2d", 0, "s", 0, 2, 1)])
    with pytest.raises(TypeError, match="Interval"):
        Timeline([("h2d", 0, "s", 0, 1, 2)])  # type: ignore[list-item]


def test_select_by_fields_sets_and_predicates(tl):
    assert len(tl.select(name="h2d")) == 3
    assert len(tl.select(name="h2d", device=0)) == 2
    assert len(tl.select({"name": {"h2d", "kernel"}, "device": 0})) == 4
    assert len(tl.select({"name": lambda n: n.startswith("stage")})) == 1
    assert len(tl.select(lambda i: i.duration_ms > 2.5)) == 2
    assert len(tl.select(chunk=None)) == 1


def test_filter_errors():
    with pytest.raises(ValueError, match="unknown Interval field 'colour'"):
        matcher({"colour": "red"})
    with pytest.raises(TypeError, match="filter"):
        matcher(42)  # type: ignore[arg-type]


def test_overlaps_pairs(tl):
    pairs = tl.overlaps({"name": "h2d", "chunk": 1}, {"name": "kernel", "chunk": 0})
    assert len(pairs) == 1
    a, b = pairs[0]
    assert (a.name, a.chunk, b.name, b.chunk) == ("h2d", 1, "kernel", 0)
    # Touching intervals do not overlap; a minimum overlap can be demanded.
    assert not tl.overlaps({"name": "h2d", "chunk": 0}, {"name": "kernel", "chunk": 0})
    assert tl.overlaps({"device": 0}, {"device": 1})
    assert not tl.overlaps({"name": "fill"}, {"device": 1}, min_overlap_ms=0.5)
    assert tl.overlaps({"name": "fill"}, {"device": 1}, min_overlap_ms=0.4)


def test_overlaps_never_pairs_an_interval_with_itself():
    one = Timeline([iv("h2d", 0, "s", 0, 0, 1)])
    assert one.overlaps({"name": "h2d"}, {"name": "h2d"}) == []


def test_busy_and_breakdown(tl):
    assert tl.busy_ms(name="h2d", device=0) == pytest.approx(4.0)
    assert tl.busy_ms(device=0) == pytest.approx(6.0)
    bd = tl.breakdown()
    assert bd[0] == pytest.approx({"fill": 1.0, "h2d": 4.0, "kernel": 4.0})
    assert bd[1] == pytest.approx({"h2d": 2.0, "stage": 4.0})
    text = tl.summary()
    assert "device 0" in text and "device 1" in text and "kernel 4.000 ms" in text


def test_summary_reports_dropped():
    t = Timeline([iv("h2d", 0, "s", 0, 0, 1)], dropped=3)
    assert "3 recorded stages could not be resolved" in t.summary()


def test_chrome_trace_format(tl, tmp_path):
    path = tmp_path / "trace.json"
    data = tl.to_chrome_trace(path)
    assert json.loads(path.read_text()) == data
    assert data["displayTimeUnit"] == "ms"
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl)
    for e in xs:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["dur"] >= 0
    first = min(xs, key=lambda e: e["ts"])
    assert first["name"] == "h2d" and first["ts"] == 0.0 and first["dur"] == 2000.0
    meta = [e for e in data["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {0: "GPU 0", 1: "GPU 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads[(0, 0)] == "stream 0"
    assert threads[(0, 2)] == "host ctxkit-stage_0"
    # Every X event's (pid, tid) is named.
    assert {(e["pid"], e["tid"]) for e in xs} <= set(threads)


def test_chrome_trace_round_trip(tl, tmp_path):
    path = tmp_path / "t.json"
    tl.to_chrome_trace(path)
    back = Timeline.from_chrome_trace(path)
    assert back.intervals == tl.intervals
    assert Timeline.from_chrome_trace(tl.to_chrome_trace()).intervals == tl.intervals


def test_from_chrome_trace_rejects_other_json():
    with pytest.raises(ValueError, match="traceEvents"):
        Timeline.from_chrome_trace({"events": []})


def test_host_device_minus_one_is_named_host():
    t = Timeline([iv("fill", -1, "host main", None, 0, 1)])
    meta = t.to_chrome_trace()["traceEvents"]
    assert {"name": "process_name", "ph": "M", "pid": -1, "args": {"name": "host"}} in meta


def test_to_png_without_matplotlib(tl, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"\.\[plot\]"):
        tl.to_png(tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_to_png_with_matplotlib(tl, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    tl.to_png(path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class FakeEvent:
    def __init__(self, t_ms: float | None):
        self.t_ms = t_ms


def fake_elapsed(a: FakeEvent, b: FakeEvent) -> float:
    if a.t_ms is None or b.t_ms is None:
        raise RuntimeError("event never recorded")
    return b.t_ms - a.t_ms


def test_recorder_maps_device_events_onto_host_clock():
    now = [100.0]
    rec = Recorder(elapsed_ms=fake_elapsed, clock=lambda: now[0])
    # Device 0's reference event completed at host time 100.010 s, device time 50 ms;
    # device 1's at 100.020 s, device time 7 ms (each device has its own clock).
    rec.calibrate(0, FakeEvent(50.0), 100.010)
    rec.calibrate(1, FakeEvent(7.0), 100.020)
    rec.mark("h2d", 0, "stream 0", 0, FakeEvent(51.0), FakeEvent(53.0))
    rec.mark("kernel", 1, "stream 0", 1, FakeEvent(7.5), FakeEvent(8.0))
    rec.host("fill", 0, "host t", 0, 100.001, 100.002)
    tl = rec.timeline()
    got = {(i.name, i.device): (i.start_ms, i.end_ms) for i in tl}
    assert got[("h2d", 0)] == pytest.approx((11.0, 13.0))
    assert got[("kernel", 1)] == pytest.approx((20.5, 21.0))
    assert got[("fill", 0)] == pytest.approx((1.0, 2.0))
    assert tl.dropped == 0
    assert rec.timeline() is tl  # cached until something new is recorded
    rec.host("drain", 0, "host t", 0, 100.003, 100.004)
    assert len(rec.timeline()) == 4


def test_recorder_drops_unresolvable_marks():
    rec = Recorder(elapsed_ms=fake_elapsed, clock=lambda: 0.0)
    rec.calibrate(0, FakeEvent(0.0), 0.0)
    rec.mark("h2d", 0, "stream 0", 0, FakeEvent(1.0), FakeEvent(None))
    rec.mark("h2d", 5, "stream 0", 0, FakeEvent(1.0), FakeEvent(2.0))  # never calibrated
    tl = rec.timeline()
    assert len(tl) == 0 and tl.dropped == 2
    assert rec.calibrated(0) and not rec.calibrated(5)


def test_recorder_host_span_uses_thread_name():
    ticks = iter([1.0, 1.0, 1.5])
    rec = Recorder(clock=lambda: next(ticks))
    with rec.host_span("fill", 0, chunk=4):
        pass
    (only,) = rec.timeline().intervals
    assert only.name == "fill" and only.chunk == 4
    assert only.stream.startswith("host ")
    assert (only.start_ms, only.end_ms) == (0.0, 500.0)


def test_recorder_default_elapsed_uses_event_method():
    class Ev:
        def __init__(self, t):
            self.t = t

        def elapsed_ms(self, end):
            return end.t - self.t

    rec = Recorder(clock=lambda: 0.0)
    rec.calibrate(0, Ev(0.0), 0.0)
    rec.mark("k", 0, "stream 0", None, Ev(1.0), Ev(3.0))
    assert rec.timeline().intervals[0].end_ms == 3.0
