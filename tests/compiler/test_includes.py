"""The cache key covers what NVRTC can read: headers found next to the program (also in the
working directory), in -I directories, nested, shadowed, pre-included or tested with
__has_include, followed with NVRTC's own search rules, at a warm-hit cost that does not
grow with the size of the include directories."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

import ctxkit
import ctxkit.compiler as C
from ctxkit.compiler import includes as _includes

KERNEL = 'extern "C" __global__ void k(int* x) { x[0] = V; }\n'


def _value(obj: C.ObjectCode) -> str:
    """The constant the kernel stores (the 5-digit number in its PTX)."""
    import re

    m = re.search(r"\b(\d{5})\b", obj.ptx or "")
    assert m, obj.ptx
    return m.group(1)


def _ptx(src: str, **kw: Any) -> C.ObjectCode:
    return ctxkit.compile(src, arch="sm_90", target="ptx", **kw)


def _rewrite(path: Path, text: str) -> None:
    """Replace *path*'s text in place, same size (an editor saving a one-digit change)."""
    old = path.read_text()
    assert len(old) == len(text)
    path.write_text(text)


def test_header_in_the_working_directory_is_in_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.cuh").write_text("#define V 11111\n")
    src = '#include "x.cuh"\n' + KERNEL
    assert _value(_ptx(src)) == "11111"
    assert _ptx(src).from_cache
    _rewrite(tmp_path / "x.cuh", "#define V 22222\n")
    obj = _ptx(src)
    assert not obj.from_cache and _value(obj) == "22222"


def test_edit_that_keeps_size_and_mtime_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    header = tmp_path / "x.cuh"
    header.write_text("#define V 11111\n")
    src = '#include "x.cuh"\n' + KERNEL
    _ptx(src)
    st = header.stat()
    _rewrite(header, "#define V 33333\n")
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))  # e.g. restored by a tool
    assert _value(_ptx(src)) == "33333"


def test_touching_a_header_keeps_the_cached_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    header = tmp_path / "x.cuh"
    header.write_text("#define V 11111\n")
    src = '#include "x.cuh"\n' + KERNEL
    _ptx(src)
    later = time.time_ns() + 60 * 10**9
    os.utime(header, ns=(later, later))
    assert _ptx(src).from_cache


def test_header_rewritten_within_one_timestamp_tick_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = tmp_path / "x.cuh"
    header.write_text("#define V 11111\n")
    src = '#include "x.cuh"\n' + KERNEL
    name = str(tmp_path / "k.cu")
    first = _includes.fingerprint(src, name, {}, ())
    frozen, real_stat = os.stat(header), os.stat

    def coarse_stat(path: Any, *args: Any, **kw: Any) -> os.stat_result:
        return frozen if str(path) == str(header) else real_stat(path, *args, **kw)

    monkeypatch.setattr(os, "stat", coarse_stat)  # size and all timestamps unchanged
    _rewrite(header, "#define V 22222\n")
    second = _includes.fingerprint(src, name, {}, ())
    assert second != first  # just written: not trusted to its timestamps
    monkeypatch.setattr(_includes, "_now_ns", lambda: time.time_ns() + 10 * _includes.RACY_NS)
    aged = _includes.fingerprint(src, name, {}, ())
    _rewrite(header, "#define V 33333\n")
    assert _includes.fingerprint(src, name, {}, ()) == aged  # aged: a stat, no read


def test_header_next_to_a_named_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "y.cuh").write_text("#define V 11111\n")
    src = '#include "y.cuh"\n' + KERNEL
    assert _value(_ptx(src, name="sub/k.cu")) == "11111"
    _rewrite(tmp_path / "sub" / "y.cuh", "#define V 44444\n")
    assert _value(_ptx(src, name="sub/k.cu")) == "44444"


