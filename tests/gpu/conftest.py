"""Fixtures for tests that need a CUDA device."""

from __future__ import annotations

import pytest

import ctxkit as ck
from ctxkit.context import thread_state


@pytest.fixture
def ctx0() -> ck.Context:
    return ck.registry.context(0)


@pytest.fixture
def ctx1() -> ck.Context:
    if ck.device_count() < 2:
        pytest.skip("needs at least two CUDA devices")
    return ck.registry.context(1)


@pytest.fixture(autouse=True)
def _no_leaked_pushes():
    """Every GPU test must leave this thread's context stack as it found it."""
    st = thread_state()
    before = len(st.stack)
    yield
    assert len(st.stack) == before, f"test leaked ctxkit pushes: {st.stack[before:]}"
