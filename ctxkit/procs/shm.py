"""POSIX shared-memory blocks that carry large buffers between ``ctxkit.procs`` processes.

A block is a file in ``/dev/shm`` (tmpfs). Creating a file of N bytes there reserves
nothing: tmpfs finds a page on the first write to it, and a write it cannot back kills
the writer with SIGBUS (Docker's default ``/dev/shm`` is 64 MiB). So every block is
reserved whole with ``posix_fallocate`` before a byte is written, and :func:`create`
returns ``None`` when there is no room; the caller then sends the buffer through the
pipe.

Names are ``<prefix>-<random>``. A process's prefix is ``ctxkit-<pid>-<random>``; a child
gets ``<parent prefix>.<k>`` from its parent, so when the parent reaps a child it can
remove what the child left behind (killed while sending a result): :func:`sweep`.

``/dev/shm`` is shared by every user, so a name may already be taken by another process
(by chance or by one squatting the names it sees there). A block is only ever made with
``O_CREAT | O_EXCL`` under a fresh random name, retried with new names; when all are
taken the buffer goes through the pipe with a :class:`RuntimeWarning`. A receiver opens a
block by name only if it is the very block its sender made (same inode, or same random
token where there is no ``/dev/shm``): a name unlinked and re-made by someone else raises
:class:`BlockIdentityError` and is left alone.

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
import warnings
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from ..errors import BlockIdentityError

__all__ = [
    "attach",
    "child_prefix",
    "create",
    "discard",
    "prefix",
    "space",
    "sweep",
]


_SHM_DIR = "/dev/shm"
_NAME_ATTEMPTS = 4
_TOKEN_BYTES = 8  # the identity token at the start of a portable block

#: A block as a message names it: ``(name, size, key)``; *key* is the inode of the
#: ``/dev/shm`` file, or the random token at the start of a portable block.
Block = tuple[str, int, int]
#: Entry of a message's buffer list: a block or the bytes themselves.
Part = Block | bytearray


class _Names:
    """This process's prefix and counters (renewed after ``fork``: new pid, new names)."""

    def __init__(self, base: str | None = None) -> None:
        self.pid = os.getpid()
        self.base = base or f"ctxkit-{self.pid}-{secrets.token_hex(3)}"
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


def _fresh_name() -> str:
    """A block name of this process that nobody can guess (64 random bits)."""
    return f"{_current().base}-{secrets.token_hex(8)}"


