"""The kernel cache behind ctxkit.compile(): where it lives, hits in memory, on disk and in
new processes, what the key covers, damaged entries, one compile per key, the size cap."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import ctxkit
import ctxkit.compiler as C
from ctxkit.compiler import cache as _cache
from ctxkit.errors import KernelCacheWarning
from tests.compiler._helpers import child_env, delta, entries, run_py, unique


def _reload(src: str, **kw: Any) -> tuple[C.ObjectCode, dict[str, int]]:
    """Compile *src* again with the in-memory cache emptied (so the disk is asked)."""
    _cache._memo.clear()
    before = dict(C.cache.stats)
    obj = ctxkit.compile(src, arch="sm_90", **kw)
    return obj, delta(before)


# --- where ------------------------------------------------------------------------------


def test_cache_dir_env_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(tmp_path / "x"))
    assert C.cache_dir() == tmp_path / "x"
    for off in ("off", "OFF", "0", "none", "false", "disabled"):
        monkeypatch.setenv("CTXKIT_CACHE_DIR", off)
        assert C.cache_dir() is None
    monkeypatch.delenv("CTXKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert C.cache_dir() == tmp_path / "xdg" / "ctxkit" / "kernels"
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
        assert C.cache_dir() == tmp_path / "other" / "ctxkit" / "kernels"


def test_default_cache_dir_created_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("XDG layout is Linux-only")
    monkeypatch.delenv("CTXKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o022)
    try:
        ctxkit.compile(unique("default-dir"), arch="sm_90")
    finally:
        os.umask(old)
    d = tmp_path / "xdg" / "ctxkit" / "kernels"
    assert len(entries(d)) == 1
    assert (d.stat().st_mode & 0o777) == 0o700
    assert (entries(d)[0].stat().st_mode & 0o777) == 0o600


def test_disabled_cache_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CTXKIT_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    src = unique("off")
    before = dict(C.cache.stats)
    a = ctxkit.compile(src, arch="sm_90")
    b = ctxkit.compile(src, arch="sm_90")
    assert not a.from_cache and not b.from_cache
    assert delta(before)["compiled"] == 2
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_cache_false_bypasses_cache(cache: Path) -> None:
    ctxkit.compile(unique("nocache"), arch="sm_90", cache=False)
    assert not entries(cache)


def test_unwritable_cache_warns_once_and_still_compiles(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(blocker / "sub"))
    with pytest.warns(KernelCacheWarning, match="cannot use the kernel cache") as rec:
        obj = ctxkit.compile(unique("unwritable"), arch="sm_90")
    assert obj.code[:4] == b"\x7fELF"
    assert rec[0].filename == __file__  # the warning names the caller, not ctxkit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctxkit.compile(unique("unwritable-2"), arch="sm_90")


def test_clear_cache(cache: Path) -> None:
    ctxkit.compile(unique("clear1"), arch="sm_90")
    ctxkit.compile(unique("clear2"), arch="sm_90")
    left, writing = cache / ".leftover.tmp", cache / ".writing.tmp"
    for p in (left, writing):
        p.write_bytes(b"x")
    hours_ago = time.time_ns() - 2 * 3600 * 10**9
    os.utime(left, ns=(hours_ago, hours_ago))
    assert C.clear_cache() == 3
    assert os.listdir(cache) == [writing.name]  # another process may be writing it
    assert C.clear_cache() == 0


# --- hits -------------------------------------------------------------------------------


def test_cache_hit_in_process(cache: Path) -> None:
    src = unique("memo")
    before = dict(C.cache.stats)
    a = ctxkit.compile(src, arch="sm_90")
    b = ctxkit.compile(src, arch="sm_90")
    assert not a.from_cache and b.from_cache and a.code == b.code
    assert delta(before) == {"compiled": 1, "disk_hits": 0, "memory_hits": 1}
    assert len(entries(cache)) == 1
    assert (cache.stat().st_mode & 0o777) == 0o700


def test_disk_hit_refreshes_last_use(cache: Path) -> None:
    src = unique("touch")
    ctxkit.compile(src, arch="sm_90")
    (entry,) = entries(cache)
    os.utime(entry, ns=(0, 10**18))  # 2001
    obj, moved = _reload(src)
    assert obj.from_cache and moved["disk_hits"] == 1
    assert entry.stat().st_mtime > time.time() - 3600


def test_cache_entry_is_json_header_plus_raw_bytes(cache: Path) -> None:
    obj = ctxkit.compile(unique("format"), arch="sm_90", name_expressions=())
    data = entries(cache)[0].read_bytes()
    first, rest = data.split(b"\n", 1)
    assert first.startswith(b"CTXKIT1 ") and hashlib.sha256(rest).hexdigest() == first[8:].decode()
    header_line, payload = rest.split(b"\n", 1)
    header = json.loads(header_line)
    assert header["target"] == "cubin" and header["arch"] == "sm_90"
    assert payload.startswith(obj.code)
    assert b"\x80\x04" not in data[:2]  # never a pickle


def test_cache_key_covers_every_input(tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 1\n")
    src = '#include "v.h"\n' + unique("key")
    base: dict[str, Any] = {"arch": "sm_90", "include_dirs": [inc]}
    variants: list[dict[str, Any]] = [
        {},
        {"arch": "sm_80"},
        {"target": "ptx"},
        {"options": ("-lineinfo",)},
        {"defines": {"X": 1}},
        {"std": "c++20"},
        {"name": "other.cu"},
        {"headers": {"unused.h": "// x"}},
        {"name_expressions": ("saxpy",)},
    ]
    before = dict(C.cache.stats)
    for v in variants:
        ctxkit.compile(src, **{**base, **v})
    assert delta(before)["compiled"] == len(variants)
    for v in variants:
        assert ctxkit.compile(src, **{**base, **v}).from_cache
    (inc / "v.h").write_text("#define V 2  /* edited */\n")
    assert not ctxkit.compile(src, **base).from_cache


def test_cache_hit_in_new_process_without_nvrtc(cache: Path) -> None:
    src = C.kernel_source("templates.cu") + unique("subprocess")
    exprs = ("axpy<float>", "fill_const<int, 7>")
    first = ctxkit.compile(src, arch="sm_90", name_expressions=exprs)
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["cuda.bindings.nvrtc"] = None   # any NVRTC use now raises ImportError
        import ctxkit
        from ctxkit import compiler
        obj = ctxkit.compile({src!r}, arch="sm_90", name_expressions={exprs!r})
        print(json.dumps({{
            "from_cache": obj.from_cache,
            "sha": __import__("hashlib").sha256(obj.code).hexdigest(),
            "lowered": dict(obj.lowered_names),
            "ptx_kept": obj.ptx is not None and ".entry" in obj.ptx,
            "stats": compiler.cache.stats,
        }}))
        """
    )
    result = json.loads(run_py(script, cache).splitlines()[-1])
    assert result["from_cache"] is True
    assert result["sha"] == hashlib.sha256(first.code).hexdigest()
    assert result["lowered"] == dict(first.lowered_names)
    assert result["ptx_kept"] is True
    assert result["stats"] == {"compiled": 0, "disk_hits": 1, "memory_hits": 0}


