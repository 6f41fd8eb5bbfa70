"""What travels between a ``ctxkit.procs`` parent and its children, and how.

Objects are pickled with protocol 5. Out-of-band buffers (contiguous numpy arrays,
bytearrays) of at least ``threshold`` bytes travel in shared-memory blocks
(below), one block each, and the message carries their names; a buffer for which
``/dev/shm`` has no room goes through the pipe instead. The receiver maps a block and
unlinks its name at once (the mapping lives on as the array's memory).

Functions a spawned child cannot import (lambdas, closures, functions typed into a
notebook, a REPL or ``python -c``) are pickled **by value** with cloudpickle when it is
installed (the ``cloudpickle`` extra), imported only then.

Device buffers and arrays never travel as bytes: the pickler replaces each with a
:class:`~ctxkit.procs.devmem.DeviceRef` (a CUDA IPC handle) through the sending side's
session, and the receiving side's session turns it back into memory (:mod:`.devmem`).

A child's exception travels as plain data (:func:`describe_exception`), so one that
cannot be pickled, or whose ``__str__`` raises, is still reported.

:func:`traffic` counts, per process, the bytes that went through pipes and shared
memory and the device memory that was shared instead of copied.

**Shared-memory blocks** carry large buffers between ``ctxkit.procs`` processes.

A block is a file in ``/dev/shm`` (tmpfs). Creating a file of N bytes there reserves
nothing: tmpfs finds a page on the first write to it, and a write it cannot back kills
the writer with SIGBUS (Docker's default ``/dev/shm`` is 64 MiB). So every block is
reserved whole with ``posix_fallocate`` before a byte is written, and :func:`create_block`
returns ``None`` when there is no room (or no ``/dev/shm``: ctxkit runs on Linux, where
``shm_open`` works only there); the caller then sends the buffer through the pipe.

Names are ``<prefix>-<random>``. A process's prefix is ``ctxkit-<pid>-<random>``; a child
gets ``<parent prefix>.<k>`` from its parent, so when the parent reaps a child it can
remove what the child left behind (killed while sending a result): :func:`sweep_blocks`.

``/dev/shm`` is shared by every user, so a name may already be taken by another process
(by chance or by one squatting the names it sees there). A block is only ever made with
``O_CREAT | O_EXCL`` under a fresh random name, retried with new names; when all are
taken the buffer goes through the pipe with a :class:`RuntimeWarning`. A receiver opens a
block by name only if it is the very block its sender made (same inode and size): a name
unlinked and re-made by someone else raises :class:`BlockIdentityError` and is left alone.

The blocks are files of ``/dev/shm`` rather than ``multiprocessing.shared_memory``
objects because that class can neither reserve the pages first nor say which inode it
opened (both would need its private file descriptor).

Blocks are registered with multiprocessing's resource tracker, which every spawned
child shares with its parent: a block still named when the last of them exits is
unlinked by the tracker.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import itertools
import mmap
import os
import pickle
import secrets
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from multiprocessing import process, resource_tracker
from typing import Any

from .. import _driver
from ..errors import BlockIdentityError, CudaError, DeviceTaskError
from . import devmem

#: Buffers at least this large travel through shared memory (see ``procs`` for numbers).
SHM_THRESHOLD = 1 << 20


# --- shared-memory blocks -------------------------------------------------------------

_SHM_DIR = "/dev/shm"
_NAME_ATTEMPTS = 4
#: ``errno`` of a reservation ``/dev/shm`` cannot back: the buffer goes through the pipe.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EOPNOTSUPP})

#: A block as a message names it: ``(name, size, key)``; *key* is the inode of the
#: ``/dev/shm`` file (a name re-made by someone else has another).
Block = tuple[str, int, int]
#: Entry of a message's buffer list: a block or the bytes themselves.
Part = Block | bytearray


class _Names:
    """This process's prefix and the count of its children (a forked child gets new
    ones: new pid, new names)."""

    def __init__(self, base: str | None = None) -> None:
        self.base = base or f"ctxkit-{os.getpid()}-{secrets.token_hex(3)}"
        self.children = itertools.count()


_names = _Names()
_driver.renew_at_fork(__name__, "_names", _Names)


def shm_prefix() -> str:
    """The name prefix of this process's blocks (and of its children's: ``prefix.k``)."""
    return _names.base


def set_shm_prefix(base: str) -> None:
    """Adopt the prefix a parent chose for this child (first thing a child does)."""
    global _names
    _names = _Names(base)


def child_shm_prefix() -> str:
    """A fresh prefix for the next child this process starts."""
    return f"{_names.base}.{next(_names.children)}"


def _fresh_name() -> str:
    """A block name of this process that nobody can guess (64 random bits)."""
    return f"{_names.base}-{secrets.token_hex(8)}"


def shm_space() -> tuple[int, int]:
    """``(free, total)`` bytes of ``/dev/shm``; ``(0, 0)`` where there is none."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def create_block(raw: memoryview) -> Block | None:
    """A new block holding a copy of *raw* (a contiguous byte view).

    ``None`` when ``/dev/shm`` cannot hold it (``ENOSPC`` from the reservation, or no
    ``/dev/shm`` at all), or, with a :class:`RuntimeWarning`, when every fresh name tried
    was already taken: send the bytes through the pipe instead.
    """
    for _ in range(_NAME_ATTEMPTS):
        with contextlib.suppress(FileExistsError):  # taken: try another fresh name
            return _create(_fresh_name(), raw)
    warnings.warn(
        f"ctxkit.procs: {_NAME_ATTEMPTS} fresh shared-memory names "
        f"{_SHM_DIR}/{shm_prefix()}-<random> were all taken by another process; "
        f"{raw.nbytes} bytes go through the pipe instead (slower). Another process may be "
        f"squatting names in {_SHM_DIR}",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _create(name: str, raw: memoryview) -> Block | None:
    """Make block *name* in ``/dev/shm`` (``FileExistsError`` if the name is taken)."""
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise
    except OSError:
        return None
    _track(name)
    try:
        os.posix_fallocate(fd, 0, raw.nbytes)  # first: a full /dev/shm is an error here
        with mmap.mmap(fd, raw.nbytes) as mapped:
            mapped[:] = raw
        return name, raw.nbytes, os.fstat(fd).st_ino
    except BaseException as exc:
        os.unlink(path)  # nobody else knows its name yet
        _untrack(name)
        if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
            return None
        raise
    finally:
        os.close(fd)


def attach_block(name: str, size: int, key: int) -> Any:
    """Map block *name* and unlink it: a writable buffer (the mapping, no copy) that owns
    the memory.

    Raises :class:`BlockIdentityError` when the name holds another block than the one
    its sender made (*size*, *key*).
    """
    path = os.path.join(_SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except PermissionError as exc:  # ours is always open to us
        raise _not_the_block(name, size) from exc
    try:
        if (st := os.fstat(fd)).st_ino != key or st.st_size != size:
            raise _not_the_block(name, size)
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    os.unlink(path)
    _untrack(name)
    return mapped


def _not_the_block(name: str, size: int) -> BlockIdentityError:
    return BlockIdentityError(
        f"shared-memory block {name!r} ({size} bytes) is not the block its sender made: "
        "the name was removed and re-created by another process. It was not read; the "
        "message that named it is lost"
    )


def shm_bytes(parts: Iterable[Part]) -> int:
    """The bytes of the blocks among *parts*."""
    return sum(p[1] for p in parts if isinstance(p, tuple))


def discard_blocks(parts: Iterable[Part]) -> None:
    """Unlink the blocks among *parts* (their receiver died or will never read them)."""
    for part in parts:
        if isinstance(part, tuple):
            _remove(*part)


def sweep_blocks(child: str) -> int:
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
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM_DIR, name))
        _untrack(name)
    return len(left)


