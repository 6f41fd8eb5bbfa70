"""The kernel cache used by :func:`ctxkit.compile`: in memory, then on disk.

Where: ``CTXKIT_CACHE_DIR``, else ``kernels/`` under the user cache directory
(``$XDG_CACHE_HOME/ctxkit`` or ``~/.cache/ctxkit`` on Linux); ``CTXKIT_CACHE_DIR=off``
disables it. The directory must belong to the user, be closed to group and others and
be reached through no other user's symbolic link; otherwise ctxkit warns once and
compiles without the disk cache (the files are described below).

How big: ``CTXKIT_CACHE_MAX_BYTES`` (bytes, or with a ``K``/``M``/``G`` suffix; default
:data:`DEFAULT_MAX_BYTES`, 1 GiB); least recently used entries go first.
:func:`clear_cache` empties it (or delete the directory).

The key changes whenever the compiled output could: source, name, options, headers,
name expressions, arch, target, every file NVRTC can read
(:mod:`ctxkit.compiler.includes`), the CUDA headers and the NVRTC library. Its NVRTC
part is a fingerprint of the libraries this process would load (path, size and mtime
of each candidate), a few ``stat`` calls: loading NVRTC to ask its version costs
~10 ms, which would dominate a warm hit. Where no candidate library is found, the
fingerprint falls back to the NVRTC version itself.

One compile per key at a time: threads of a process asking for the same program wait
for the first one, and so do other processes using the same directory (a lock file).

The counters in :data:`stats` (NVRTC compiles, disk and memory hits) serve tests and
benchmarks.

The files on disk, safe in a directory others can reach.

An entry is one file ``<key>.ctxobj``::

    CTXKIT1 <sha256 of everything after this line>\n
    <header: one line of JSON>\n
    <payload: the blobs named in the header, back to back>

Nothing is ever unpickled. The digest is written by the writer, so it only catches
corruption; what keeps other users' code out is the directory itself. A directory is
used only when it is owned by the effective user and not writable by group or others
(the rule of ssh's ``StrictModes`` and pip's cache), and when every symbolic link on
the way to it belongs to the user or root (another user's link could be pointed
anywhere): otherwise ctxkit warns once (:class:`KernelCacheWarning`) and compiles
without the disk cache, reading nothing from there. A missing directory is created
with mode 0700. The directory is opened once per operation, checked to be the one
the path led to, and every entry is reached through that descriptor, so swapping the
path for another directory afterwards changes nothing.

Entries are opened without following symbolic links and without blocking, and read
only when ``fstat`` says they are a regular file of the effective user no larger than
the cap; anything else (a FIFO, a link to ``/dev/zero``, an empty directory, a
truncated, malformed or absurdly nested file) is a miss and is removed. A directory
that is not empty is left alone: its kernel is compiled without the disk cache, with
one warning naming it. Entries are written to a private temporary file and moved into
place with ``os.replace``, so readers see no entry or a complete one.

The directory stays under a size cap (:func:`max_bytes`): after
each write the least recently used entries (a hit refreshes an entry's mtime) are
removed. Eviction and :func:`clear_entries` remove a temporary file only when it is older than
:data:`TMP_MAX_AGE_S` (left by a killed writer; a younger one may be another process's
write in progress), and a lock file only when it is that old and no process holds it.

A lock file per key, held while one process compiles (a POSIX record lock), lets other
processes wait for its result instead of compiling the same program; its holder
removes it. A waiter warns after :data:`LOCK_WARN_S` seconds (naming the lock file,
the wait so far and the limit: a stopped or hung process holds the lock as long as
it lives) and compiles on its own after :data:`LOCK_TIMEOUT_S`, with a second warning."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import _driver, _env
from ..errors import KernelCacheWarning
from .objectcode import ObjectCode, detect_target

__all__ = [
    "DEFAULT_MAX_BYTES",
    "LOCK_TIMEOUT_S",
    "LOCK_WARN_S",
    "TMP_MAX_AGE_S",
    "cache_dir",
    "cached",
    "clear_cache",
    "clear_entries",
    "count",
    "encode_entry",
    "evict",
    "make_key",
    "max_bytes",
    "open_dir",
    "parse_entry",
    "process_lock",
    "read_entry",
    "stats",
    "toolchain_fingerprint",
]


ENTRY_SUFFIX = ".ctxobj"


TMP_SUFFIX = ".tmp"


LOCK_SUFFIX = ".lock"


#: Temporary files older than this (seconds) are left by a killed writer and removed.
TMP_MAX_AGE_S = 3600.0


#: How long a process waits for another one compiling the same program (seconds).
LOCK_TIMEOUT_S = 120.0


#: After this long waiting for another process's lock (seconds), a warning says so.
LOCK_WARN_S = 5.0


_MAGIC = b"CTXKIT1 "


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


_SAFE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _SAFE_FLAGS


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE_FLAGS


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _SAFE_FLAGS


# errno of an entry that is there but must not be read: a link, a FIFO or socket, no access.
_NOT_AN_ENTRY = frozenset(
    {errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EACCES, errno.EPERM, errno.ENOTDIR}
)


_warned: set[tuple[str, str]] = set()


# (st_dev, st_ino) of the lock files this process holds (see _remove_unheld_lock).
_held: set[tuple[int, int]] = set()


def _euid() -> int:
    return os.geteuid()


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _warn(message: str, once: tuple[Path, str] | None = None) -> None:
    """A :class:`KernelCacheWarning` at the user's frame; only the first per *once* key."""
    if once is not None:
        if (str(once[0]), once[1]) in _warned:
            return
        _warned.add((str(once[0]), once[1]))
    warnings.warn(message, KernelCacheWarning, stacklevel=_user_stacklevel())


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel``, for our caller's ``warnings.warn``, of the first frame outside ctxkit
    (and :mod:`contextlib`, which runs ``with`` blocks)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        or frame.f_code.co_filename == contextlib.__file__
    ):
        frame = frame.f_back
        level += 1
    return level


