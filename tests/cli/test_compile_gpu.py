"""``ctxkit compile`` on a GPU machine: no --arch means this GPU, and a template kernel
compiled with --name-expression loads under the mangled name the command printed."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from tests.cli.test_compile import compile_cli


def test_template_cubin_loads_by_the_printed_name(
    ctx0: ck.Context,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "t.cu").write_text(C.kernel_source("templates.cu"))
    with ctx0:
        assert compile_cli("t.cu", "--name-expression", "fill_const<int, 7>") == 0
    out = capsys.readouterr().out
    assert f"(cubin, {ctx0.device.arch}," in out
    m = re.search(r"^  fill_const<int, 7> -> (\S+)$", out, re.MULTILINE)
    assert m, out
    n = 1_000
    with ctx0:
        k = ck.Module.load(tmp_path / "t.cubin").function(m.group(1))
        buf = ck.DeviceBuffer(n * 4)
        k.launch(4, 128, buf, n)
        got = buf.copy_to_host(np.empty(n, dtype=np.int32))
        ctx0.synchronize()
    assert (got == 7).all()
