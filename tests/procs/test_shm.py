"""Shared-memory blocks: reserved before they are written, named per process, removed when
their receiver takes them or their writer is reaped; a full ``/dev/shm`` never kills the
parent."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from ctxkit.errors import BlockIdentityError
from ctxkit.procs import wire
from tests.procs.proctools import SHM, own_blocks

REPO = Path(__file__).resolve().parents[2]
needs_dev_shm = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


def _raw(nbytes: int) -> memoryview:
    return memoryview(np.arange(nbytes, dtype=np.uint8))


@needs_dev_shm
def test_create_reserves_the_whole_block_then_attach_unlinks_it():
    raw = _raw(3 << 20)
    block = wire.create_block(raw)
    assert block is not None and block[0].startswith(wire.shm_prefix() + "-")
    name = block[0]
    st = os.stat(SHM / name)
    assert st.st_size == raw.nbytes and st.st_blocks * 512 >= raw.nbytes  # allocated, not sparse
    buf = wire.attach_block(*block)
    assert not (SHM / name).exists() and bytes(buf[:5]) == bytes(raw[:5])
    buf[0] = 255  # the mapping is writable


def test_create_without_room_returns_none_and_leaves_nothing(monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    assert wire.create_block(_raw(4096)) is None
    assert own_blocks() == set()


def test_create_propagates_unexpected_errors(monkeypatch):
    def broken(fd, offset, length):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    with pytest.raises(OSError, match="Input/output error"):
        wire.create_block(_raw(4096))
    assert own_blocks() == set()


@needs_dev_shm
def test_discard_unlinks_undelivered_blocks_once():
    block = wire.create_block(_raw(4096))
    assert block is not None and (SHM / block[0]).exists()
    parts: list[wire.Part] = [block, bytearray(3)]
    wire.discard_blocks(parts)
    wire.discard_blocks(parts)  # already gone: no error
    assert own_blocks() == set()


@needs_dev_shm
def test_sweep_removes_a_childs_blocks_and_its_childrens_only():
    child = wire.child_shm_prefix()
    assert child.startswith(wire.shm_prefix() + ".")
    mine = wire.create_block(_raw(64))
    assert mine is not None
    leftovers = [SHM / f"{child}-0", SHM / f"{child}-7", SHM / f"{child}.2-0"]
    for path in leftovers:
        path.write_bytes(b"x")
    other = SHM / f"{child}0-1"  # another child's (prefix ...10 vs ...1)
    other.write_bytes(b"x")
    try:
        assert wire.sweep_blocks(child) == 3
        assert not any(p.exists() for p in leftovers)
        assert other.exists() and (SHM / mine[0]).exists()
    finally:
        other.unlink()
        wire.discard_blocks([mine])


def test_prefix_is_renewed_in_a_forked_child():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.write(w, wire.shm_prefix().encode())
        os._exit(0)
    os.close(w)
    theirs = os.read(r, 200).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert theirs.startswith(f"ctxkit-{pid}-") and theirs != wire.shm_prefix()


def test_without_dev_shm_buffers_go_through_the_pipe(monkeypatch):
    monkeypatch.setattr(wire, "_SHM_DIR", "/nonexistent-shm-dir")
    assert wire.create_block(_raw(8192)) is None
    a = np.arange(1 << 18, dtype=np.float64)
    data, parts = wire.encode(a, threshold=1)
    assert not any(isinstance(p, tuple) for p in parts)
    assert np.array_equal(wire.decode(data, parts), a)
    assert wire.shm_space() == (0, 0) and wire.sweep_blocks(wire.child_shm_prefix()) == 0


# --- names squatted by another process ---------------------------------------------------


@pytest.fixture
def squat():
    """Make blocks the way another process would, at names it chose; removed at the end."""
    made: list[shared_memory.SharedMemory] = []

    def make(name: str, size: int = 4096) -> shared_memory.SharedMemory:
        block = shared_memory.SharedMemory(name=name, create=True, size=size)
        block.buf[:6] = b"SQUAT!"  # type: ignore[index]
        made.append(block)
        return block

    yield make
    for block in made:
        block.close()
        with contextlib.suppress(FileNotFoundError):
            block.unlink()


def _names(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """The names ctxkit tries next, in order (then the last one again)."""
    queue = list(names)
    pick = lambda: queue.pop(0) if len(queue) > 1 else queue[0]  # noqa: E731
    monkeypatch.setattr(wire, "_fresh_name", pick, raising=False)


def _taken(prefix: str) -> str:
    return f"{prefix}-squat{secrets.token_hex(4)}"


@needs_dev_shm
def test_create_takes_a_fresh_name_when_its_first_is_squatted(monkeypatch, squat):
    taken, free = _taken(wire.shm_prefix()), _taken(wire.shm_prefix())
    theirs = squat(taken)
    _names(monkeypatch, taken, free)
    raw = _raw(8192)
    block = wire.create_block(raw)
    assert block is not None and block[0] == free
    assert bytes(theirs.buf[:6]) == b"SQUAT!"  # type: ignore[index] # not written over
    assert bytes(wire.attach_block(*block)) == bytes(raw)  # ours, not theirs
    assert (SHM / taken).exists()  # theirs is left alone


def test_create_warns_and_uses_the_pipe_when_every_name_is_squatted(monkeypatch, squat):
    taken = _taken(wire.shm_prefix())
    theirs = squat(taken)
    _names(monkeypatch, taken)
    with pytest.warns(RuntimeWarning, match=r"were all taken by another process; 8192 bytes go "):
        assert wire.create_block(_raw(8192)) is None
    assert bytes(theirs.buf[:6]) == b"SQUAT!"  # type: ignore[index]


def test_encode_under_squatted_names_sends_through_the_pipe_and_says_so(monkeypatch, squat):
    taken = _taken(wire.shm_prefix())
    squat(taken)
    _names(monkeypatch, taken)
    a = np.arange(1 << 18, dtype=np.float64)
    with pytest.warns(RuntimeWarning, match="squatting"):
        data, parts = wire.encode(a, threshold=1 << 20)
    assert not any(isinstance(p, tuple) for p in parts)  # no block
    assert np.array_equal(wire.decode(data, parts), a)


@needs_dev_shm
def test_a_block_re_made_by_another_process_is_refused_and_left_alone(squat):
    a = np.arange(1 << 18, dtype=np.float64)
    data, parts = wire.encode(a, threshold=1 << 20)
    (name, size, _key) = parts[0]  # type: ignore[misc]
    mine = shared_memory.SharedMemory(name=name)  # the sender's block is removed ...
    mine.close()
    mine.unlink()
    theirs = squat(name, size + 64)  # ... and another process makes one at its name
    with pytest.raises(BlockIdentityError, match="not the block its sender made"):
        wire.decode(data, parts)
    assert bytes(theirs.buf[:6]) == b"SQUAT!"  # type: ignore[index]
    shared_memory.SharedMemory(name=name).close()  # still there: not unlinked by ctxkit
    wire.discard_blocks(parts)
    shared_memory.SharedMemory(name=name).close()


@needs_dev_shm
def test_a_block_of_the_right_size_re_made_at_its_name_is_refused(squat):
    raw = _raw(4096)
    block = wire.create_block(raw)
    assert block is not None
    os.unlink(SHM / block[0])
    squat(block[0], 4096)
    with pytest.raises(BlockIdentityError):
        wire.attach_block(*block)
    assert (SHM / block[0]).exists()


# --- a real full /dev/shm: a private 1 MiB tmpfs in a mount namespace -----------------

SMALL_SHM_SCRIPT = """
import numpy as np
from multiprocessing import shared_memory
from ctxkit import procs

