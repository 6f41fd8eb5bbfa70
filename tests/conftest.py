"""Shared test configuration: GPU tests skip with a reason where no device is visible."""

from __future__ import annotations

import os

import pytest


def _gpu_count() -> tuple[int, str]:
    try:
        import ctxkit

        n = ctxkit.device_count()
    except Exception as exc:  # a broken install must not hide the CPU tests
        return 0, f"ctxkit.device_count() failed: {exc!r}"
    if n == 0:
        return 0, "no CUDA device/driver on this machine (GPU tests run on the device machine)"
    return n, ""


GPU_COUNT, NO_GPU_REASON = _gpu_count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/") or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)
            if GPU_COUNT == 0:
                item.add_marker(pytest.mark.skip(reason=NO_GPU_REASON))
        if item.get_closest_marker("multigpu") and 0 < GPU_COUNT < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least two CUDA devices"))


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch):
    """Replace the driver with tests/fakedriver.FakeDriver (2 fake devices) for one test."""
    from ctxkit import _driver, context, device
    from ctxkit.registry import ContextRegistry

    from .fakedriver import FakeDriver

    fake = FakeDriver(ndev=2)
    for mod in (_driver, context, device):
        monkeypatch.setattr(mod, "drv", fake)
    monkeypatch.setattr(_driver, "_init_pid", None)
    monkeypatch.setattr(_driver, "_no_device", False)
    monkeypatch.setattr(_driver, "_parent_initialized_pid", None)
    monkeypatch.setattr(device.Device, "_instances", {})
    monkeypatch.setattr(context.Context, "_primaries", {})
    reg = ContextRegistry()
    import sys

    import ctxkit
    import ctxkit.registry as registry_mod  # noqa: F401  (module object via sys.modules)

    monkeypatch.setattr(sys.modules["ctxkit.registry"], "registry", reg)
    monkeypatch.setattr(ctxkit, "registry", reg)
    st = context.thread_state()
    saved = (st.top, list(st.stack))
    st.top, st.stack[:] = None, []
    yield fake
    st.top, st.stack[:] = saved[0], saved[1]
