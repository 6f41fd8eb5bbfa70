"""Every process test leaves no child process (but the workers of a pool the tests of a
module share) and no shared-memory block behind."""

from __future__ import annotations

import pytest

from tests.procs.proctools import SHARED_POOLS, own_blocks, stray_children, wait_for


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = own_blocks()
    yield
    if SHARED_POOLS:  # a shared pool may be replacing a worker a test stopped
        wait_for(lambda: not stray_children(), 10, "no child but the shared pool's workers")
    assert stray_children() == []
    assert own_blocks() - before == set()