def big(ordinal, n):
    return np.full(n, ordinal + 1.0)

def echo(a):
    return a

def write_own_block(n):  # user code that writes past what /dev/shm holds
    block = shared_memory.SharedMemory(create=True, size=n)
    block.buf[:] = b"x" * n

if __name__ == "__main__":
    n = 4 << 20
    out = procs.run_per_device(big, [0, 1], args=(n // 8,), _bind=False)
    print("RUN", [float(a.sum()) for a in out], flush=True)
    with procs.DevicePool([0], _bind=False) as pool:
        a = np.arange(n // 8, dtype=np.float64)
        print("POOL", bool(np.array_equal(pool.submit(echo, a).result(60), a)), flush=True)
        err = pool.submit(write_own_block, n).exception(60)
        print("SIGBUS", err.kind, "out of shared memory" in str(err), flush=True)
"""


def _can_mount_private_tmpfs() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        timeout=30,
    )
    return res.returncode == 0


@pytest.mark.skipif(not _can_mount_private_tmpfs(), reason="cannot mount a private tmpfs here")
def test_arrays_larger_than_a_full_dev_shm_go_through_the_pipe(tmp_path):
    script = tmp_path / "small_shm.py"
    script.write_text(textwrap.dedent(SMALL_SHM_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    shell = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} {script}"
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "RUN [524288.0, 1048576.0]" in res.stdout
    assert "POOL True" in res.stdout
    assert "SIGBUS crash True" in res.stdout