def _remove(name: str, size: int, key: int) -> None:
    """Unlink a block this process created or received. A name already gone is left
    alone (its receiver mapped it and untracked it), and so is another block at its name."""
    path = os.path.join(_SHM_DIR, name)
    try:
        if os.stat(path, follow_symlinks=False).st_ino != key:
            return
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


# --- what travelled --------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """What this process sent and received in ``ctxkit.procs`` messages (:func:`traffic`).

    Attributes
    ----------
    pipe_bytes_sent, pipe_bytes_received : int
        Pickled bytes and buffers that went through pipes.
    shm_bytes_sent, shm_bytes_received : int
        Buffers that went through shared-memory blocks.
    device_buffers_sent, device_buffers_received : int
        Device buffers and arrays that travelled as CUDA IPC references.
    device_bytes_sent, device_bytes_received : int
        Their sizes: device memory shared with the other process, not copied.
    """

    pipe_bytes_sent: int = 0
    pipe_bytes_received: int = 0
    shm_bytes_sent: int = 0
    shm_bytes_received: int = 0
    device_buffers_sent: int = 0
    device_buffers_received: int = 0
    device_bytes_sent: int = 0
    device_bytes_received: int = 0

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(Traffic)))


_traffic_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_traffic_lock")
_traffic: dict[str, int] = {f.name: 0 for f in fields(Traffic)}


def traffic() -> Traffic:
    """Counters of this process since it started: how its ``ctxkit.procs`` messages
    travelled (subtract two readings to see one call's share)."""
    with _traffic_lock:
        return Traffic(**_traffic)


def _count(
    direction: str, data_len: int, parts: Sequence[Part], devices: int, dev_bytes: int
) -> None:
    pipe_bytes = data_len + sum(len(p) for p in parts if not isinstance(p, tuple))
    with _traffic_lock:
        _traffic[f"pipe_bytes_{direction}"] += pipe_bytes
        _traffic[f"shm_bytes_{direction}"] += shm_bytes(parts)
        _traffic[f"device_buffers_{direction}"] += devices
        _traffic[f"device_bytes_{direction}"] += dev_bytes


def count_sent(
    data: bytes, parts: Sequence[Part] = (), session: devmem.Session | None = None
) -> None:
    """Count a message this process sent: its pickle, its buffers, and the device
    references *session* put in it."""
    devices = (session.sent, session.sent_bytes) if session is not None else (0, 0)
    _count("sent", len(data), parts, *devices)


# --- device memory in pickles ----------------------------------------------------------


@functools.cache
def _session_pickler(base: type) -> type:
    """A subclass of the pickler class *base* (``pickle.Pickler`` or cloudpickle's) that
    reduces the session's device objects through ``session.reduce``
    (:class:`~.devmem.Session`)."""

    class _SessionPickler(base):  # type: ignore[valid-type,misc]
        def __init__(
            self, file: Any, session: devmem.Session, types: tuple[type, ...], **kwargs: Any
        ) -> None:
            super().__init__(file, **kwargs)
            self._session = session
            self._types = types

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, self._types):
                return self._session.reduce(obj)
            inherited = getattr(super(), "reducer_override", None)
            return NotImplemented if inherited is None else inherited(obj)

    return _SessionPickler


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, session: devmem.Session, buffers: Any) -> None:
        super().__init__(file, buffers=buffers)
        self._session = session

    def find_class(self, module: str, name: str) -> Any:
        if module == devmem.__name__ and name == devmem.load_ref.__name__:
            return self._session.load
        return super().find_class(module, name)


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError:
        return None
    return cloudpickle


