"""The progress bar of ``Pipeline.map(progress=True)`` (ctxkit/pipeline/_run.py):
tqdm when importable, else one line rewritten in place."""

from __future__ import annotations

import io
import sys
import threading
import types

import pytest

from ctxkit.pipeline import run as _run


def test_line_bar_counts_and_closes_once():
    buf = io.StringIO()
    bar = _run.LineBar(3, "copy", stream=buf)
    for _ in range(3):
        bar.update()
    bar.close()
    bar.close()
    assert buf.getvalue().startswith("\rcopy: 0/3 chunks (0%)")
    assert buf.getvalue().endswith("\rcopy: 3/3 chunks (100%)\n")
    assert buf.getvalue().count("\n") == 1


def test_line_bar_is_exact_under_threads(monkeypatch):
    monkeypatch.setattr(_run, "LINE_INTERVAL_S", 1e9)  # draw only the last
    buf = io.StringIO()
    bar = _run.LineBar(800, stream=buf)
    threads = [
        threading.Thread(target=lambda: [bar.update() for _ in range(100)]) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bar.n == 800
    assert buf.getvalue() == "\rctxkit map: 0/800 chunks (0%)\rctxkit map: 800/800 chunks (100%)"


def test_make_bar_prefers_tqdm(monkeypatch):
    made = {}
    mod = types.ModuleType("tqdm")
    mod.tqdm = lambda **kw: made.setdefault("bar", kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tqdm", mod)
    _run.make_bar(7)
    assert made["bar"] == {"total": 7, "desc": "ctxkit map", "unit": "chunk"}


def test_make_bar_falls_back_to_a_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = _run.make_bar(2)
    assert isinstance(bar, _run.LineBar)
    bar.update(2)
    bar.close()
    assert capsys.readouterr().err.endswith("ctxkit map: 2/2 chunks (100%)\n")


@pytest.mark.parametrize("total", [0])
def test_line_bar_of_nothing(total):
    buf = io.StringIO()
    _run.LineBar(total, stream=buf).close()
    assert buf.getvalue().endswith("0/0 chunks (100%)\n")