def test_warm_hit_in_process_is_fast() -> None:
    src = unique("fast")
    ctxkit.compile(src, arch="sm_90")
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        ctxkit.compile(src, arch="sm_90")
        times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 1e-3, f"median warm hit {times[150] * 1e3:.3f} ms"


# --- damaged entries --------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage", ["flip_payload", "truncate", "tamper_header", "garbage", "empty"]
)
def test_corrupted_entry_is_discarded_and_recompiled(cache: Path, damage: str) -> None:
    src = unique(damage)
    good = ctxkit.compile(src, arch="sm_90")
    (entry,) = entries(cache)
    data = bytearray(entry.read_bytes())
    if damage == "flip_payload":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "tamper_header":
        data = data.replace(b'"arch": "sm_90"', b'"arch": "sm_80"', 1)
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    obj, moved = _reload(src)
    assert moved["compiled"] == 1 and moved["disk_hits"] == 0
    assert not obj.from_cache and obj.code == good.code and obj.arch == "sm_90"
    again, moved = _reload(src)
    assert again.from_cache and moved == {"compiled": 0, "disk_hits": 1, "memory_hits": 0}


MALFORMED: dict[str, Any] = {
    "blob_size_is_text": lambda h, b: h.update(blobs=[["code", str(len(b["code"]))]]),
    "blobs_not_a_list": lambda h, b: h.update(blobs={"code": 3}),
    "lowered_names_not_a_dict": lambda h, b: h.update(lowered_names=5),
    "options_not_strings": lambda h, b: h.update(options=[1, 2]),
    "version_not_ints": lambda h, b: h.update(nvrtc_version=["13", "0"]),
    "target_unknown": lambda h, b: h.update(target="sass"),
    "target_mislabels_code": lambda h, b: h.update(target="ptx"),
    "arch_missing": lambda h, b: h.pop("arch"),
    "code_missing": lambda h, b: b.pop("code"),
    "ptx_not_utf8": lambda h, b: b.update(ptx=b"\xff\xfe"),
}