class CacheDir:
    """A cache directory opened and verified once; entries are reached through it.

    The directory is held open and every entry is opened relative to that descriptor
    (``dir_fd``).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def __enter__(self) -> CacheDir:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def open(self, name: str, flags: int) -> int:
        return os.open(name, flags, 0o600, dir_fd=self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def remove(self, name: str) -> bool:
        """Unlink *name*, or remove it if it is an empty directory; False when it stays."""
        for remove in (os.unlink, os.rmdir):
            with contextlib.suppress(OSError):
                remove(name, dir_fd=self.fd)
                return True
        return False

    def scan(self) -> Iterator[tuple[str, os.stat_result]]:
        """``(name, lstat)`` of every file in the directory."""
        with os.scandir(self.fd) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    yield e.name, e.stat(follow_symlinks=False)

    def discard(self, name: str, seen: os.stat_result | None = None) -> None:
        """Remove *name*, unless it is no longer the file *seen* (a writer replaced it)."""
        with contextlib.suppress(OSError):
            if seen is None or _file_id(self.lstat(name)) == _file_id(seen):
                self.remove(name)


def open_dir(path: Path, create: bool = True) -> CacheDir | None:
    """The verified cache directory at *path*, or ``None`` (with one warning) when unusable.

    Creates it (mode 0700) when missing and *create* is true. Refuses a directory that
    is not owned by the effective user, that group or others can write, or that is
    reached through a symbolic link of another user (see :func:`_follow`).
    """
    link, seen = _follow(path)
    try:
        if not link and seen is None and create:
            _make_private_dir(path)
            link, seen = _follow(path)
        if link:
            _warn_unsafe(path, link, _LINK_FIX)
            return None
        d = CacheDir(path, os.open(path, _DIR_FLAGS))
    except OSError as exc:
        if create or exc.errno != errno.ENOENT:  # a missing directory to clear is no news
            _warn_unusable(path, exc)
        return None
    if problem := _distrust(os.fstat(d.fd), seen):
        d.__exit__()
        _warn_unsafe(
            path,
            f"it {problem}",
            f"`chmod 700 {path}` if it is yours, or set CTXKIT_CACHE_DIR to a directory of "
            "your own",
        )
        return None
    return d


def _warn_unsafe(path: Path, problem: str, fix: str) -> None:
    _warn(
        f"ctxkit: not using the kernel cache in {path}: {problem}, so another user could "
        "plant compiled code there. Kernels are compiled without the disk cache. "
        f"Fix: {fix} (or to 'off').",
        once=(path, "unsafe"),
    )


_LINK_FIX = "set CTXKIT_CACHE_DIR to a directory reached through no other user's link"


_MAX_LINKS = 40  # as Linux's ELOOP


def _follow(path: Path) -> tuple[str, os.stat_result | None]:
    """Walk *path* as the kernel resolves it, trusting only this user's and root's links.

    Returns ``(problem, None)`` at a symbolic link owned by another user (who could point
    it anywhere, now or later), else ``("", lstat of the place it leads to)``, with
    ``None`` when that does not exist (or cannot be looked at: opening it will say why).
    """
    links = 0
    try:
        todo = list(reversed((Path.cwd() / path).parts))
        current = todo.pop()
        while todo:
            part = todo.pop()
            if part == "..":
                current = os.path.dirname(current)
                continue
            here = os.path.join(current, part)
            st = os.lstat(here)
            if not stat.S_ISLNK(st.st_mode):
                current = here
                continue
            if st.st_uid not in (_euid(), 0):
                return f"{here} is a symbolic link owned by uid {st.st_uid}", None
            links += 1
            if links > _MAX_LINKS:
                return "", None
            target = Path(os.readlink(here))
            todo.extend(reversed(target.parts))
            if target.is_absolute():
                current = todo.pop()
        return "", os.lstat(current)
    except OSError:
        return "", None


def _make_private_dir(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # made by someone else meanwhile: verified like any existing directory
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask


def _distrust(st: os.stat_result, seen: os.stat_result | None) -> str:
    """Why a directory with this ``fstat`` must not be trusted ('' when it can be);
    *seen* is the ``lstat`` of the place its path led to when it was checked."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != _euid():
        return f"is owned by uid {st.st_uid}, not by this process (euid {_euid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if seen is None or _file_id(st) != _file_id(seen):
        return "was replaced while it was checked"
    return ""