def test_nested_header_is_in_the_key(tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    (inc / "d").mkdir(parents=True)
    (inc / "d" / "a.h").write_text('#include "b.h"\n')
    (inc / "d" / "b.h").write_text("#define V 11111\n")
    src = '#include "d/a.h"\n' + KERNEL
    assert _value(_ptx(src, include_dirs=[inc])) == "11111"
    _rewrite(inc / "d" / "b.h", "#define V 55555\n")
    assert _value(_ptx(src, include_dirs=[inc])) == "55555"


def test_new_header_that_shadows_the_used_one(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (second / "v.h").write_text("#define V 11111\n")
    src = '#include "v.h"\n' + KERNEL
    dirs = [first, second]
    assert _value(_ptx(src, include_dirs=dirs)) == "11111"
    (first / "v.h").write_text("#define V 66666\n")
    assert _value(_ptx(src, include_dirs=dirs)) == "66666"


def test_angle_include_is_not_looked_up_next_to_the_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 11111\n")
    (tmp_path / "v.h").write_text("#define V 99999\n")
    src = "#include <v.h>\n" + KERNEL
    assert _value(_ptx(src, include_dirs=[inc])) == "11111"
    _rewrite(tmp_path / "v.h", "#define V 88888\n")  # NVRTC never reads this one
    assert _ptx(src, include_dirs=[inc]).from_cache
    _rewrite(inc / "v.h", "#define V 77777\n")
    assert _value(_ptx(src, include_dirs=[inc])) == "77777"


def test_no_source_include_leaves_the_working_directory_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 11111\n")
    (tmp_path / "v.h").write_text("#define V 99999\n")
    src = '#include "v.h"\n' + KERNEL
    options = ("--no-source-include",)
    fp = _includes.fingerprint(src, "kernel.cu", {}, (*options, f"-I{inc}"))
    assert [path for path, _sig in fp] == [str(inc / "v.h")]
    assert _value(_ptx(src, options=options, include_dirs=[inc])) == "11111"
    _rewrite(tmp_path / "v.h", "#define V 88888\n")
    assert _ptx(src, options=options, include_dirs=[inc]).from_cache


def test_headers_given_by_name_win_over_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.cuh").write_text("#define V 99999\n")
    (tmp_path / "w.h").write_text("#define W 11111\n")
    headers = {"x.cuh": '#include "w.h"\n#define V W\n'}
    src = '#include "x.cuh"\n' + KERNEL
    assert _value(_ptx(src, headers=headers)) == "11111"
    _rewrite(tmp_path / "x.cuh", "#define V 88888\n")  # shadowed by headers=
    assert _ptx(src, headers=headers).from_cache
    _rewrite(tmp_path / "w.h", "#define W 22222\n")  # included by a header given by name
    assert _value(_ptx(src, headers=headers)) == "22222"


def test_pre_included_file_is_in_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.cuh").write_text("#define V 11111\n")
    options = ("-include", "x.cuh")
    assert _value(_ptx(KERNEL, options=options)) == "11111"
    _rewrite(tmp_path / "x.cuh", "#define V 22222\n")
    assert _value(_ptx(KERNEL, options=options)) == "22222"


def test_has_include_sees_a_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    src = '#if __has_include("opt.h")\n#include "opt.h"\n#else\n#define V 11111\n#endif\n' + KERNEL
    assert _value(_ptx(src)) == "11111"
    (tmp_path / "opt.h").write_text("#define V 22222\n")
    assert _value(_ptx(src)) == "22222"


def test_computed_include_fingerprints_the_search_directories(tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 11111\n")
    src = '#define HEADER "v.h"\n#include HEADER\n' + KERNEL
    assert _value(_ptx(src, include_dirs=[inc])) == "11111"
    _rewrite(inc / "v.h", "#define V 22222\n")
    assert _value(_ptx(src, include_dirs=[inc])) == "22222"


def test_cuda_headers_are_not_followed() -> None:
    dirs = C.cuda_include_dirs()
    if not dirs:
        pytest.skip("no CUDA headers installed")
    src = "#include <cuda_fp16.h>\n#include <cuda/std/cstdint>\n" + KERNEL
    fp = _includes.fingerprint(src, "kernel.cu", {}, (), dirs)
    assert fp == [], fp


def test_followed_headers_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(10):
        (tmp_path / f"h{i}.h").write_text(f'#include "h{i + 1}.h"\n')
    monkeypatch.setattr(_includes, "MAX_FILES", 4)
    fp = _includes.fingerprint('#include "h0.h"\n', str(tmp_path / "k.cu"), {}, ())
    assert ["truncated", 4] in fp
    assert sum(1 for item in fp if item[0].endswith(".h")) == 5


def test_warm_hit_with_1500_headers_is_fast(tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    for sub in range(15):
        (inc / f"d{sub}").mkdir(parents=True)
        for i in range(100):
            (inc / f"d{sub}" / f"h{i}.cuh").write_text(f"#define H_{sub}_{i} {i}\n")
    (inc / "d3" / "h7.cuh").write_text('#include "h8.cuh"\n#define V 12345\n')
    src = '#include "d3/h7.cuh"\n#include <d9/h1.cuh>\n' + KERNEL
    first = ctxkit.compile(src, arch="sm_90", include_dirs=[inc])
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        obj = ctxkit.compile(src, arch="sm_90", include_dirs=[inc])
        times.append(time.perf_counter() - t0)
    assert obj.from_cache and obj.code == first.code
    times.sort()
    assert times[50] < 5e-3, f"median warm hit {times[50] * 1e3:.2f} ms with 1,500 headers"


# --- the pieces -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "found", "computed"),
    [
        ('#include "a.h"\n#include <b/c.h>\n', [(True, "a.h"), (False, "b/c.h")], False),
        ('  #  include   "a.h"\n', [(True, "a.h")], False),
        ('/* note */ #include "a.h"\n', [(True, "a.h")], False),
        ('#include \\\n  "a.h"\n', [(True, "a.h")], False),
        ("#include_next <a.h>\n", [(False, "a.h")], False),
        (
            '#if __has_include(<a.h>) || __has_include("b.h")\n#endif\n',
            [(False, "a.h"), (True, "b.h")],
            False,
        ),
        ("#include HEADER\n", [], True),
        ("// see the include directives\nint x;\n", [], False),
        ("int x;\n", [], False),
    ],
)
def test_directives(text: str, found: list[tuple[bool, str]], computed: bool) -> None:
    assert _includes.directives(text) == (tuple(found), computed)


def test_search_path_from_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    options = ("-Ia", "-I", "b", "--include-path=c", "--include-path", "d", "-include", "p.h")
    sp = _includes.search_path("sub/k.cu", options, ["/cuda"])
    assert sp.source_dir == str(tmp_path / "sub")
    assert sp.dirs == tuple(str(tmp_path / x) for x in "abcd")
    assert sp.cuda_dirs == ("/cuda",) and sp.pre_includes == ("p.h",)
    assert _includes.search_path("k.cu", ("--no-source-include",), ()).source_dir is None


def test_tree_fingerprint_is_bounded(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"h{i:02}.h").write_text(str(i))
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "objects").write_text("x")
    ((_dir, files),) = _includes.tree_fingerprint([str(tmp_path)], limit=10)
    assert len(files) == 10 and all(not f[0].startswith(".git") for f in files)
