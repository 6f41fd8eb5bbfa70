"""ctxkit.memory.copy_streaming: the same result as np.copyto for every layout, non-temporal
stores where they apply, np.copyto (and its errors) everywhere else, and a switch."""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ctxkit.memory import (
    StreamingCopyInfo,
    copy_streaming,
    set_streaming_copy,
    streamcopy,
    streaming_copy_info,
)
from ctxkit.memory.streamcopy import MIN_STREAMING_BYTES

REPO = Path(__file__).resolve().parents[2]
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
try:
    import llvmlite  # noqa: F401

    HAVE_LLVMLITE = True
except ImportError:
    HAVE_LLVMLITE = False

needs_loop = pytest.mark.skipif(
    not (X86_64 and HAVE_LLVMLITE), reason="the streaming loop needs llvmlite on x86-64"
)


@pytest.fixture(autouse=True)
def streaming_on():
    previous = set_streaming_copy(True)
    yield
    set_streaming_copy(previous)


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize(
    "n", [0, 1, 255, MIN_STREAMING_BYTES - 1, MIN_STREAMING_BYTES, MIN_STREAMING_BYTES + 3]
)
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (1, 0), (0, 5), (13, 63), (64, 64)])
def test_every_size_and_alignment_copies_every_byte(n: int, src_off: int, dst_off: int) -> None:
    backing = _bytes(n + 128, seed=n)
    src = backing[src_off : src_off + n]
    out = np.zeros(n + 128, np.uint8)
    dst = out[dst_off : dst_off + n]
    copy_streaming(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert not out[:dst_off].any() and not out[dst_off + n :].any(), "wrote outside dst"


def test_multidimensional_float_arrays_copy_like_numpy() -> None:
    src = np.random.default_rng(1).random((513, 1031), dtype=np.float32)
    dst = np.empty_like(src)
    copy_streaming(dst, src)
    np.testing.assert_array_equal(dst, src)


def test_threads_copy_disjoint_pieces_in_parallel() -> None:
    src = _bytes(64 << 20, seed=2)
    dst = np.zeros_like(src)
    bounds = np.linspace(0, src.size, 9).astype(int) // 64 * 64
    bounds[-1] = src.size
    threads = [
        threading.Thread(target=copy_streaming, args=(dst[a:b], src[a:b]))
        for a, b in itertools.pairwise(bounds)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize(
    "case",
    ["strided_src", "strided_dst", "cast", "broadcast", "overlap", "fortran"],
)
def test_layouts_it_does_not_stream_give_numpys_result(case: str) -> None:
    n = MIN_STREAMING_BYTES * 2
    base = np.random.default_rng(3).random(n // 4 * 2, dtype=np.float32)
    if case == "strided_src":
        src, dst = base[::2], np.empty(n // 4, np.float32)
    elif case == "strided_dst":
        src, dst = base[: n // 4], np.empty(n // 2, np.float32)[::2]
    elif case == "cast":
        src, dst = base[: n // 4], np.empty(n // 4, np.float64)
    elif case == "broadcast":
        src, dst = base[:1024], np.empty((n // 4096, 1024), np.float32)
    elif case == "overlap":
        src, dst = base[: n // 4], base[7 : 7 + n // 4]
    else:
        src = np.asfortranarray(base[: n // 4].reshape(256, -1))
        dst = np.empty_like(src)
    expected = dst.copy()
    np.copyto(expected, src.copy())
    copy_streaming(dst, src)
    np.testing.assert_array_equal(dst, expected)


def test_object_arrays_are_never_copied_as_bytes() -> None:
    src = np.array([object() for _ in range(MIN_STREAMING_BYTES // 8 + 1)], dtype=object)
    dst = np.empty_like(src)
    copy_streaming(dst, src)
    assert all(a is b for a, b in zip(dst, src))


def test_a_read_only_destination_raises_numpys_error() -> None:
    dst = np.zeros(MIN_STREAMING_BYTES, np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_streaming(dst, _bytes(MIN_STREAMING_BYTES))


def test_switching_off_reports_it_and_still_copies() -> None:
    assert set_streaming_copy(False) is True
    info = streaming_copy_info()
    assert isinstance(info, StreamingCopyInfo)
    assert not info.enabled and not info.active
    assert info.reason == "np.copyto (switched off)"
    src = _bytes(MIN_STREAMING_BYTES + 7, seed=4)
    dst = np.empty_like(src)
    copy_streaming(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert set_streaming_copy(True) is False


@needs_loop
def test_on_x86_64_with_llvmlite_the_loop_is_built() -> None:
    info = streaming_copy_info()
    assert info.available and info.active, info.reason
    assert info.reason.startswith("non-temporal stores (llvmlite")


@needs_loop
def test_the_loop_compiles_to_non_temporal_stores_and_a_fence() -> None:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(cpu="x86-64", opt=3)
    asm = tm.emit_assembly(llvm.parse_assembly(streamcopy._ir(llvm.llvm_version_info[0] >= 15)))
    assert "movnt" in asm
    assert "sfence" in asm


def _run(code: str, env: dict[str, str], path: tuple[str, ...] = ()) -> str:
    e = {**os.environ, **env}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [*path, str(REPO), e.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


CHECK = (
    "import numpy as np; from ctxkit.memory import copy_streaming, streaming_copy_info as i;"
    "s = np.arange(1 << 20, dtype=np.uint8); d = np.empty_like(s); copy_streaming(d, s);"
    "assert (d == s).all(); print(i().enabled, i().available, i().reason)"
)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_the_environment_switches_it_off(value: str) -> None:
    out = _run(CHECK, {"CTXKIT_STREAMING_COPY": value})
    assert out.startswith("False") and out.endswith("np.copyto (switched off)"), out


def test_without_llvmlite_copies_are_plain_and_the_reason_names_the_extra(
    tmp_path: Path,
) -> None:
    (tmp_path / "llvmlite").mkdir()
    (tmp_path / "llvmlite" / "__init__.py").write_text("raise ImportError('no llvmlite here')")
    out = _run(CHECK, {"CTXKIT_STREAMING_COPY": "1"}, path=(str(tmp_path),))
    enabled, available, reason = out.split(" ", 2)
    assert (enabled, available) == ("True", "False"), out
    if X86_64:
        assert "install llvmlite" in reason and "ctxkit-cuda[fastcopy]" in reason, out


def test_a_copy_while_the_loop_is_built_in_the_background_is_plain_and_does_not_wait(
    monkeypatch,
):
    gate = threading.Event()
    builds = []

    def slow_compile():
        builds.append(threading.current_thread().name)
        gate.wait(10)
        return None, "np.copyto (a slow build)"

    monkeypatch.setattr(streamcopy, "_compile", slow_compile)
    for name, value in (("loaded", False), ("building", False), ("fn", None), ("reason", "")):
        monkeypatch.setattr(streamcopy._State, name, value)
    streamcopy.build_streaming_copy()
    streamcopy.build_streaming_copy()  # one build only
    src = _bytes(MIN_STREAMING_BYTES * 4, seed=5)
    dst = np.zeros_like(src)
    t0 = time.perf_counter()
    copy_streaming(dst, src)
    assert time.perf_counter() - t0 < 5, "the copy waited for the build"
    np.testing.assert_array_equal(dst, src)
    gate.set()
    assert streaming_copy_info().reason == "np.copyto (a slow build)"  # waits for it
    assert builds == ["ctxkit-streamcopy-build"]


def test_the_cache_size_is_read_from_the_system_or_a_default(monkeypatch):
    assert streamcopy.last_level_cache_bytes() > 0
    assert streamcopy._cache_size("307200K") == 300 << 20
    assert streamcopy._cache_size("32M\n") == 32 << 20
    assert streamcopy._cache_size("1G") == 1 << 30
    assert streamcopy._cache_size("4096") == 4096
    streamcopy.last_level_cache_bytes.cache_clear()
    try:
        monkeypatch.setattr(streamcopy.os, "sysconf", lambda name: 0)
        monkeypatch.setattr(streamcopy.glob, "glob", lambda pattern: [])
        assert streamcopy.last_level_cache_bytes() == streamcopy.DEFAULT_CACHE_BYTES
    finally:
        streamcopy.last_level_cache_bytes.cache_clear()


def test_streaming_pays_from_the_last_level_cache_size_up(monkeypatch):
    monkeypatch.setattr(streamcopy, "last_level_cache_bytes", lambda: 300 << 20)
    assert not streamcopy.streaming_pays(256 << 20)
    assert streamcopy.streaming_pays(300 << 20)
    assert streamcopy.streaming_pays(1 << 30)
