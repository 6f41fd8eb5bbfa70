"""On-disk cache of compiled kernels (used by :func:`ctxkit.compile`).

An entry is one file ``<key>.ctxobj``::

    CTXKIT1 <sha256 of everything after this line>\n
    <header: one line of JSON>\n
    <payload: the blobs named in the header, back to back>

Nothing is ever unpickled. The digest is verified on every read: a truncated, corrupted
or tampered entry is deleted and reported as a miss, so the caller recompiles. Entries
are written to a private temporary file and moved into place with ``os.replace``, so
readers in other processes see either no entry or a complete one, and several
processes compiling the same program at once simply race to write identical files.

The key must change whenever the compiled output could. Its NVRTC part is a
*fingerprint* of the NVRTC libraries this process would load (path, size and mtime of
each candidate), computed with a few ``stat`` calls: loading NVRTC to ask its version
costs ~10 ms, which would dominate a warm cache hit. Where no candidate library is
found, the fingerprint falls back to the NVRTC version itself.

The counters in :data:`stats` (NVRTC compiles, disk and memory hits) serve tests and
benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from .objectcode import ObjectCode

__all__ = [
    "DISABLED_VALUES",
    "cache_dir",
    "clear",
    "clear_cache",
    "file_fingerprint",
    "make_key",
    "memo_get",
    "memo_put",
    "read_entry",
    "toolchain_fingerprint",
    "write_entry",
]


def _cache_lookup(directory: Path, key: str) -> ObjectCode | None:
    obj = memo_get(directory, key)
    if obj is not None:
        _count("memory_hits")
        return obj  # type: ignore[no-any-return]
    entry = read_entry(directory, key)
    if entry is None:
        return None
    header, blobs = entry
    try:
        obj = ObjectCode(
            code=blobs["code"],
            target=header["target"],
            arch=header["arch"],
            log=header["log"],
            ptx=blobs["ptx"].decode() if "ptx" in blobs else None,
            lowered_names=dict(header["lowered_names"]),
            name=header["name"],
            options=tuple(header["options"]),
            nvrtc_version=tuple(header["nvrtc_version"]),  # type: ignore[arg-type]
            from_cache=True,
        )
    except (KeyError, TypeError, ValueError):
        return None
    _count("disk_hits")
    memo_put(directory, key, obj)
    return obj


def _cache_store(directory: Path, key: str, obj: ObjectCode) -> None:
    header = {
        "target": obj.target,
        "arch": obj.arch,
        "log": obj.log,
        "lowered_names": dict(obj.lowered_names),
        "name": obj.name,
        "options": list(obj.options),
        "nvrtc_version": list(obj.nvrtc_version or ()),
    }
    blobs = {"code": obj.code}
    if obj.ptx is not None:
        blobs["ptx"] = obj.ptx.encode()
    write_entry(directory, key, header, blobs)
    memo_put(directory, key, dataclasses.replace(obj, from_cache=True))


def clear_cache() -> int:
    """Empty the in-memory and on-disk kernel caches; returns the number of files removed."""
    return clear()


_stats_lock = threading.Lock()

#: Counters for tests and benchmarks: NVRTC compiles, disk hits, memory hits.
stats = {"compiled": 0, "disk_hits": 0, "memory_hits": 0}


def _count(what: str) -> None:
    with _stats_lock:
        stats[what] += 1


ENV = "CTXKIT_CACHE_DIR"


DISABLED_VALUES = frozenset({"off", "0", "no", "none", "false", "disable", "disabled"})


FORMAT_VERSION = 1


_MAGIC = b"CTXKIT1 "


_SUFFIX = ".ctxobj"


_MEMO_SIZE = 256


_memo: OrderedDict[tuple[str, str], Any] = OrderedDict()


_memo_lock = threading.Lock()


_warned_unwritable = False


def _default_root() -> Path:
    home = Path.home()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return Path(base) / "ctxkit" / "Cache"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "ctxkit"
    return Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "ctxkit"


def cache_dir() -> Path | None:
    """The kernel cache directory, or ``None`` when ``CTXKIT_CACHE_DIR=off`` disables it.

    ``CTXKIT_CACHE_DIR`` names the directory; unset or empty means ``kernels/`` under the
    user cache directory (``$XDG_CACHE_HOME/ctxkit`` or ``~/.cache/ctxkit`` on Linux).
    """
    value = os.environ.get(ENV, "").strip()
    if value.lower() in DISABLED_VALUES:
        return None
    if value:
        return Path(value).expanduser()
    return _default_root() / "kernels"


def make_key(parts: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of *parts* plus the entry format version."""
    blob = json.dumps(
        {"format": FORMAT_VERSION, **parts}, sort_keys=True, separators=(",", ":")
    ).encode()
    return hashlib.sha256(blob).hexdigest()


_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")


_WHEEL_LIB_DIRS = (
    ("nvidia", "cu13", "lib"),
    ("nvidia", "cu12", "lib"),
    ("nvidia", "cuda_nvrtc", "lib"),
)


_ENV_VARS = ("CUDA_PATH", "CUDA_HOME", "CONDA_PREFIX", "LD_LIBRARY_PATH")


