"""The cache's files on a shared or hostile file system: a directory other users can write
is not trusted, entries are never followed, blocked on or read past a cap, eviction and
the lock between processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import ctxkit
from ctxkit.compiler import cache as _cache
from ctxkit.errors import KernelCacheWarning
from tests.compiler._helpers import child_env, delta, entries, unique

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX owners and modes")

IS_ROOT = os.name == "posix" and os.geteuid() == 0

ATTACKER = 'extern "C" __global__ void saxpy(float a, float* x, float* y, size_t n) { y[0] = 666; }'


def _plant(directory: Path, victim: str, payload_src: str) -> bytes:
    """Put a valid entry for *victim*'s key into *directory*, holding other code."""
    key = ctxkit.Program(victim)._cache_key("sm_90", "auto")
    other = ctxkit.compile(payload_src, arch="sm_90", cache=False)
    header, blobs = _cache._encode(other)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{key}.ctxobj").write_bytes(_cache.encode_entry(key, header, blobs))
    return other.code


@pytest.mark.parametrize("problem", ["world-writable", "group-writable", "other-owner"])
def test_untrusted_directory_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    shared = tmp_path / "shared"
    victim = unique("victim")
    planted = _plant(shared, victim, ATTACKER)
    if problem == "world-writable":
        shared.chmod(0o777)
    elif problem == "group-writable":
        shared.chmod(0o770)
    elif IS_ROOT:
        os.chown(shared, 65534, 65534)
        shared.chmod(0o755)
    else:
        monkeypatch.setattr(_cache, "_euid", lambda: os.geteuid() + 1)
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(shared))
    before = dict(_cache.stats)
    with pytest.warns(KernelCacheWarning, match=r"not using the kernel cache.*chmod 700"):
        obj = ctxkit.compile(victim, arch="sm_90")
    assert not obj.from_cache and obj.code != planted
    assert delta(before)["compiled"] == 1
    assert len(entries(shared)) == 1  # nothing written there, nothing removed
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        again = ctxkit.compile(unique("victim-2"), arch="sm_90")
    assert not again.from_cache


def _foreign_link(link: Path, target: Path) -> None:
    """*link* -> *target*, a symbolic link owned by another user (needs root)."""
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give a link to another user")
@pytest.mark.parametrize("where", ["final", "parent"])
def test_directory_reached_through_another_users_link_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    victim = unique(f"foreign-link-{where}")
    planted = _plant(mine / "kernels", victim, ATTACKER)
    (mine / "kernels").chmod(0o700)
    if where == "final":
        _foreign_link(tmp_path / "cache", mine / "kernels")
        path = tmp_path / "cache"
    else:
        _foreign_link(tmp_path / "shared", mine)
        path = tmp_path / "shared" / "kernels"
    link = tmp_path / ("cache" if where == "final" else "shared")
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(path))
    with pytest.warns(KernelCacheWarning, match=rf"{link} is a symbolic link owned by uid 65534"):
        obj = ctxkit.compile(victim, arch="sm_90")
    assert not obj.from_cache and obj.code != planted
    assert len(entries(mine / "kernels")) == 1  # nothing written there, nothing removed


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give a link to another user")
def test_cache_is_not_created_through_another_users_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "theirs").mkdir()
    _foreign_link(tmp_path / "planted", tmp_path / "theirs")
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(tmp_path / "planted" / "sub" / "kernels"))
    with pytest.warns(KernelCacheWarning, match="planted is a symbolic link owned by uid 65534"):
        ctxkit.compile(unique("create-through-link"), arch="sm_90")
    assert not list((tmp_path / "theirs").iterdir())


def test_directory_reached_through_own_links_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".cache").symlink_to("../real/deep")  # a relative link, with ..
    (tmp_path / "alias").symlink_to(tmp_path / "home")
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(tmp_path / "alias" / ".cache" / "kernels"))
    src = unique("own-links")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctxkit.compile(src, arch="sm_90")
        _cache._memo.clear()
        assert ctxkit.compile(src, arch="sm_90").from_cache
    d = tmp_path / "real" / "deep" / "kernels"
    assert len(entries(d)) == 1 and (d.stat().st_mode & 0o777) == 0o700