def _warn_unusable(path: Path, exc: OSError) -> None:
    _warn(
        f"ctxkit: cannot use the kernel cache in {path} ({exc}); compiled kernels are "
        "not cached on disk. Set CTXKIT_CACHE_DIR to a writable directory, or to 'off'.",
        once=(path, "unwritable"),
    )


def read_entry(d: CacheDir, key: str, limit: int) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    """The verified ``(header, blobs)`` of *key*, or ``None`` (missing or discarded).

    Never follows a link, never blocks, never reads more than *limit* bytes.
    """
    name = key + ENTRY_SUFFIX
    try:
        fd = d.open(name, _READ_FLAGS)
    except OSError as exc:
        if exc.errno in _NOT_AN_ENTRY:
            d.discard(name)
        return None
    try:
        st = os.fstat(fd)
        readable = stat.S_ISREG(st.st_mode) and st.st_uid == _euid() and st.st_size <= limit
        data = _read_exactly(fd, st.st_size) if readable else None
        if data is not None and os.utime in os.supports_fd:
            with contextlib.suppress(OSError):
                os.utime(fd)  # last use, for the least-recently-used eviction
    except OSError:
        return None
    finally:
        os.close(fd)
    parsed = parse_entry(data, key) if data is not None else None
    if parsed is None:
        d.discard(name, st)
    return parsed


def _read_exactly(fd: int, size: int) -> bytes | None:
    """The *size* bytes of *fd*; ``None`` when it holds fewer or more (it changed while
    read: not an entry written by ``os.replace``)."""
    data = bytearray()
    while len(data) <= size and (chunk := os.read(fd, min(size + 1 - len(data), 1 << 24))):
        data += chunk
    return bytes(data) if len(data) == size else None