# --- what can be sent ------------------------------------------------------------------


def by_value_reason(fn: Any) -> str:
    """Why a spawned child could not import *fn* by name ("" when it can)."""
    qual = getattr(fn, "__qualname__", "")
    if "<lambda>" in qual:
        return "a lambda"
    if "<locals>" in qual:
        return "a nested function (closure)"
    main = sys.modules.get("__main__")
    importable = any(getattr(main, a, None) is not None for a in ("__file__", "__spec__"))
    if getattr(fn, "__module__", None) == "__main__" and not importable:
        return "defined in an interactive session (python -c, a REPL or a notebook)"
    return ""


def check_shippable(what: str, fn: Any) -> bool:
    """Refuse, before any process starts, a function a spawned child cannot get.

    Returns ``True`` when *fn* must travel by value (cloudpickle is installed), ``False``
    when it is imported by name in the child.
    """
    if not callable(fn):
        raise TypeError(f"{what}: expected a callable, got {type(fn).__name__}")
    if not (reason := by_value_reason(fn)):
        return False
    if _cloudpickle() is None:
        raise TypeError(
            f"{what}: {fn!r} is {reason}, which a spawned process cannot import by name. "
            "Define it at module level in a file and import it from there, or install "
            "cloudpickle to send it by value (pip install cloudpickle, or in a ctxkit "
            'checkout pip install -e ".[cloudpickle]")'
        )
    return True


def check_main(what: str) -> None:
    """Refuse a main module that a spawned child cannot re-run (read from standard input).

    A spawned child re-runs the parent's main module from its file before it unpickles
    anything; with ``python -`` there is no file and the child dies at start-up.
    """
    main = sys.modules.get("__main__")
    shown = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or shown is None:
        return
    # a relative path is resolved where multiprocessing resolves it (an absolute one is kept)
    path = os.path.join(getattr(process, "ORIGINAL_DIR", None) or "", str(shown))
    if not os.path.isfile(path):
        raise RuntimeError(
            f"{what}: the main module {shown!r} is not a file, so a spawned process "
            "cannot re-run it (the program was read from standard input: `python -`). Save "
            "the program to a file and run `python file.py`, or run it with `python -c` or in a "
            "notebook (functions defined there are sent by value with cloudpickle)"
        )


# --- encoding --------------------------------------------------------------------------