def test_directory_swapped_while_checked_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, other = tmp_path / "c", tmp_path / "other-private"
    d.mkdir(mode=0o700)
    other.mkdir(mode=0o700)
    follow = _cache._follow

    def swap_after_the_check(path: Path) -> tuple[str, os.stat_result | None]:
        found = follow(path)
        d.rename(tmp_path / "moved")
        d.symlink_to(other)  # a link of this user's, to another private directory
        return found

    monkeypatch.setattr(_cache, "_follow", swap_after_the_check)
    with pytest.warns(KernelCacheWarning, match="was replaced while it was checked"):
        assert _cache.open_dir(d) is None


def test_private_directory_readable_by_others_is_used(tmp_path: Path) -> None:
    d = tmp_path / "mine"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
        assert cd is not None


def test_symlinked_entry_is_not_followed(cache: Path, tmp_path: Path) -> None:
    victim = unique("link-victim")
    elsewhere = tmp_path / "elsewhere"
    planted = _plant(elsewhere, victim, ATTACKER)
    (target,) = entries(elsewhere)
    cache.mkdir(mode=0o700)
    link = cache / target.name
    link.symlink_to(target)
    obj = ctxkit.compile(victim, arch="sm_90")
    assert not obj.from_cache and obj.code != planted
    assert not link.is_symlink() and link.is_file()  # replaced by a real entry
    assert target.exists()  # the link's target is left alone


def test_fifo_entry_does_not_hang(cache: Path) -> None:
    src = unique("fifo")
    script = textwrap.dedent(
        f"""
        import os, ctxkit
        from ctxkit.compiler import cache_dir
        key = ctxkit.Program({src!r})._cache_key("sm_90", "auto")
        cache_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
        os.mkfifo(cache_dir() / (key + ".ctxobj"))
        obj = ctxkit.compile({src!r}, arch="sm_90")
        print(obj.from_cache, (cache_dir() / (key + ".ctxobj")).is_file())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]


def test_link_to_dev_zero_does_not_exhaust_memory(cache: Path) -> None:
    script = textwrap.dedent(
        """
        import os, resource, sys
        from pathlib import Path
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from ctxkit.compiler import cache
        d = Path(sys.argv[1])
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        (d / ("ab" * 32 + ".ctxobj")).symlink_to("/dev/zero")
        with cache.open_dir(d) as cd:
            print(cache.read_entry(cd, "ab" * 32, 1 << 40), os.listdir(d))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(cache)],
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None []"