def parse_entry(data: bytes, key: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    """Split and verify an entry's bytes; ``None`` for anything malformed."""
    first, sep, rest = data.partition(b"\n")
    if not sep or first != _MAGIC + hashlib.sha256(rest).hexdigest().encode():
        return None
    line, sep, payload = rest.partition(b"\n")
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to be ours
        return None
    if not sep or not isinstance(header, dict) or header.get("key") != key:
        return None
    layout = header.get("blobs")
    if not isinstance(layout, list):
        return None
    blobs: dict[str, bytes] = {}
    offset = 0
    for item in layout:
        match item:
            case [str() as name, size] if type(size) is int and size >= 0 and name not in blobs:
                blobs[name] = payload[offset : offset + size]
                offset += size
            case _:
                return None
    return (header, blobs) if offset == len(payload) else None


def encode_entry(key: str, header: dict[str, Any], blobs: dict[str, bytes]) -> bytes:
    """The bytes of an entry (see the module docstring)."""
    head = {**header, "key": key, "blobs": [[n, len(b)] for n, b in blobs.items()]}
    rest = json.dumps(head, sort_keys=True).encode() + b"\n" + b"".join(blobs.values())
    return _MAGIC + hashlib.sha256(rest).hexdigest().encode() + b"\n" + rest


def write_entry(d: CacheDir, key: str, data: bytes) -> bool:
    """Store *data* as the entry of *key* atomically; False (one warning) when not writable."""
    tmp = f".{key[:16]}.{secrets.token_hex(8)}{TMP_SUFFIX}"
    name = key + ENTRY_SUFFIX
    try:
        fd = d.open(tmp, _CREATE_FLAGS)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=d.fd, dst_dir_fd=d.fd)
        except BaseException:
            d.remove(tmp)
            raise
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
            _warn_unusable(d.path, exc)
        else:
            _warn(
                f"ctxkit: {d.path / name} is a directory that is not empty, not a kernel cache "
                "entry; this kernel is compiled without the disk cache until that directory "
                "is removed.",
                once=(d.path / name, "blocked"),
            )
        return False
    return True


def evict(d: CacheDir, max_bytes: int, keep: str = "") -> int:
    """Remove least recently used entries until they total at most *max_bytes*.

    Also removes entries that are not regular files, and the temporary and lock files
    last changed :data:`TMP_MAX_AGE_S` ago or more (left by a dead process; a younger one
    may belong to a process at work). A lock file is also kept while any process holds
    it (a process stopped mid-compile holds it for as long as it is stopped). The entry
    of *keep* (just written) stays. Returns the number of files removed.
    """
    old = time.time_ns() - int(TMP_MAX_AGE_S * 1e9)
    removed = 0
    entries: list[tuple[int, str, int]] = []
    for name, st in d.scan():
        if name.endswith(ENTRY_SUFFIX) and stat.S_ISREG(st.st_mode):
            entries.append((st.st_mtime_ns, name, st.st_size))
        elif name.endswith(ENTRY_SUFFIX) or (st.st_mtime_ns < old and name.endswith(TMP_SUFFIX)):
            removed += d.remove(name)
        elif st.st_mtime_ns < old and name.endswith(LOCK_SUFFIX):
            removed += _remove_unheld_lock(d, name, st)
    total = sum(size for _t, _n, size in entries)
    keep_name = keep + ENTRY_SUFFIX if keep else ""
    for _mtime, name, size in sorted(entries):
        if total <= max_bytes:
            break
        if name != keep_name and d.remove(name):
            removed += 1
            total -= size
    return removed


def clear_entries(d: CacheDir) -> int:
    """Remove every entry and what :func:`evict` says was left behind; return the count."""
    return evict(d, -1)


