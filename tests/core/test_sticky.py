"""What a sticky error tells the user (no driver needed): the fault poisons the whole
process on current drivers (GPU run: driver 580 / CUDA 13.0), so the fix is a process per
device and a restart; tests/core/test_sticky_gpu.py checks the behaviour itself."""

from __future__ import annotations

import pytest

import ctxkit as ck
from ctxkit import errors


@pytest.mark.parametrize("code", sorted(errors.STICKY_CODES))
def test_sticky_errors_say_the_fault_is_process_wide_and_what_to_do(code: int) -> None:
    exc = errors.from_result(code, "cuCtxSynchronize")
    assert type(exc) is ck.ContextPoisonedError and exc.code == code
    msg = " ".join(str(exc).split())
    for phrase in (
        "poisoned the context",
        "(observed: 580 / CUDA 13.0) every other context in the process, on every device, "
        "fails too",
        "Restart the process (or the ctxkit.procs worker)",
        "run device work in separate processes (ctxkit.procs.run_per_device / DevicePool)",
        "compute-sanitizer",
    ):
        assert phrase in msg, (phrase, msg)
    assert "destroy it" not in msg  # a new context in the same process does not help


def test_other_errors_do_not_get_the_sticky_hint() -> None:
    assert "separate processes" not in str(errors.from_result(2, "cuMemAlloc"))


def test_context_poisoned_error_documents_the_process_recipe() -> None:
    doc = " ".join((ck.ContextPoisonedError.__doc__ or "").split())
    for phrase in (
        "every later CUDA call in the process fails",
        "An owned context does not isolate a fault; a process does",
        "ctxkit.procs.run_per_device",
        "ctxkit.procs.DevicePool",
        "restart the process (or the worker)",
    ):
        assert phrase in doc, phrase
