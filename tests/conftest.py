"""Shared test configuration.

* GPU tests (files ``test_*_gpu.py``, marker ``gpu``) skip with a reason only where this
  machine has no NVIDIA driver or GPU at all. On a machine that has one (``/dev/nvidia0``
  or ``nvidia-smi``), a broken binding or a failing ``cuInit`` is a test error, and
  ``-m gpu`` that runs no GPU test fails the session.
* Fake-driver tests (files ``test_*_fake.py`` and tests using the ``fake_driver`` /
  ``gpu`` fixtures, marker ``fake``) never share a process with a real driver: where a
  real GPU is visible they are skipped here and run by ``tests/test_fake_isolation.py`` in
  a child process that sees no device. That holds on a machine whose GPU is present but
  broken too: its GPU tests fail, and the fakes never stand in for it in the same process.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections import Counter
from typing import Any

import pytest

# the fake drivers' fixtures (``gpu``; ``vfake``, ``vctx0``, ``vctx1``), for every test
from tests.support.fakegpu import gpu_fixture  # noqa: F401
from tests.support.fakevmm import vctx0, vctx1, vfake  # noqa: F401

FAKE_FIXTURES = frozenset({"fake_driver", "gpu"})


def _machine_has_nvidia() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def _gpu_count() -> tuple[int, str, str]:
    """``(count, skip reason, error)``: an error only where a GPU should be usable."""
    try:
        import ctxkit

        n = ctxkit.device_count()
    except Exception as exc:
        if _machine_has_nvidia():
            return (
                0,
                "",
                f"this machine has an NVIDIA GPU but ctxkit.device_count() failed: {exc!r}",
            )
        return 0, f"no CUDA driver on this machine ({exc!r})", ""
    if n == 0:
        if _machine_has_nvidia() and os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
            return 0, "", "this machine has an NVIDIA GPU but the driver reports no CUDA device"
        return 0, "no CUDA device/driver on this machine (GPU tests run on a GPU machine)", ""
    return n, "", ""


GPU_COUNT, NO_GPU_REASON, GPU_ERROR = _gpu_count()
#: A machine with an NVIDIA GPU, usable or not: the real driver may be loaded in this process,
#: so fake-driver tests never run here (a broken GPU fails the GPU tests loudly instead).
GPU_MACHINE = GPU_COUNT > 0 or bool(GPU_ERROR)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fake: uses a fake CUDA driver (never beside the real one)")
    # Tests never write into the user's kernel cache: one private directory per session,
    # inherited by every child process the tests start (unless the caller chose one).
    if not os.environ.get("CTXKIT_CACHE_DIR"):
        import tempfile

        os.environ["CTXKIT_CACHE_DIR"] = _SESSION_CACHE[0] = tempfile.mkdtemp(
            prefix="ctxkit-test-cache-"
        )


_SESSION_CACHE: list[str] = [""]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE[0]:
        shutil.rmtree(_SESSION_CACHE[0], ignore_errors=True)
        os.environ.pop("CTXKIT_CACHE_DIR", None)


def _is_fake(item: pytest.Item) -> bool:
    name = os.path.basename(str(item.fspath))
    return name.endswith("_fake.py") or bool(FAKE_FIXTURES & set(getattr(item, "fixturenames", ())))


def _is_gpu(item: pytest.Item) -> bool:
    name = os.path.basename(str(item.fspath))
    return name.endswith("_gpu.py") or item.get_closest_marker("gpu") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_gpu(item):
            item.add_marker(pytest.mark.gpu)
            if GPU_COUNT == 0 and not GPU_ERROR:
                item.add_marker(pytest.mark.skip(reason=NO_GPU_REASON))
        elif _is_fake(item):
            item.add_marker(pytest.mark.fake)
            if GPU_MACHINE:
                item.add_marker(
                    pytest.mark.skip(
                        reason="fake-driver test: a real GPU is visible here, so it runs in a "
                        "child process that sees none (tests/test_fake_isolation.py)"
                    )
                )
        if item.get_closest_marker("multigpu") and 0 < GPU_COUNT < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least two CUDA devices"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left (every test module, fixture and item): the full garbage
    collections a test's teardown asks for (``gc.collect()``, to run its objects' finalizers
    while its fake driver is still in place) and Python's own then walk only what tests
    made since, not the whole collected suite (2.5x less time per collection)."""
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Skipped tests as one line per reason (how many, and the reason), not one per test."""
    reasons: Counter[str] = Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(rep, "longrepr", None)
        reason = (
            longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        )
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skipped, by reason", sep="-")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:5d}  {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    markexpr = session.config.getoption("markexpr", "") or ""
    if "gpu" not in markexpr or "not gpu" in markexpr or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    ran = 0
    if reporter is not None:
        ran = sum(
            1
            for key in ("passed", "failed", "error")
            for rep in reporter.stats.get(key, [])
            if getattr(rep, "when", "call") == "call" and "gpu" in getattr(rep, "keywords", {})
        )
    if ran == 0:
        if reporter is not None:
            reporter.write_line(
                f"-m {markexpr!r} ran no GPU test ({NO_GPU_REASON or GPU_ERROR}): failing",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _gpu_test_guard(request: pytest.FixtureRequest):
    """GPU tests: fail (not skip) when a present GPU is unusable, and leave this thread's
    context stack as they found it."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    if GPU_ERROR:
        pytest.fail(GPU_ERROR)
    from ctxkit.context import thread_state

    st = thread_state()
    before = len(st.stack)
    yield
    assert len(st.stack) == before, f"test leaked ctxkit pushes: {st.stack[before:]}"


@pytest.fixture
def ctx0():
    import ctxkit as ck

    return ck.registry.context(0)


@pytest.fixture
def ctx1():
    import ctxkit as ck

    if ck.device_count() < 2:
        pytest.skip("needs at least two CUDA devices")
    return ck.registry.context(1)


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch):
    """Replace the driver with tests/support/fakedriver.FakeDriver (2 fake devices) for one
    test, in every ctxkit module."""

    from ctxkit import _driver, context, device

    from .support.fakedriver import FakeDriver, fresh_registry, swap_driver

    # earlier tests' garbage (buffers, streams) is finalized against their own driver, not
    # this fake, whose call counts the test reads
    gc.collect()
    fake = FakeDriver(ndev=2)
    swap_driver(monkeypatch, fake)
    monkeypatch.setattr(_driver, "_init_pid", None)
    monkeypatch.setattr(_driver, "_no_device", False)
    monkeypatch.setattr(_driver, "_parent_initialized_pid", None)
    monkeypatch.setattr(device.Device, "_instances", {})
    monkeypatch.setattr(context.Context, "_primaries", {})
    monkeypatch.setattr(context.Context, "_known", type(context.Context._known)())
    fresh_registry(monkeypatch)
    st = context.thread_state()
    saved = (st.top, list(st.stack), st.probe)
    st.top, st.stack[:], st.probe = None, [], True
    yield fake
    gc.collect()
    st.top, st.stack[:], st.probe = saved
