"""``ck.is_pinned`` on a machine without a driver: ordinary memory is simply not pinned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

IS_PINNED = """
import numpy as np
import ctxkit as ck
print(ck.is_pinned(np.zeros(10)), ck.is_pinned(bytearray(64)), ck.is_pinned(np.zeros(0)))
"""


def test_is_pinned_without_a_driver_is_false(tmp_path: Path) -> None:
    # A plain package named `cuda` hides cuda.bindings: no driver can be reached, as on a
    # machine without one, also where this test runs on a GPU machine.
    (tmp_path / "cuda").mkdir()
    (tmp_path / "cuda" / "__init__.py").write_text("")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), str(REPO)]))
    proc = subprocess.run(
        [sys.executable, "-c", IS_PINNED],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "False"]