def _remove_unheld_lock(d: CacheDir, name: str, seen: os.stat_result) -> bool:
    """Unlink the lock file *name* while holding it; False when a process holds it.

    Never opens a lock file that this process holds: closing any descriptor of a file
    drops the process's record locks on it.
    """
    if _file_id(seen) in _held:
        return False
    try:
        fd = d.open(name, _LOCK_FLAGS & ~os.O_CREAT)
    except OSError:
        return False
    try:
        # not replaced since the scan, and no process holds it
        return _file_id(os.fstat(fd)) == _file_id(seen) and _try_lock(fd) and d.remove(name)
    except OSError:
        return False
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    """Take the POSIX record lock of *fd* if no other process holds it (False then).

    A record lock (``lockf``) rather than ``flock``: it belongs to the process, so a
    child forked while a compile runs does not keep it held; it also works on NFS.
    """
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


@contextlib.contextmanager
def process_lock(d: CacheDir, key: str, timeout: float | None = None) -> Iterator[bool]:
    """Hold the lock of *key* against other processes (yields False when not held).

    Waits up to *timeout* seconds (default :data:`LOCK_TIMEOUT_S`) for a process
    compiling the same program, with a warning after :data:`LOCK_WARN_S` (a stopped or
    hung process can hold the lock that long) and another one on giving up; after that,
    or where file locks are unavailable, proceeds without the lock (a duplicate compile,
    never a wrong result). Threads of one process must not ask for the same key at once
    (the in-process lock of :func:`ctxkit.compiler.cache.cached` sees to that).
    """
    name = f".{key}{LOCK_SUFFIX}"
    fd = _acquire(d, name, LOCK_TIMEOUT_S if timeout is None else timeout)
    if fd is None:
        yield False
        return
    held = _file_id(os.fstat(fd))
    _held.add(held)
    try:
        yield True
    finally:
        d.remove(name)  # before unlocking: a waiter on this file sees it is gone
        os.close(fd)
        _held.discard(held)


def _acquire(d: CacheDir, name: str, timeout: float) -> int | None:
    """The lock file *name* opened and locked; ``None`` when it cannot be (not a regular
    file of this user, no file locks here) or after *timeout* seconds of waiting."""
    start = time.monotonic()
    warned = False
    pause = 0.001
    while True:
        try:
            fd = d.open(name, _LOCK_FLAGS)
        except OSError:
            return None
        keep = False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != _euid():
                return None
            while not _try_lock(fd):
                waited = time.monotonic() - start
                if waited >= timeout:
                    _warn(
                        f"ctxkit: gave up after {waited:.1f} s waiting for {d.path / name}, "
                        "the lock of another process compiling the same kernel; compiling it "
                        "here too."
                    )
                    return None
                if waited >= LOCK_WARN_S and not warned:
                    warned = True
                    _warn(
                        f"ctxkit: waiting for {d.path / name} for {waited:.1f} s: another "
                        "process is compiling the same kernel (or is stopped or hung holding "
                        f"its lock); waiting up to {timeout:g} s in all, then compiling it here."
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
            keep = _file_id(d.lstat(name)) == _file_id(st)  # else replaced: lock the new one
            if keep:
                return fd
        except FileNotFoundError:
            continue  # the holder removed it as we locked it: take the next one
        except OSError:
            return None
        finally:
            if not keep:
                os.close(fd)


#: The disk cache's size cap unless ``CTXKIT_CACHE_MAX_BYTES`` says otherwise.
DEFAULT_MAX_BYTES = 1 << 30


DISABLED_VALUES = frozenset({"off", "0", "no", "none", "false", "disable", "disabled"})


FORMAT_VERSION = 2


_MEMO_SIZE = 256


_memo: OrderedDict[tuple[str, str], ObjectCode] = OrderedDict()


_lock = threading.Lock()  # of the memo, the stats and the table of key locks


#: Counters for tests and benchmarks: NVRTC compiles, disk hits, memory hits.
stats = {"compiled": 0, "disk_hits": 0, "memory_hits": 0}


def count(what: str) -> None:
    with _lock:
        stats[what] += 1


def cache_dir() -> Path | None:
    """The kernel cache directory, or ``None`` when ``CTXKIT_CACHE_DIR=off`` disables it.

    ``CTXKIT_CACHE_DIR`` names the directory; unset or empty means ``kernels/`` under the
    user cache directory (``$XDG_CACHE_HOME/ctxkit`` or ``~/.cache/ctxkit`` on Linux).
    """
    env = os.environ
    return _cache_dir(_env.env_text("CTXKIT_CACHE_DIR"), env.get("XDG_CACHE_HOME"), env.get("HOME"))


@lru_cache(maxsize=16)
def _cache_dir(value: str, xdg: str | None, home: str | None) -> Path | None:
    if value.lower() in DISABLED_VALUES:
        return None
    if value:
        return Path(value).expanduser()
    return Path(xdg or Path.home() / ".cache") / "ctxkit" / "kernels"


_SIZE_RE = re.compile(r"^(\d+)\s*([kmgt]?)(?:i?b)?$", re.IGNORECASE)


def max_bytes() -> int:
    """The disk cache's size cap in bytes (``CTXKIT_CACHE_MAX_BYTES``, default 1 GiB).

    Raises
    ------
    ValueError
        The variable is not a positive size such as ``500000000``, ``512M`` or ``2G``.
    """
    value = _env.env_text("CTXKIT_CACHE_MAX_BYTES")
    if not value:
        return DEFAULT_MAX_BYTES
    m = _SIZE_RE.match(value)
    size = int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " ")) if m else 0
    if size <= 0:
        raise ValueError(
            f"CTXKIT_CACHE_MAX_BYTES={value!r} is not a size; use a positive number of bytes, "
            "optionally with K, M or G (e.g. CTXKIT_CACHE_MAX_BYTES=2G), or CTXKIT_CACHE_DIR=off "
            "to disable the disk cache"
        )
    return size