def test_entry_larger_than_the_cap_is_not_read(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = unique("cap")
    ctxkit.compile(src, arch="sm_90")
    (entry,) = entries(cache)
    monkeypatch.setenv("CTXKIT_CACHE_MAX_BYTES", str(entry.stat().st_size - 1))
    _cache._memo.clear()
    before = dict(_cache.stats)
    obj = ctxkit.compile(src, arch="sm_90")
    assert not obj.from_cache and delta(before) == {
        "compiled": 1,
        "disk_hits": 0,
        "memory_hits": 0,
    }


def test_empty_directory_at_an_entry_is_replaced_by_the_entry(cache: Path) -> None:
    src = unique("dir-entry")
    key = ctxkit.Program(src)._cache_key("sm_90", "auto")
    cache.mkdir(mode=0o700)
    (cache / f"{key}.ctxobj").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctxkit.compile(src, arch="sm_90")
    assert (cache / f"{key}.ctxobj").is_file()
    _cache._memo.clear()
    assert ctxkit.compile(src, arch="sm_90").from_cache


def test_full_directory_at_an_entry_compiles_without_caching_and_says_so(cache: Path) -> None:
    src = unique("full-dir-entry")
    key = ctxkit.Program(src)._cache_key("sm_90", "auto")
    cache.mkdir(mode=0o700)
    blocker = cache / f"{key}.ctxobj"
    blocker.mkdir()
    (blocker / "something").write_text("the user's")
    with pytest.warns(KernelCacheWarning, match=rf"{key}\.ctxobj is a directory") as rec:
        obj = ctxkit.compile(src, arch="sm_90")
    assert len(rec) == 1 and not obj.from_cache and obj.code[:4] == b"\x7fELF"
    assert (blocker / "something").read_text() == "the user's"
    _cache._memo.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert not ctxkit.compile(src, arch="sm_90").from_cache
        other = unique("next-to-full-dir")
        ctxkit.compile(other, arch="sm_90")
        _cache._memo.clear()
        assert ctxkit.compile(other, arch="sm_90").from_cache  # the rest of the cache works


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give a file to another user")
def test_entry_owned_by_another_user_is_discarded(cache: Path) -> None:
    src = unique("owner")
    ctxkit.compile(src, arch="sm_90")
    (entry,) = entries(cache)
    os.chown(entry, 65534, 65534)
    _cache._memo.clear()
    obj = ctxkit.compile(src, arch="sm_90")
    assert not obj.from_cache
    assert entry.stat().st_uid == os.geteuid()  # replaced by this user's entry


# --- parsing -----------------------------------------------------------------------------


def _raw(key: str, head: bytes, payload: bytes) -> bytes:
    rest = head + b"\n" + payload
    return b"CTXKIT1 " + hashlib.sha256(rest).hexdigest().encode() + b"\n" + rest


@pytest.mark.parametrize(
    "head",
    [
        b'{"key": "K", "blobs": [["code", "3"]]}',
        b'{"key": "K", "blobs": [["code", -1]]}',
        b'{"key": "K", "blobs": [["code", 1.5]]}',
        b'{"key": "K", "blobs": [["code", true]]}',
        b'{"key": "K", "blobs": [["code"]]}',
        b'{"key": "K", "blobs": [[3, 3]]}',
        b'{"key": "K", "blobs": [["code", 1], ["code", 2]]}',
        b'{"key": "K", "blobs": "code"}',
        b'{"key": "K"}',
        b'["key", "K"]',
        b'{"key": "other", "blobs": [["code", 3]]}',
        b'{"key": "K", "blobs": [["code", 2]]}',
    ],
)
def test_parse_rejects_malformed_headers(head: bytes) -> None:
    assert _cache.parse_entry(_raw("K", head, b"abc"), "K") is None


def test_parse_rejects_a_header_nested_too_deep() -> None:
    head = b'{"key": "K", "blobs": [], "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert _cache.parse_entry(_raw("K", head, b""), "K") is None


def test_entry_nested_too_deep_is_discarded_and_recompiled(cache: Path) -> None:
    src = unique("deep")
    good = ctxkit.compile(src, arch="sm_90")
    (entry,) = entries(cache)
    key = entry.name.removesuffix(".ctxobj")
    entry.write_bytes(_raw(key, b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", b""))
    _cache._memo.clear()
    before = dict(_cache.stats)
    obj = ctxkit.compile(src, arch="sm_90")
    assert not obj.from_cache and obj.code == good.code and delta(before)["compiled"] == 1
    assert _cache.parse_entry(entry.read_bytes(), key) is not None  # replaced by a good entry


def test_parse_accepts_a_written_entry() -> None:
    data = _cache.encode_entry("K", {"x": 1}, {"code": b"abc", "ptx": b"de"})
    header, blobs = _cache.parse_entry(data, "K")  # type: ignore[misc]
    assert header["x"] == 1 and blobs == {"code": b"abc", "ptx": b"de"}


# --- eviction ----------------------------------------------------------------------------


def _fake_entries(d: Path, sizes_and_ages: dict[str, tuple[int, int]]) -> None:
    d.mkdir(mode=0o700, exist_ok=True)
    now = time.time_ns()
    for name, (size, age_s) in sizes_and_ages.items():
        p = d / f"{name}.ctxobj"
        p.write_bytes(b"x" * size)
        os.utime(p, ns=(now, now - age_s * 10**9))


def test_evict_removes_least_recently_used_first(tmp_path: Path) -> None:
    _fake_entries(tmp_path / "c", {"a": (100, 30), "b": (100, 20), "c": (100, 10), "d": (100, 5)})
    with _cache.open_dir(tmp_path / "c") as cd:  # type: ignore[union-attr]
        assert _cache.evict(cd, 250) == 2
    assert sorted(p.stem for p in entries(tmp_path / "c")) == ["c", "d"]


def test_evict_keeps_the_entry_just_written(tmp_path: Path) -> None:
    _fake_entries(tmp_path / "c", {"new": (300, 1000), "b": (100, 20)})
    with _cache.open_dir(tmp_path / "c") as cd:  # type: ignore[union-attr]
        _cache.evict(cd, 250, keep="new")
    assert [p.stem for p in entries(tmp_path / "c")] == ["new"]


def test_evict_removes_entries_that_are_not_files(tmp_path: Path) -> None:
    d = tmp_path / "c"
    _fake_entries(d, {"a": (10, 1)})
    os.mkfifo(d / "f.ctxobj")
    (d / "l.ctxobj").symlink_to(d / "a.ctxobj")
    (d / "e.ctxobj").mkdir()
    (d / "full.ctxobj").mkdir()
    (d / "full.ctxobj" / "x").write_text("kept")
    with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
        assert _cache.evict(cd, 1 << 20) == 3
    assert sorted(os.listdir(d)) == ["a.ctxobj", "full.ctxobj"]


def _age(path: Path, seconds: float) -> None:
    then = time.time_ns() - int(seconds * 1e9)
    os.utime(path, ns=(then, then))


HOLD_LOCK = """
import sys, time
from pathlib import Path
from ctxkit.compiler import cache
with cache.open_dir(Path(sys.argv[1])) as cd:
    with cache.process_lock(cd, sys.argv[2]):
        print("locked", flush=True)
        time.sleep(60)
"""


@pytest.mark.parametrize("sweep", ["evict", "clear"])
def test_sweeps_keep_a_lock_another_process_holds(tmp_path: Path, sweep: str) -> None:
    d = tmp_path / "c"
    _fake_entries(d, {"a": (10, 1)})
    key = "h" * 64
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(d), key],
        env=child_env(d),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        held, dead = d / f".{key}.lock", d / f".{'d' * 64}.lock"
        dead.write_bytes(b"")
        for p in (held, dead):
            _age(p, 2 * _cache.TMP_MAX_AGE_S)  # e.g. a holder stopped for hours
        with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
            if sweep == "evict":
                _cache.evict(cd, 1 << 20)
            else:
                _cache.clear_entries(cd)
        assert held.exists() and not dead.exists()
        with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
            with pytest.warns(KernelCacheWarning, match="gave up"):
                with _cache.process_lock(cd, key, timeout=0.2) as got:
                    assert got is False  # still held by the other process
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("sweep", ["evict", "clear"])
def test_sweeps_keep_a_lock_this_process_holds(tmp_path: Path, sweep: str) -> None:
    d = tmp_path / "c"
    _fake_entries(d, {"a": (10, 1)})
    key = "m" * 64
    with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
        with _cache.process_lock(cd, key) as got:
            assert got
            _age(d / f".{key}.lock", 2 * _cache.TMP_MAX_AGE_S)
            if sweep == "evict":
                _cache.evict(cd, 1 << 20)
            else:
                _cache.clear_entries(cd)
            assert (d / f".{key}.lock").exists()
        assert not (d / f".{key}.lock").exists()  # removed by its holder


def test_clear_keeps_temporary_files_a_writer_may_still_use(tmp_path: Path) -> None:
    d = tmp_path / "c"
    _fake_entries(d, {"a": (10, 1)})
    (d / ".fresh.x.tmp").write_bytes(b"partial")
    (d / ".dead.y.tmp").write_bytes(b"partial")
    _age(d / ".dead.y.tmp", 2 * _cache.TMP_MAX_AGE_S)
    with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
        assert _cache.clear_entries(cd) == 2
    assert os.listdir(d) == [".fresh.x.tmp"]


# --- the lock between processes -------------------------------------------------------


def test_process_lock_makes_another_process_wait(tmp_path: Path) -> None:
    d = tmp_path / "c"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from ctxkit.compiler import cache
        with cache.open_dir(Path({str(d)!r})) as cd:
            print("trying", flush=True)
            with cache.process_lock(cd, "k" * 64) as held:
                print(held, time.time())
        """
    )
    with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
        with _cache.process_lock(cd, "k" * 64) as held:
            assert held
            child = subprocess.Popen(
                [sys.executable, "-c", script], env=child_env(d), stdout=subprocess.PIPE, text=True
            )
            assert child.stdout is not None and child.stdout.readline().strip() == "trying"
            time.sleep(0.5)
            released = time.time()
    out = child.communicate(timeout=60)[0].split()
    assert child.returncode == 0 and out[0] == "True"
    assert float(out[1]) >= released
    assert not [p for p in os.listdir(d) if p.endswith(".lock")]


def test_process_lock_times_out_without_the_lock(tmp_path: Path) -> None:
    d = tmp_path / "c"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from ctxkit.compiler import cache
        with cache.open_dir(Path({str(d)!r})) as cd:
            with cache.process_lock(cd, "t" * 64):
                print("locked", flush=True)
                time.sleep(30)
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script], env=child_env(d), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with _cache.open_dir(d) as cd:  # type: ignore[union-attr]
            t0 = time.monotonic()
            with pytest.warns(
                KernelCacheWarning, match=r"gave up after 0\.3 s waiting for .*\.lock"
            ):
                with _cache.process_lock(cd, "t" * 64, timeout=0.3) as held:
                    waited = time.monotonic() - t0
        assert held is False and 0.25 < waited < 5
    finally:
        holder.kill()
        holder.wait()
