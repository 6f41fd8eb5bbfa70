"""Fixtures of the graph tests on the simulated GPU: device 0's registry context and the
graph test kernels loaded in it (a module may override ``ctx``)."""

from __future__ import annotations

import pytest

import ctxkit as ck
from tests.graph.fakekernels import install
from tests.support.fakegpu import FakeGPU


@pytest.fixture
def ctx(gpu: FakeGPU) -> ck.Context:
    return ck.registry.context(0)


@pytest.fixture
def k(gpu: FakeGPU, ctx: ck.Context) -> dict[str, ck.Kernel]:
    with ctx:
        return install(gpu)