@pytest.mark.parametrize("damage", sorted(MALFORMED))
def test_malformed_entry_with_valid_hash_is_a_miss(cache: Path, damage: str) -> None:
    src = unique(damage)
    good = ctxkit.compile(src, arch="sm_90")
    (entry,) = entries(cache)
    parsed = _cache.parse_entry(entry.read_bytes(), entry.name.removesuffix(".ctxobj"))
    assert parsed is not None
    header, blobs = parsed
    layout = header["blobs"]
    MALFORMED[damage](header, blobs)
    if header.get("blobs") is layout:
        header["blobs"] = [[n, len(b)] for n, b in blobs.items()]
    rest = json.dumps(header, sort_keys=True).encode() + b"\n" + b"".join(blobs.values())
    entry.write_bytes(b"CTXKIT1 " + hashlib.sha256(rest).hexdigest().encode() + b"\n" + rest)
    obj, moved = _reload(src)
    assert moved["compiled"] == 1 and obj.code == good.code and not obj.from_cache
    again, moved = _reload(src)
    assert again.from_cache and moved["disk_hits"] == 1


def test_entry_under_another_key_is_rejected(cache: Path) -> None:
    a, b = unique("a"), unique("b")
    ctxkit.compile(a, arch="sm_90")
    (entry_a,) = entries(cache)
    obj_b = ctxkit.compile(b, arch="sm_90")
    entry_b = next(p for p in entries(cache) if p != entry_a)
    entry_b.write_bytes(entry_a.read_bytes())  # valid digest, wrong key
    obj, moved = _reload(b)
    assert moved["compiled"] == 1 and obj.code == obj_b.code


# --- one compile per key ----------------------------------------------------------------


def test_threads_compile_each_program_once() -> None:
    sources = [unique(f"threads-{i}") for i in range(5)]
    before = dict(C.cache.stats)
    barrier = threading.Barrier(8)
    results: list[Any] = []

    def work() -> None:
        barrier.wait()
        for src in sources:
            results.append(hashlib.sha256(ctxkit.compile(src, arch="sm_90").code).digest())

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert len(results) == 8 * 5
    assert delta(before)["compiled"] == 5
    assert not _cache._key_locks  # nothing left behind


