"""NVTX ranges (ctxkit/trace.py): no-ops without the nvtx package or with CTXKIT_NVTX=0,
ranges in the ``ctxkit`` domain with it (a fake module and, where installed, the real
one), the package imported at the first range only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

import ctxkit.trace as cn

REPO = Path(__file__).resolve().parents[2]


class FakeDomain:
    """Records what ctxkit asks of an ``nvtx`` domain."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.attr_calls = 0

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        self.attr_calls += 1
        return (message, color)

    def push_range(self, attributes):
        self.log.append(("push", attributes, threading.get_ident()))

    def pop_range(self):
        self.log.append(("pop", threading.get_ident()))

    def start_range(self, attributes):
        self.log.append(("start", attributes))
        return 1000 + len(self.log)

    def end_range(self, range_id):
        self.log.append(("end", range_id, threading.get_ident()))

    def mark(self, attributes):
        self.log.append(("mark", attributes))


@pytest.fixture
def fresh(monkeypatch):
    """ctxkit.trace's NVTX half as if just imported: no domain loaded yet, no cached attributes."""
    monkeypatch.setattr(cn, "_nvtx_domain", None)
    monkeypatch.setattr(cn, "_nvtx_attrs", {})
    monkeypatch.setattr(cn, "_nvtx_enabled", cn._nvtx_enabled)


@pytest.fixture
def fake_nvtx(monkeypatch, fresh) -> FakeDomain:
    dom = FakeDomain()
    mod = types.ModuleType("nvtx")
    domains = {}

    def get_domain(name):
        domains[name] = dom
        return dom

    mod.get_domain = get_domain
    mod.domains = domains
    monkeypatch.setitem(sys.modules, "nvtx", mod)
    monkeypatch.setattr(cn, "_nvtx_available", lambda: True)
    monkeypatch.setattr(cn, "_nvtx_enabled", True)
    return dom


def test_without_nvtx_everything_is_a_shared_noop(fake_nvtx, monkeypatch):
    monkeypatch.setattr(cn, "_nvtx_enabled", False)
    assert not cn.nvtx_enabled()
    r = cn.nvtx_range("stage", color="green")
    assert r is cn.nvtx_range("other") is cn._NULL_RANGE  # nothing allocated per call
    with r, cn.nvtx_range("nested"):
        pass

    def work(x):
        return x + 1

    assert cn.nvtx_annotate("work")(work) is work  # not even wrapped
    assert cn.nvtx_start_range("chunk") is None
    cn.nvtx_end_range(None)
    cn.nvtx_mark("compiled")
    assert fake_nvtx.log == [] and fake_nvtx.attr_calls == 0
    assert sys.modules["nvtx"].domains == {}  # the domain was never asked for


def test_ranges_push_and_pop_in_the_ctxkit_domain(fake_nvtx):
    me = threading.get_ident()
    with cn.nvtx_range("h2d", color="green"):
        with cn.nvtx_range("kernel"):
            pass
    assert fake_nvtx.log == [
        ("push", ("h2d", "green"), me),
        ("push", ("kernel", None), me),
        ("pop", me),
        ("pop", me),
    ]
    assert list(sys.modules["nvtx"].domains) == [cn.NVTX_DOMAIN] == ["ctxkit"]


def test_a_range_pops_when_its_block_raises(fake_nvtx):
    with pytest.raises(KeyError):
        with cn.nvtx_range("d2h"):
            raise KeyError("boom")
    assert [e[0] for e in fake_nvtx.log] == ["push", "pop"]


def test_event_attributes_are_made_once_per_name_and_color(fake_nvtx):
    for _ in range(5):
        with cn.nvtx_range("fill", color="blue"):
            pass
    with cn.nvtx_range("fill", color="red"):
        pass
    assert fake_nvtx.attr_calls == 2


