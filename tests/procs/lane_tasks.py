"""What the workers and children of tests/procs/test_lanes_fake.py run (module level, so
pickled by reference: each process imports this module, which imports no pytest).

Without a GPU (``_bind=False``) a lane's process binds no context; it only knows the
:class:`~ctxkit.procs.spawn.LaneSpec` its parent sent, which these functions report."""

from __future__ import annotations

import os
from typing import Any

import ctxkit.procs as procs
from ctxkit.procs import spawn
from tests.procs.proctools import gate_open


def lane_and_pid(gate: str | None = None) -> tuple[Any, int, int | None]:
    """This worker's lane, its pid and ``worker_device()`` (after *gate* opens)."""
    if gate is not None:
        gate_open(gate)
    return spawn.current_lane, os.getpid(), procs.worker_device()


def lane_fails() -> None:
    raise ValueError(f"refused in {spawn.current_lane}")


def lane_env_or_fail(ordinal: int, fail_sm_count: int) -> tuple[Any, int, str | None]:
    """A ``run_per_device`` child's lane, ordinal and ``CUDA_VISIBLE_DEVICES``; raises in
    the green lane of *fail_sm_count* SMs."""
    lane = spawn.current_lane
    if lane is not None and lane.sm_count == fail_sm_count:
        raise ValueError(f"no room in {lane}")
    return lane, ordinal, os.environ.get("CUDA_VISIBLE_DEVICES")
