"""Every process test leaves no child process and no shared-memory block behind."""

from __future__ import annotations

import multiprocessing

import pytest

from tests.procs.proctools import own_blocks


@pytest.fixture(autouse=True)
def nothing_left_behind():
    before = own_blocks()
    yield
    assert multiprocessing.active_children() == []
    assert own_blocks() - before == set()