def make_key(parts: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of *parts* plus the entry format version."""
    blob = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")


_WHEEL_LIB_DIRS = tuple(("nvidia", sub, "lib") for sub in ("cu13", "cu12", "cuda_nvrtc"))


_ENV_VARS = ("CUDA_PATH", "CUDA_HOME", "CONDA_PREFIX", "LD_LIBRARY_PATH")


def _candidate_dirs() -> list[str]:
    wheels = [entry for entry in sys.path if entry and os.path.isdir(os.path.join(entry, "nvidia"))]
    dirs = [os.path.join(entry, *parts) for entry in wheels for parts in _WHEEL_LIB_DIRS]
    roots = [os.environ.get(var) for var in ("CONDA_PREFIX", "CUDA_PATH", "CUDA_HOME")]
    dirs += [os.path.join(root, sub) for root in roots if root for sub in ("lib64", "lib")]
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    dirs += ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    dirs += ["/usr/lib64", "/usr/lib"]
    return dirs


@lru_cache(maxsize=1)
def toolchain_fingerprint(nvrtc_version: Callable[[], tuple[int, int]], bindings_major: int) -> str:
    """Identify the NVRTC this process uses, cheaply (see the module docstring)."""
    found = []
    for path in (os.path.join(d, n) for d in _candidate_dirs() for n in _NVRTC_NAMES):
        with contextlib.suppress(OSError):
            st = os.stat(path)
            found.append((path, st.st_size, st.st_mtime_ns))
    env = {v: os.environ.get(v, "") for v in _ENV_VARS}
    ident: Any = {"libs": found, "env": env} if found else {"nvrtc": list(nvrtc_version())}
    return make_key({"bindings_major": bindings_major, "toolchain": ident})


# --- one compile per key ----------------------------------------------------------------


# The in-process lock of each key being compiled, alive while a thread holds or awaits it.
_key_locks: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()


# a lock held by another thread at fork time would never be released in the child
_driver.renew_at_fork(__name__, "_lock")
_driver.renew_at_fork(__name__, "_key_locks", weakref.WeakValueDictionary)


def cached(directory: Path, key: str, build: Callable[[], ObjectCode]) -> ObjectCode:
    """The object of *key*: from memory, else from *directory*, else ``build()`` and store.

    Only one thread of this process, and (where file locks work) one process using
    *directory*, builds a given key at a time; the others wait and take its result.
    """
    slot = (str(directory), key)
    if (obj := _memo_hit(slot)) is not None:
        return obj
    with _lock:
        key_lock = _key_locks.setdefault(slot, threading.Lock())
    with key_lock:
        if (obj := _memo_hit(slot)) is not None:
            return obj
        cap = max_bytes()
        d = open_dir(directory)
        if d is None:
            obj = build()
        else:
            with d, process_lock(d, key):
                entry = read_entry(d, key, cap)
                obj = _decode(*entry) if entry is not None else None
                if obj is not None:
                    count("disk_hits")
                    _memo_put(slot, obj)
                    return obj
                if entry is not None:  # verified, but not an ObjectCode of ours
                    d.discard(key + ENTRY_SUFFIX)
                obj = build()
                data = encode_entry(key, *_encode(obj))
                if len(data) <= cap and write_entry(d, key, data):
                    evict(d, cap, keep=key)
        _memo_put(slot, dataclasses.replace(obj, from_cache=True))
        return obj


#: The header fields of an entry that hold text as they are in :class:`ObjectCode`.
_TEXT_FIELDS = ("target", "arch", "log", "name")


#: The blobs of an entry that hold text (UTF-8), beside the ``code`` blob.
_TEXT_BLOBS = ("ptx", "source")


def _encode(obj: ObjectCode) -> tuple[dict[str, Any], dict[str, bytes]]:
    header = {k: getattr(obj, k) for k in _TEXT_FIELDS}
    header["lowered_names"] = dict(obj.lowered_names)
    header["options"] = list(obj.options)
    header["nvrtc_version"] = list(obj.nvrtc_version or ())
    blobs = {"code": obj.code}
    blobs.update((k, getattr(obj, k).encode()) for k in _TEXT_BLOBS if getattr(obj, k) is not None)
    return header, blobs


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _decode(header: dict[str, Any], blobs: dict[str, bytes]) -> ObjectCode | None:
    """The :class:`ObjectCode` of a verified entry, or ``None`` when any field is off."""
    fields: dict[str, Any] = {k: header.get(k) for k in _TEXT_FIELDS}
    lowered, options, version = map(header.get, ("lowered_names", "options", "nvrtc_version"))
    code = blobs.get("code")
    if not (isinstance(lowered, dict) and _strings(options) and isinstance(version, list) and code):
        return None
    if not _strings([*fields.values(), *lowered, *lowered.values()]) or not (
        len(version) in (0, 2) and all(type(v) is int for v in version)
    ):
        return None
    try:
        if detect_target(code) != fields["target"]:
            return None
        texts = {k: blobs[k].decode("utf-8") for k in _TEXT_BLOBS if k in blobs}
    except (ValueError, UnicodeDecodeError):
        return None
    return ObjectCode(
        code=code,
        lowered_names=dict(lowered),
        options=tuple(options),  # type: ignore[arg-type]
        nvrtc_version=(version[0], version[1]) if version else None,
        from_cache=True,
        **fields,
        **texts,
    )


def clear_cache() -> int:
    """Empty the in-memory and on-disk kernel caches; returns the number of files removed."""
    with _lock:
        _memo.clear()
    directory = cache_dir()
    d = open_dir(directory, create=False) if directory is not None and directory.is_dir() else None
    if d is None:
        return 0
    with d:
        return clear_entries(d)


def _memo_hit(slot: tuple[str, str]) -> ObjectCode | None:
    """The object memoised for *slot* in this process, counted as a memory hit."""
    with _lock:
        obj = _memo.get(slot)
        if obj is not None:
            _memo.move_to_end(slot)
            stats["memory_hits"] += 1
        return obj


def _memo_put(slot: tuple[str, str], obj: ObjectCode) -> None:
    """Remember *obj* for *slot* (least recently used objects are dropped)."""
    with _lock:
        _memo[slot] = obj
        _memo.move_to_end(slot)
        while len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