def test_processes_and_threads_compile_each_program_once(cache: Path, tmp_path: Path) -> None:
    sources = [unique(f"procs-{i}") for i in range(5)]
    go = tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import hashlib, os, threading, time
        import ctxkit
        from ctxkit import compiler
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        shas = set()
        def work():
            for src in {sources!r}:
                shas.add(hashlib.sha256(ctxkit.compile(src, arch="sm_90").code).hexdigest())
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(compiler.cache.stats["compiled"], *sorted(shas))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=child_env(cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(0.5)
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        outs.append(out.split())
    assert sum(int(o[0]) for o in outs) == 5, outs
    assert outs[0][1:] == outs[1][1:]
    assert len(entries(cache)) == 5
    assert not list(cache.glob("*.tmp")) and not list(cache.glob(".*.lock"))


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_lock_of_a_stopped_process_is_waited_for_with_warnings_and_a_bound(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = unique("stopped-holder")
    key = ctxkit.Program(src)._cache_key("sm_90", "auto")
    hold = textwrap.dedent(
        f"""
        import time
        from ctxkit.compiler import cache, cache_dir
        with cache.open_dir(cache_dir()) as cd, cache.process_lock(cd, {key!r}):
            print("locked", flush=True)
            time.sleep(60)
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold], env=child_env(cache), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGSTOP)
        monkeypatch.setattr(_cache, "LOCK_WARN_S", 0.3)
        monkeypatch.setattr(_cache, "LOCK_TIMEOUT_S", 1.5)
        t0 = time.monotonic()
        with pytest.warns(KernelCacheWarning) as rec:
            obj = ctxkit.compile(src, arch="sm_90")
        waited = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert obj.code[:4] == b"\x7fELF" and 1.5 <= waited < 30
    lock = str(cache / f".{key}.lock")
    first, last = (str(w.message) for w in rec)
    assert first.startswith(f"ctxkit: waiting for {lock} for 0.")
    assert "up to 1.5 s in all" in first
    assert last.startswith("ctxkit: gave up after 1.") and lock in last
    assert all(w.filename == __file__ for w in rec)  # they name the caller, not ctxkit


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_is_not_blocked_by_a_parent_thread_compiling() -> None:
    src = unique("fork")
    entered, release = threading.Event(), threading.Event()
    directory = C.cache_dir()
    assert directory is not None
    key = ctxkit.Program(src)._cache_key("sm_90", "auto")
    real = ctxkit.compile(src, arch="sm_90", cache=False)

    def slow_build() -> C.ObjectCode:
        entered.set()
        release.wait(60)
        return real

    t = threading.Thread(target=_cache.cached, args=(directory, key, slow_build))
    t.start()
    assert entered.wait(60)
    try:
        pid = os.fork()
        if pid == 0:  # the child: the parent's thread (and its lock) do not exist here
            code = 1
            try:
                import signal

                signal.alarm(60)
                before = dict(C.cache.stats)
                obj = _cache.cached(directory, key, lambda: real)
                code = 0 if obj.from_cache and delta(before)["disk_hits"] == 1 else 2
            finally:
                os._exit(code)
        release.set()  # the child waits for this thread's result, then reads it from disk
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        t.join(60)
    assert os.waitstatus_to_exitcode(status) == 0


# --- size cap ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", 1 << 30), ("1000", 1000), ("64K", 64 << 10), ("512M", 512 << 20), ("2G", 2 << 30)],
)
def test_max_bytes_from_env(monkeypatch: pytest.MonkeyPatch, value: str, expected: int) -> None:
    monkeypatch.setenv("CTXKIT_CACHE_MAX_BYTES", value)
    assert _cache.max_bytes() == expected


@pytest.mark.parametrize("value", ["0", "-5", "1.5G", "lots", "12Q"])
def test_bad_max_bytes_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CTXKIT_CACHE_MAX_BYTES", value)
    with pytest.raises(ValueError, match="CTXKIT_CACHE_MAX_BYTES=.*2G"):
        ctxkit.compile(unique("badcap"), arch="sm_90")


def test_size_cap_evicts_least_recently_used(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = (unique(f"lru-{t}") for t in "abc")
    ctxkit.compile(a, arch="sm_90")
    (entry_a,) = entries(cache)
    ctxkit.compile(b, arch="sm_90")
    (entry_b,) = [e for e in entries(cache) if e != entry_a]
    now = time.time_ns()
    os.utime(entry_a, ns=(now, now - 100 * 10**9))
    os.utime(entry_b, ns=(now, now - 50 * 10**9))
    assert _reload(a)[0].from_cache  # a disk hit makes A the most recently used
    size = entry_a.stat().st_size
    monkeypatch.setenv("CTXKIT_CACHE_MAX_BYTES", str(2 * size + size // 2))
    ctxkit.compile(c, arch="sm_90")
    left = entries(cache)
    assert entry_a in left and entry_b not in left and len(left) == 2
    assert sum(e.stat().st_size for e in left) <= 2 * size + size // 2


def test_entry_larger_than_the_cap_is_not_stored(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CTXKIT_CACHE_MAX_BYTES", "1K")
    obj = ctxkit.compile(unique("huge"), arch="sm_90")
    assert len(obj.code) > 1024 and not entries(cache)


def test_leftover_temporary_files_are_swept(cache: Path) -> None:
    ctxkit.compile(unique("sweep-1"), arch="sm_90")
    old, fresh, old_lock = cache / ".dead.x.tmp", cache / ".live.y.tmp", cache / f".{'0' * 64}.lock"
    for p in (old, fresh, old_lock):
        p.write_bytes(b"partial")
    hours_ago = time.time_ns() - 2 * 3600 * 10**9
    os.utime(old, ns=(hours_ago, hours_ago))
    os.utime(old_lock, ns=(hours_ago, hours_ago))
    ctxkit.compile(unique("sweep-2"), arch="sm_90")
    assert not old.exists() and not old_lock.exists()
    assert fresh.exists()  # may belong to a writer at work
    assert len(entries(cache)) == 2


# --- toolchain fingerprint --------------------------------------------------------------


def test_toolchain_fingerprint_falls_back_to_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cache, "_candidate_dirs", lambda: [])
    calls = []

    def version() -> tuple[int, int]:
        calls.append(1)
        return (13, 0)

    fp = _cache.toolchain_fingerprint.__wrapped__(version, 13)
    assert calls == [1]
    other = _cache.toolchain_fingerprint.__wrapped__(lambda: (13, 1), 13)
    assert fp != other


def test_toolchain_fingerprint_tracks_library_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lib = tmp_path / "libnvrtc.so.13"
    lib.write_bytes(b"v1")
    monkeypatch.setattr(_cache, "_candidate_dirs", lambda: [str(tmp_path)])

    def no_version() -> tuple[int, int]:
        raise AssertionError("must not load NVRTC when a library file is found")

    fp1 = _cache.toolchain_fingerprint.__wrapped__(no_version, 13)
    lib.write_bytes(b"v2-upgraded")
    fp2 = _cache.toolchain_fingerprint.__wrapped__(no_version, 13)
    assert fp1 != fp2
