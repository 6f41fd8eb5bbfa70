"""POSIX shared-memory blocks that carry large buffers between ``ctxkit.procs`` processes.

A block is a file in ``/dev/shm`` (tmpfs). Creating a file of N bytes there reserves
nothing: tmpfs finds a page on the first write to it, and a write it cannot back kills
the writer with SIGBUS (Docker's default ``/dev/shm`` is 64 MiB). So every block is
reserved whole with ``posix_fallocate`` before a byte is written, and :func:`create`
returns ``None`` when there is no room; the caller then sends the buffer through the
pipe.

Names are ``<prefix>-<n>``. A process's prefix is ``ctxkit-<pid>-<random>``; a child
gets ``<parent prefix>.<k>`` from its parent, so when the parent reaps a child it can
remove what the child left behind (killed while sending a result): :func:`sweep`.

Blocks are registered with multiprocessing's resource tracker, which every spawned
child shares with its parent: a block still named when the last of them exits is
unlinked by the tracker.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import secrets
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

__all__ = ["attach", "child_prefix", "create", "discard", "prefix", "space", "sweep"]


_SHM_DIR = "/dev/shm"


#: Entry of a message's buffer list: a block ``(name, size)`` or the bytes themselves.
Part = tuple[str, int] | bytearray


class _Names:
    """This process's prefix and counters (renewed after ``fork``: new pid, new names)."""

    def __init__(self, base: str | None = None) -> None:
        self.pid = os.getpid()
        self.base = base or f"ctxkit-{self.pid}-{secrets.token_hex(3)}"
        self.blocks = itertools.count()
        self.children = itertools.count()


_names = _Names()


def _current() -> _Names:
    global _names
    if _names.pid != os.getpid():
        _names = _Names()
    return _names


def prefix() -> str:
    """The name prefix of this process's blocks (and of its children's: ``prefix.k``)."""
    return _current().base


def set_prefix(base: str) -> None:
    """Adopt the prefix a parent chose for this child (first thing a child does)."""
    global _names
    _names = _Names(base)


def child_prefix() -> str:
    """A fresh prefix for the next child this process starts."""
    names = _current()
    return f"{names.base}.{next(names.children)}"


def space() -> tuple[int, int]:
    """``(free, total)`` bytes of ``/dev/shm``; ``(0, 0)`` where there is none."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def create(raw: memoryview) -> str | None:
    """A new block holding a copy of *raw* (a contiguous byte view); its name.

    ``None`` when ``/dev/shm`` cannot hold it (``ENOSPC`` from the reservation, or no
    usable shared memory at all): send the bytes through the pipe instead.
    """
    names = _current()
    name = f"{names.base}-{next(names.blocks)}"
    if not os.path.isdir(_SHM_DIR):
        return _create_portable(name, raw)
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    try:
        _track(name)
        try:
            os.posix_fallocate(fd, 0, raw.nbytes)
        except OSError as exc:
            _remove(name, path)
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EOPNOTSUPP):
                return None
            raise
        try:
            with mmap.mmap(fd, raw.nbytes) as mapped:
                mapped[:] = raw
        except BaseException:
            _remove(name, path)
            raise
    finally:
        os.close(fd)
    return name


def _create_portable(name: str, raw: memoryview) -> str | None:
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=raw.nbytes)
    except OSError:
        return None
    try:
        shm.buf[: raw.nbytes] = raw  # type: ignore[index]
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    return name


def attach(name: str, size: int) -> Any:
    """Map block *name* and unlink it: a writable buffer that owns the memory.

    With ``/dev/shm`` the mapping itself is the buffer (no copy); elsewhere the block is
    copied into a ``bytearray``.
    """
    path = os.path.join(_SHM_DIR, name)
    if not os.path.isdir(_SHM_DIR):
        return _attach_copy(name, size)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    os.unlink(path)
    _untrack(name)
    return mapped


def _attach_copy(name: str, size: int) -> bytearray:
    shm = shared_memory.SharedMemory(name=name)
    try:
        out = bytearray(shm.buf[:size])  # type: ignore[index]
    finally:
        shm.close()
        shm.unlink()
    return out


def discard(parts: Iterable[Part]) -> None:
    """Unlink the blocks among *parts* (their receiver died or will never read them)."""
    for part in parts:
        if isinstance(part, tuple):
            _remove(part[0], os.path.join(_SHM_DIR, part[0]))


def sweep(child: str) -> int:
    """Unlink every block a child with prefix *child* (and its own children) left behind.

    Call it once the child has been reaped and its messages consumed. Returns how many
    blocks were removed.
    """
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return 0
    left = [e for e in entries if e.startswith((child + "-", child + "."))]
    for name in left:
        _track(name)  # balances the untrack below whether or not the child had tracked it
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except OSError:
            pass
        _untrack(name)
    return len(left)


def _remove(name: str, path: str) -> None:
    """Unlink a block this process created or received; a name already gone is left alone
    (its receiver mapped it and untracked it)."""
    if not os.path.isdir(_SHM_DIR):
        with contextlib.suppress(FileNotFoundError):
            shared_memory.SharedMemory(name=name).unlink()  # unlink() also untracks
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    _untrack(name)


def _track(name: str) -> None:
    with contextlib.suppress(Exception):
        resource_tracker.register("/" + name, "shared_memory")


def _untrack(name: str) -> None:
    with contextlib.suppress(Exception):
        resource_tracker.unregister("/" + name, "shared_memory")