def _candidate_dirs() -> list[str]:
    dirs: list[str] = []
    for entry in sys.path:
        if entry and os.path.isdir(os.path.join(entry, "nvidia")):
            dirs.extend(os.path.join(entry, *parts) for parts in _WHEEL_LIB_DIRS)
    for var in ("CONDA_PREFIX", "CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root:
            dirs += [os.path.join(root, "lib64"), os.path.join(root, "lib")]
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    dirs += ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    dirs += ["/usr/lib64", "/usr/lib"]
    return dirs


def _stat_candidates(dirs: Iterable[str]) -> list[tuple[str, int, int]]:
    found = []
    for d in dirs:
        for name in _NVRTC_NAMES:
            path = os.path.join(d, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.append((path, st.st_size, st.st_mtime_ns))
    return found


@lru_cache(maxsize=1)
def toolchain_fingerprint(nvrtc_version: Callable[[], tuple[int, int]], bindings_major: int) -> str:
    """Identify the NVRTC this process uses, cheaply (see the module docstring)."""
    found = _stat_candidates(_candidate_dirs())
    if found:
        env = {v: os.environ.get(v, "") for v in _ENV_VARS}
        ident: Any = {"libs": found, "env": env}
    else:
        ident = {"nvrtc": list(nvrtc_version())}
    return make_key({"bindings_major": bindings_major, "toolchain": ident})


_HEADER_SUFFIXES = frozenset(
    {"", ".h", ".hh", ".hpp", ".hxx", ".cuh", ".inl", ".inc", ".ipp", ".tcc", ".cu", ".def"}
)


def file_fingerprint(dirs: Iterable[str], limit: int = 2000) -> list[Any]:
    """``(relative path, size, mtime)`` of the files under each include directory.

    A header edited in an include directory changes the key; only header-like files
    count (``.h``, ``.cuh``, ``.hpp``, ``.cu``..., or no suffix), so compiler outputs
    written there do not. Hidden directories are skipped and at most *limit* entries
    are visited per directory, so a huge tree costs a bounded number of ``stat`` calls
    (edits past the limit go unseen).
    """
    out: list[Any] = []
    for d in dirs:
        files: list[tuple[str, int, int]] = []
        visited = 0
        for root, subdirs, names in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if not s.startswith(".") and s != "__pycache__")
            visited += len(subdirs)
            for name in sorted(names):
                visited += 1
                if os.path.splitext(name)[1].lower() not in _HEADER_SUFFIXES:
                    continue
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                files.append(
                    (os.path.relpath(os.path.join(root, name), d), st.st_size, st.st_mtime_ns)
                )
                if visited >= limit:
                    break
            if visited >= limit:
                break
        out.append([os.path.abspath(d), files])
    return out


def _entry_path(directory: Path, key: str) -> Path:
    return directory / f"{key}{_SUFFIX}"


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def read_entry(directory: Path, key: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    """The verified ``(header, blobs)`` of *key*, or ``None`` (missing or discarded)."""
    path = _entry_path(directory, key)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    parsed = _parse(data, key)
    if parsed is None:
        _discard(path)
    return parsed


def _parse(data: bytes, key: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
    first, sep, rest = data.partition(b"\n")
    if not sep or not first.startswith(_MAGIC):
        return None
    digest = first[len(_MAGIC) :].decode("ascii", "replace")
    if hashlib.sha256(rest).hexdigest() != digest:
        return None
    line, sep, payload = rest.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        return None
    if not sep or not isinstance(header, dict) or header.get("key") != key:
        return None
    blobs: dict[str, bytes] = {}
    offset = 0
    for name, size in header.get("blobs", []):
        blobs[name] = payload[offset : offset + size]
        offset += size
    if offset != len(payload):
        return None
    return header, blobs


def write_entry(directory: Path, key: str, header: dict[str, Any], blobs: dict[str, bytes]) -> bool:
    """Store an entry atomically; False (and one warning per process) when not writable."""
    head = {**header, "key": key, "blobs": [[n, len(b)] for n, b in blobs.items()]}
    rest = json.dumps(head, sort_keys=True).encode() + b"\n" + b"".join(blobs.values())
    data = _MAGIC + hashlib.sha256(rest).hexdigest().encode() + b"\n" + rest
    try:
        _ensure_dir(directory)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, _entry_path(directory, key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        _warn_unwritable(directory, exc)
        return False
    return True


def _ensure_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)


def _warn_unwritable(directory: Path, exc: OSError) -> None:
    global _warned_unwritable
    if _warned_unwritable:
        return
    _warned_unwritable = True
    warnings.warn(
        f"ctxkit: cannot write the kernel cache in {directory} ({exc}); compiled kernels "
        f"are not cached on disk. Set {ENV} to a writable directory, or to 'off'.",
        RuntimeWarning,
        stacklevel=4,
    )


def clear(directory: Path | None = None) -> int:
    """Delete every entry (and leftover temporary file); return how many were removed."""
    with _memo_lock:
        _memo.clear()
    directory = directory if directory is not None else cache_dir()
    if directory is None or not directory.is_dir():
        return 0
    removed = 0
    for path in directory.iterdir():
        if path.suffix in (_SUFFIX, ".tmp") and path.is_file():
            _discard(path)
            removed += 1
    return removed


def memo_get(directory: Path, key: str) -> Any:
    """The object memoised for *key* in this process (``None`` when absent)."""
    with _memo_lock:
        value = _memo.get((str(directory), key))
        if value is not None:
            _memo.move_to_end((str(directory), key))
        return value


def memo_put(directory: Path, key: str, value: Any) -> None:
    """Remember *value* for *key* (least recently used entries are dropped)."""
    with _memo_lock:
        _memo[(str(directory), key)] = value
        _memo.move_to_end((str(directory), key))
        while len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