def test_annotate_wraps_each_call_in_a_range(fake_nvtx, monkeypatch):
    @cn.nvtx_annotate()
    def compile_kernel(src, *, arch):
        return f"{src}@{arch}"

    @cn.nvtx_annotate("launch", color="red")
    def launch():
        return 7

    assert compile_kernel("k.cu", arch="sm_90") == "k.cu@sm_90" and launch() == 7
    assert compile_kernel.__name__ == "compile_kernel" and compile_kernel.__wrapped__
    pushes = [e[1] for e in fake_nvtx.log if e[0] == "push"]
    assert pushes == [
        ("test_annotate_wraps_each_call_in_a_range.<locals>.compile_kernel", None),
        ("launch", "red"),
    ]
    monkeypatch.setattr(cn, "_nvtx_enabled", False)  # switched off later: plain calls
    assert launch() == 7 and len(fake_nvtx.log) == 4


def test_a_range_may_end_in_another_thread(fake_nvtx):
    handle = cn.nvtx_start_range("chunk 3", color="purple")
    t = threading.Thread(target=cn.nvtx_end_range, args=(handle,))
    t.start()
    t.join()
    assert fake_nvtx.log[0] == ("start", ("chunk 3", "purple"))
    assert fake_nvtx.log[1][:2] == ("end", handle) and fake_nvtx.log[1][2] != threading.get_ident()
    cn.nvtx_mark("compiled", color="yellow")
    assert fake_nvtx.log[2] == ("mark", ("compiled", "yellow"))


def test_a_broken_nvtx_package_turns_ranges_off(monkeypatch, fresh):
    mod = types.ModuleType("nvtx")

    def get_domain(name):
        raise RuntimeError("no NVTX library")

    mod.get_domain = get_domain
    monkeypatch.setitem(sys.modules, "nvtx", mod)
    monkeypatch.setattr(cn, "_nvtx_enabled", True)
    with cn.nvtx_range("h2d"):
        pass
    assert not cn.nvtx_enabled() and cn.nvtx_range("next") is cn._NULL_RANGE


def test_set_enabled(fake_nvtx, monkeypatch):
    cn.set_nvtx_enabled(False)
    assert not cn.nvtx_enabled() and cn.nvtx_range("x") is cn._NULL_RANGE
    cn.set_nvtx_enabled(True)
    assert cn.nvtx_enabled()
    monkeypatch.setattr(cn, "_nvtx_available", lambda: False)
    with pytest.raises(ImportError, match=r'pip install "ctxkit-cuda\[nvtx\]"'):
        cn.set_nvtx_enabled()
    cn.set_nvtx_enabled(False)  # turning off always works


def _run(code: str, tmp_path: Path, **env: str) -> list[str]:
    pkg = tmp_path / "site" / "nvtx"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            class _Domain:
                def get_event_attributes(self, message=None, color=None, **kw):
                    return message
                def push_range(self, attributes):
                    print("push", attributes)
                def pop_range(self):
                    print("pop")
            def get_domain(name):
                return _Domain()
            """
        )
    )
    e = {k: v for k, v in os.environ.items() if k != cn.NVTX_ENV}
    e["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), str(REPO)])
    e.update(env)
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=e,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


CODE = """
    import sys
    import ctxkit
    print("nvtx" in sys.modules, "ctxkit.trace" in sys.modules)
    import ctxkit.trace as n
    print(n.nvtx_enabled(), "nvtx" in sys.modules)
    with n.nvtx_range("stage"):
        pass
    print("nvtx" in sys.modules)
"""


def test_the_package_is_imported_at_the_first_range_only(tmp_path):
    out = _run(CODE, tmp_path)
    assert out == ["False", "False", "True", "False", "push", "stage", "pop", "True"]


def test_ctxkit_nvtx_0_turns_ranges_off_although_nvtx_is_installed(tmp_path):
    out = _run(CODE, tmp_path, CTXKIT_NVTX="0")
    assert out == ["False", "False", "False", "False", "False"]


def test_with_the_real_nvtx_package(fresh, monkeypatch):
    pytest.importorskip("nvtx")
    monkeypatch.setattr(cn, "_nvtx_enabled", True)
    with cn.nvtx_range("ctxkit test", color="green"):
        pass

    @cn.nvtx_annotate()
    def f():
        return 3

    assert f() == 3
    cn.nvtx_end_range(cn.nvtx_start_range("across threads", color="blue"))
    cn.nvtx_mark("marker")
    assert cn.nvtx_enabled() and cn._nvtx_domain is not None
