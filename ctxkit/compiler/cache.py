"""The kernel cache used by :func:`ctxkit.compile`: in memory, then on disk.

Where: ``CTXKIT_CACHE_DIR``, else ``kernels/`` under the user cache directory
(``$XDG_CACHE_HOME/ctxkit`` or ``~/.cache/ctxkit`` on Linux); ``CTXKIT_CACHE_DIR=off``
disables it. The directory must belong to the user, be closed to group and others and
be reached through no other user's symbolic link; otherwise ctxkit warns once and
compiles without the disk cache (see
:mod:`ctxkit.compiler.entries`, which also describes the file format).

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import entries
from .objectcode import ObjectCode, detect_target

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DISABLED_VALUES",
    "ENV",
    "MAX_BYTES_ENV",
    "cache_dir",
    "cached",
    "clear",
    "clear_cache",
    "make_key",
    "max_bytes",
    "memo_get",
    "memo_put",
    "stats",
    "toolchain_fingerprint",
]


ENV = "CTXKIT_CACHE_DIR"


MAX_BYTES_ENV = "CTXKIT_CACHE_MAX_BYTES"


#: The disk cache's size cap unless ``CTXKIT_CACHE_MAX_BYTES`` says otherwise.
DEFAULT_MAX_BYTES = 1 << 30


DISABLED_VALUES = frozenset({"off", "0", "no", "none", "false", "disable", "disabled"})


FORMAT_VERSION = 2


_MEMO_SIZE = 256


_memo: OrderedDict[tuple[str, str], Any] = OrderedDict()


_memo_lock = threading.Lock()


_stats_lock = threading.Lock()


#: Counters for tests and benchmarks: NVRTC compiles, disk hits, memory hits.
stats = {"compiled": 0, "disk_hits": 0, "memory_hits": 0}


def _count(what: str) -> None:
    with _stats_lock:
        stats[what] += 1


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
    env = os.environ
    return _cache_dir(env.get(ENV, ""), env.get("XDG_CACHE_HOME"), env.get("HOME"))


@lru_cache(maxsize=16)
def _cache_dir(value: str, xdg: str | None, home: str | None) -> Path | None:
    value = value.strip()
    if value.lower() in DISABLED_VALUES:
        return None
    if value:
        return Path(value).expanduser()
    return _default_root() / "kernels"


_SIZE_RE = re.compile(r"^(\d+)\s*([kmgt]?)(?:i?b)?$", re.IGNORECASE)


def max_bytes() -> int:
    """The disk cache's size cap in bytes (``CTXKIT_CACHE_MAX_BYTES``, default 1 GiB).

    Raises
    ------
    ValueError
        The variable is not a positive size such as ``500000000``, ``512M`` or ``2G``.
    """
    value = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_BYTES
    m = _SIZE_RE.match(value)
    size = int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " ")) if m else 0
    if size <= 0:
        raise ValueError(
            f"{MAX_BYTES_ENV}={value!r} is not a size; use a positive number of bytes, "
            f"optionally with K, M or G (e.g. {MAX_BYTES_ENV}=2G), or {ENV}=off to "
            "disable the disk cache"
        )
    return size


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


# --- one compile per key ----------------------------------------------------------------


_key_locks: dict[tuple[str, str], list[Any]] = {}


_key_locks_lock = threading.Lock()


@contextlib.contextmanager
def _key_lock(slot: tuple[str, str]) -> Iterator[None]:
    with _key_locks_lock:
        held = _key_locks.setdefault(slot, [threading.Lock(), 0])
        held[1] += 1
    try:
        with held[0]:
            yield
    finally:
        with _key_locks_lock:
            held[1] -= 1
            if held[1] == 0 and _key_locks.get(slot) is held:
                del _key_locks[slot]


def _after_fork_in_child() -> None:
    # a lock held by another thread at fork time would never be released in the child
    global _key_locks_lock, _memo_lock, _stats_lock
    _key_locks.clear()
    _key_locks_lock = threading.Lock()
    _memo_lock = threading.Lock()
    _stats_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cached(directory: Path, key: str, build: Callable[[], ObjectCode]) -> ObjectCode:
    """The object of *key*: from memory, else from *directory*, else ``build()`` and store.

    Only one thread of this process, and (where file locks work) one process using
    *directory*, builds a given key at a time; the others wait and take its result.
    """
    slot = (str(directory), key)
    obj = memo_get(directory, key)
    if obj is not None:
        _count("memory_hits")
        return obj  # type: ignore[no-any-return]
    with _key_lock(slot):
        obj = memo_get(directory, key)
        if obj is not None:
            _count("memory_hits")
            return obj  # type: ignore[no-any-return]
        cap = max_bytes()
        d = entries.open_dir(directory)
        if d is None:
            obj = build()
        else:
            with d, entries.process_lock(d, key):
                obj = _load(d, key, cap)
                if obj is not None:
                    _count("disk_hits")
                    memo_put(directory, key, obj)
                    return obj
                obj = build()
                _store(d, key, obj, cap)
        memo_put(directory, key, dataclasses.replace(obj, from_cache=True))
        return obj


def _load(d: entries.CacheDir, key: str, cap: int) -> ObjectCode | None:
    entry = entries.read_entry(d, key, cap)
    if entry is None:
        return None
    obj = _decode(*entry)
    if obj is None:
        d.discard(f"{key}{entries.ENTRY_SUFFIX}")
    return obj


def _store(d: entries.CacheDir, key: str, obj: ObjectCode, cap: int) -> None:
    data = entries.encode(key, *_encode(obj))
    if len(data) <= cap and entries.write_entry(d, key, data):
        entries.evict(d, cap, keep=key)


def _encode(obj: ObjectCode) -> tuple[dict[str, Any], dict[str, bytes]]:
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
    if obj.source is not None:
        blobs["source"] = obj.source.encode()
    return header, blobs


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _decode(header: dict[str, Any], blobs: dict[str, bytes]) -> ObjectCode | None:
    """The :class:`ObjectCode` of a verified entry, or ``None`` when any field is off."""
    text = [header.get(k) for k in ("target", "arch", "log", "name")]
    lowered = header.get("lowered_names")
    options = header.get("options")
    version = header.get("nvrtc_version")
    code = blobs.get("code")
    if not (
        all(isinstance(v, str) for v in text)
        and isinstance(lowered, dict)
        and _strings(list(lowered))
        and _strings(list(lowered.values()))
        and _strings(options)
        and isinstance(version, list)
        and len(version) in (0, 2)
        and all(type(v) is int for v in version)
        and code
    ):
        return None
    target, arch, log, name = text
    try:
        if detect_target(code) != target:
            return None
        ptx = blobs["ptx"].decode("utf-8") if "ptx" in blobs else None
        source = blobs["source"].decode("utf-8") if "source" in blobs else None
    except (ValueError, UnicodeDecodeError):
        return None
    return ObjectCode(
        code=code,
        target=target,  # type: ignore[arg-type]
        arch=arch,  # type: ignore[arg-type]
        log=log,  # type: ignore[arg-type]
        ptx=ptx,
        lowered_names=dict(lowered),
        name=name,  # type: ignore[arg-type]
        options=tuple(options),  # type: ignore[arg-type]
        nvrtc_version=(version[0], version[1]) if version else None,
        from_cache=True,
        source=source,
    )


def clear_cache() -> int:
    """Empty the in-memory and on-disk kernel caches; returns the number of files removed."""
    return clear()


def clear(directory: Path | None = None) -> int:
    """Delete every entry (and leftover temporary file); return how many were removed."""
    with _memo_lock:
        _memo.clear()
    directory = directory if directory is not None else cache_dir()
    if directory is None or not directory.is_dir():
        return 0
    d = entries.open_dir(directory, create=False)
    if d is None:
        return 0
    with d:
        return entries.clear(d)


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