def _dumps(
    obj: Any, by_value: bool, buffer_callback: Any, session: devmem.Session | None = None
) -> bytes:
    cp = _cloudpickle() if by_value else None
    types = devmem.device_types() if session is not None else ()
    if not types:  # no device object can exist here: the plain (C-speed) picklers
        plain = pickle.dumps if cp is None else cp.dumps
        return bytes(plain(obj, protocol=5, buffer_callback=buffer_callback))
    cls = _session_pickler(pickle.Pickler if cp is None else cp.Pickler)
    out = io.BytesIO()
    cls(out, session, types, protocol=5, buffer_callback=buffer_callback).dump(obj)
    return out.getvalue()


def dumps(
    what: str, obj: Any, by_value: bool = False, session: devmem.Session | None = None
) -> bytes:
    """Pickle *obj* whole (no shared memory); ``TypeError`` naming *what* when it cannot be.

    Device objects go through *session*; its refusal (``session.error``) is raised as is.
    """
    try:
        return _dumps(obj, by_value, None, session)
    except Exception as exc:
        if session is not None and session.error is not None:
            raise session.error from None
        raise _not_picklable(what, exc) from exc


def _not_picklable(what: str, exc: Exception | None) -> TypeError:
    return TypeError(
        f"{what}: the function and its arguments must be picklable to reach a spawned "
        f"process, but pickling failed: {exc}"
    )


def _collect(threshold: int | None, found: list[memoryview]) -> Callable[[Any], bool]:
    """A ``buffer_callback`` that keeps buffers of *threshold* bytes or more out of band,
    in *found*, and the smaller ones in the pickle (all of them for ``None``)."""

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if threshold is None or raw.nbytes < max(threshold, 1):
            return True
        found.append(raw)
        return False

    return out_of_band


@dataclass(slots=True)
class Payload:
    """A pickled task whose large buffers are not copied anywhere yet.

    ``data`` is the pickle; ``buffers`` its out-of-band buffers, views of the caller's
    memory until :meth:`snapshot` copies them. :meth:`parts` puts each buffer in a
    shared-memory block (or, without room, in the message) when the task is sent.
    ``devices`` holds the device buffers and arrays among *obj*, which travel as IPC
    references (``None`` when there are none).
    """

    data: bytes
    buffers: list[memoryview | bytearray]
    devices: devmem.Outgoing | None = None

    @classmethod
    def build(cls, what: str, obj: Any, threshold: int | None, by_value: bool) -> Payload:
        """Pickle *obj*; buffers of *threshold* bytes or more stay out of band.

        Raises the device layer's error as is (a device argument that cannot be shared:
        ``ValueError``, ``TypeError``, ``ContextClosedError`` or the driver's
        ``CudaError``); ``TypeError`` for anything else that cannot be pickled.
        """
        first: Exception | None = None
        # a lambda among the arguments: cloudpickle can send that too
        for value in (by_value,) if by_value or _cloudpickle() is None else (False, True):
            found: list[memoryview] = []
            devices = devmem.Outgoing(what)
            try:
                data = _dumps(obj, value, _collect(threshold, found), devices)
            except Exception as exc:
                if devices.error is not None:
                    raise devices.error from None
                first = first or exc
                continue
            return cls(data, list(found), devices if devices.sent else None)
        raise _not_picklable(what, first) from first

    def snapshot(self) -> None:
        """Copy the buffers out of the caller's memory (the task waits in a queue)."""
        self.buffers = [b if isinstance(b, bytearray) else bytearray(b) for b in self.buffers]

    def parts(
        self,
        reserve: Callable[[int], bool] = lambda nbytes: True,
        unreserve: Callable[[int], None] = lambda nbytes: None,
    ) -> tuple[list[Part], int]:
        """The buffers as message parts: a block for each buffer ``reserve(nbytes)``
        allows and ``/dev/shm`` has room for, the bytes themselves otherwise.

        Returns the parts and the bytes put in shared memory (reserved, not given back).
        """
        parts: list[Part] = []
        try:
            for buf in self.buffers:
                raw = memoryview(buf).cast("B")
                block = None
                if reserve(raw.nbytes) and (block := create_block(raw)) is None:
                    unreserve(raw.nbytes)
                parts.append(block or bytearray(raw))
        except BaseException:
            discard_blocks(parts)
            unreserve(shm_bytes(parts))
            raise
        return parts, shm_bytes(parts)

    def release(self) -> None:
        """Drop the buffers and stop holding the device arguments."""
        self.buffers = []
        if self.devices is not None:
            self.devices.release()


