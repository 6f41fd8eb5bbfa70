"""Fake-driver tests on a machine with a real GPU: run them in a child process that sees
no device, so a fake object's finalizer can never reach the real driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import GPU_MACHINE

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    not GPU_MACHINE, reason="no real GPU here: fake-driver tests ran in this process"
)
def test_fake_driver_tests_pass_in_their_own_process(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CTXKIT_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "fake",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    out = proc.stdout + proc.stderr
    tail = out[-12000:]
    assert proc.returncode == 0, f"fake-driver tests failed in their own process:\n{tail}"
    assert " passed" in proc.stdout, tail