def space() -> tuple[int, int]:
    """``(free, total)`` bytes of ``/dev/shm``; ``(0, 0)`` where there is none."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def create(raw: memoryview) -> Block | None:
    """A new block holding a copy of *raw* (a contiguous byte view).

    ``None`` when ``/dev/shm`` cannot hold it (``ENOSPC`` from the reservation, or no
    usable shared memory at all), or, with a :class:`RuntimeWarning`, when every fresh
    name tried was already taken: send the bytes through the pipe instead.
    """
    portable = not os.path.isdir(_SHM_DIR)
    for _ in range(_NAME_ATTEMPTS):
        name = _fresh_name()
        try:
            return _create_portable(name, raw) if portable else _create_file(name, raw)
        except FileExistsError:
            continue
    warnings.warn(
        f"ctxkit.procs: {_NAME_ATTEMPTS} fresh shared-memory names "
        f"{_SHM_DIR}/{prefix()}-<random> were all taken by another process; "
        f"{raw.nbytes} bytes go through the pipe instead (slower). Another process may be "
        f"squatting names in {_SHM_DIR}",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _create_file(name: str, raw: memoryview) -> Block | None:
    """Make block *name* in ``/dev/shm`` (``FileExistsError`` if the name is taken)."""
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise
    except OSError:
        return None
    try:
        _track(name)
        try:
            os.posix_fallocate(fd, 0, raw.nbytes)
        except OSError as exc:
            _unlink(name, path)
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EOPNOTSUPP):
                return None
            raise
        try:
            with mmap.mmap(fd, raw.nbytes) as mapped:
                mapped[:] = raw
        except BaseException:
            _unlink(name, path)
            raise
        return name, raw.nbytes, os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _create_portable(name: str, raw: memoryview) -> Block | None:
    try:
        shm = shared_memory.SharedMemory(name=name, create=True, size=_TOKEN_BYTES + raw.nbytes)
    except FileExistsError:
        raise
    except OSError:
        return None
    token = secrets.randbits(8 * _TOKEN_BYTES)
    try:
        shm.buf[:_TOKEN_BYTES] = token.to_bytes(_TOKEN_BYTES, "little")  # type: ignore[index]
        shm.buf[_TOKEN_BYTES : _TOKEN_BYTES + raw.nbytes] = raw  # type: ignore[index]
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    return name, raw.nbytes, token


def attach(name: str, size: int, key: int) -> Any:
    """Map block *name* and unlink it: a writable buffer that owns the memory.

    With ``/dev/shm`` the mapping itself is the buffer (no copy); elsewhere the block is
    copied into a ``bytearray``. Raises :class:`BlockIdentityError` when the name holds
    another block than the one its sender made (*size*, *key*).
    """
    path = os.path.join(_SHM_DIR, name)
    if not os.path.isdir(_SHM_DIR):
        return _attach_copy(name, size, key)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except PermissionError as exc:  # ours is always open to us
        raise _not_the_block(name, size) from exc
    try:
        st = os.fstat(fd)
        if st.st_ino != key or st.st_size != size:
            raise _not_the_block(name, size)
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    os.unlink(path)
    _untrack(name)
    return mapped


def _attach_copy(name: str, size: int, key: int) -> bytearray:
    shm = shared_memory.SharedMemory(name=name)
    try:
        if not _holds(shm, size, key):
            _untrack(name)  # opening it registered the name; it is not ours to remove
            raise _not_the_block(name, size)
        out = bytearray(shm.buf[_TOKEN_BYTES : _TOKEN_BYTES + size])  # type: ignore[index]
        shm.unlink()
    finally:
        shm.close()
    return out


def _holds(shm: shared_memory.SharedMemory, size: int, key: int) -> bool:
    return (
        shm.size >= _TOKEN_BYTES + size
        and int.from_bytes(
            shm.buf[:_TOKEN_BYTES],  # type: ignore[index]
            "little",
        )
        == key
    )


def _not_the_block(name: str, size: int) -> BlockIdentityError:
    return BlockIdentityError(
        f"shared-memory block {name!r} ({size} bytes) is not the block its sender made: "
        "the name was removed and re-created by another process. It was not read; the "
        "message that named it is lost"
    )


def discard(parts: Iterable[Part]) -> None:
    """Unlink the blocks among *parts* (their receiver died or will never read them)."""
    for part in parts:
        if isinstance(part, tuple):
            _remove(*part)


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


def _remove(name: str, size: int, key: int) -> None:
    """Unlink a block this process created or received. A name already gone is left
    alone (its receiver mapped it and untracked it), and so is another block at its name."""
    if not os.path.isdir(_SHM_DIR):
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            return
        try:
            if _holds(shm, size, key):
                shm.unlink()  # unlink() also untracks
            else:
                _untrack(name)
        finally:
            shm.close()
        return
    path = os.path.join(_SHM_DIR, name)
    try:
        if os.stat(path, follow_symlinks=False).st_ino != key:
            return
        os.unlink(path)
    except FileNotFoundError:
        return
    _untrack(name)


def _unlink(name: str, path: str) -> None:
    """Remove a block this process has just made, before anyone else knows its name."""
    os.unlink(path)
    _untrack(name)


def _track(name: str) -> None:
    with contextlib.suppress(Exception):
        resource_tracker.register("/" + name, "shared_memory")


def _untrack(name: str) -> None:
    with contextlib.suppress(Exception):
        resource_tracker.unregister("/" + name, "shared_memory")