def encode(
    obj: Any, threshold: int | None = SHM_THRESHOLD, session: devmem.Session | None = None
) -> tuple[bytes, list[Part]]:
    """Pickle *obj* now; buffers of *threshold* bytes or more go to shared-memory blocks,
    or through the pipe where ``/dev/shm`` has no room. ``threshold=None``: no blocks.
    Device objects go through *session* (without one they are pickled as plain objects,
    which fails)."""
    found: list[memoryview] = []
    data = _dumps(obj, False, _collect(threshold, found), session)
    return data, Payload(data, list(found)).parts()[0]


def decode(data: bytes, parts: Sequence[Part], session: devmem.Session | None = None) -> Any:
    """Inverse of :func:`encode` / :meth:`Payload.parts`; consumes the blocks, also when
    it fails. Device references are resolved by *session* (``load``)."""
    buffers: list[Any] = []
    try:
        for part in parts:
            buffers.append(attach_block(*part) if isinstance(part, tuple) else part)
    except BaseException:
        discard_blocks(parts[len(buffers) :])
        raise
    session = session if session is not None else devmem.Session()
    before = session.received, session.received_bytes
    try:
        return _Unpickler(io.BytesIO(data), session, buffers).load()
    finally:
        devices, dev_bytes = session.received - before[0], session.received_bytes - before[1]
        _count("received", len(data), parts, devices, dev_bytes)


def result_bytes(
    fn: Any, value: Any, threshold: int | None, session: devmem.ChildSession
) -> tuple[bytes, list[Part]]:
    """Pickle the result of task *fn* for the parent; device memory goes through
    *session* (the task's), whose refusal is raised as is."""
    session.what = f"the result of {getattr(fn, '__qualname__', fn)!r} on device {session.ordinal}"
    try:
        return encode(value, threshold, session)
    except Exception as exc:
        if session.error is not None:
            raise session.error from None
        raise TypeError(
            f"{session.what} cannot be pickled back to the parent ({exc}); return host data "
            "(numpy arrays, numbers) or ctxkit device buffers and arrays"
        ) from exc


# --- errors ----------------------------------------------------------------------------


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What the parent needs to rebuild a child's exception: picklable plain data."""
    pickled: bytes | None
    try:
        pickled = pickle.dumps(exc, protocol=5)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    cls = type(exc)
    cuda = isinstance(exc, CudaError)
    try:
        tb = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    except Exception as inner:
        tb = f"(the traceback could not be formatted: {_safe_str(inner)})"
    return {
        "type": f"{cls.__module__}.{cls.__qualname__}",
        "message": _safe_str(exc),
        "traceback": tb,
        "code": int(getattr(exc, "code", 0) or 0) if cuda else 0,
        "name": str(getattr(exc, "name", "")) if cuda else "",
        "pickled": pickled,
    }


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as inner:
        try:
            why = f"{type(inner).__name__}: {inner}"
        except Exception:
            why = type(inner).__name__
        return f"<str() of this {type(exc).__name__} raised {why}>"


def outcome(
    out: tuple[Any, ...],
    loader: devmem.Session,
    head: str,
    device: int,
    pid: int | None,
    exitcode: int | None = None,
    attempts: int = 1,
) -> tuple[Any, DeviceTaskError | None]:
    """A task's reply ``out`` (``("ok", data, parts, ...)`` or ``("error", desc)``) in
    the parent: ``(value, None)``, or ``(None, the DeviceTaskError it stands for)``."""
    if out[0] == "ok":
        try:
            return decode(out[1], out[2], loader), None
        except Exception as exc:
            out, head = ("error", describe_exception(exc)), f"{head}: result not loadable"
    return None, error_from(out[1], device, pid, exitcode, attempts, head)


def error_from(
    desc: dict[str, Any],
    device: int,
    pid: int | None,
    exitcode: int | None,
    attempts: int,
    head: str,
    kind: str = "exception",
) -> DeviceTaskError:
    tb = desc["traceback"]
    try:  # the child's exception object, when it could be pickled (and loads here)
        exc = pickle.loads(desc["pickled"])
    except Exception:  # None (not picklable) or a class this process cannot import
        exc = None
    return DeviceTaskError(
        f"{head}: {desc['type']}: {desc['message']}\n--- traceback in child process {pid} ---\n"
        f"{tb.rstrip()}",
        device=device,
        kind=kind,
        pid=pid,
        exitcode=exitcode,
        traceback=tb,
        exception_type=desc["type"],
        child_exception=exc if isinstance(exc, BaseException) else None,
        attempts=attempts,
        code=desc["code"],
        name=desc["name"],
    )
