"""``ctxkit info | head -1``: a reader that goes away ends the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxkit.cli import EXIT_BROKEN_PIPE

REPO = Path(__file__).resolve().parents[2]


def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run ``ctxkit *args`` with stdout a pipe whose read end is already closed."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        return subprocess.run(
            [sys.executable, "-m", "ctxkit", *args],
            cwd=REPO,
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["info"], ["bench", "--list"]], ids=["info", "bench"])
def test_closed_pipe_ends_quietly_with_the_sigpipe_status(args: list[str]) -> None:
    proc = _run_into_closed_pipe(*args)
    err = proc.stderr.decode(errors="replace")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == ""
    assert proc.returncode == EXIT_BROKEN_PIPE == 141
