"""Shared-memory blocks: reserved before they are written, named per process, removed when
their receiver takes them or their writer is reaped; a full ``/dev/shm`` never kills the
parent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ctxkit.procs import shm
from tests.procs.proctools import SHM, own_blocks

REPO = Path(__file__).resolve().parents[2]
needs_dev_shm = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


def _raw(nbytes: int) -> memoryview:
    return memoryview(np.arange(nbytes, dtype=np.uint8))


@needs_dev_shm
def test_create_reserves_the_whole_block_then_attach_unlinks_it():
    raw = _raw(3 << 20)
    name = shm.create(raw)
    assert name is not None and name.startswith(shm.prefix() + "-")
    st = os.stat(SHM / name)
    assert st.st_size == raw.nbytes and st.st_blocks * 512 >= raw.nbytes  # allocated, not sparse
    buf = shm.attach(name, raw.nbytes)
    assert not (SHM / name).exists() and bytes(buf[:5]) == bytes(raw[:5])
    buf[0] = 255  # the mapping is writable


def test_create_without_room_returns_none_and_leaves_nothing(monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    assert shm.create(_raw(4096)) is None
    assert own_blocks() == set()


def test_create_propagates_unexpected_errors(monkeypatch):
    def broken(fd, offset, length):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    with pytest.raises(OSError, match="Input/output error"):
        shm.create(_raw(4096))
    assert own_blocks() == set()


@needs_dev_shm
def test_discard_unlinks_undelivered_blocks_once():
    parts = [(shm.create(_raw(4096)), 4096), bytearray(3)]
    assert (SHM / parts[0][0]).exists()  # type: ignore[index]
    shm.discard(parts)  # type: ignore[arg-type]
    shm.discard(parts)  # type: ignore[arg-type] # already gone: no error
    assert own_blocks() == set()


@needs_dev_shm
def test_sweep_removes_a_childs_blocks_and_its_childrens_only():
    child = shm.child_prefix()
    assert child.startswith(shm.prefix() + ".")
    mine = shm.create(_raw(64))
    leftovers = [SHM / f"{child}-0", SHM / f"{child}-7", SHM / f"{child}.2-0"]
    for path in leftovers:
        path.write_bytes(b"x")
    other = SHM / f"{child}0-1"  # another child's (prefix ...10 vs ...1)
    other.write_bytes(b"x")
    try:
        assert shm.sweep(child) == 3
        assert not any(p.exists() for p in leftovers)
        assert other.exists() and (SHM / mine).exists()  # type: ignore[operator]
    finally:
        other.unlink()
        shm.discard([(mine, 64)])  # type: ignore[list-item]


def test_prefix_is_renewed_in_a_forked_child():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.write(w, shm.prefix().encode())
        os._exit(0)
    os.close(w)
    theirs = os.read(r, 200).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert theirs.startswith(f"ctxkit-{pid}-") and theirs != shm.prefix()


def test_without_dev_shm_blocks_are_portable_shared_memory(monkeypatch):
    raw = _raw(8192)
    name = shm.create(raw)  # made where /dev/shm exists, read as if it did not
    monkeypatch.setattr(shm, "_SHM_DIR", "/nonexistent-shm-dir")
    assert name is not None
    assert bytes(shm.attach(name, raw.nbytes)) == bytes(raw)
    assert own_blocks() == set()
    name = shm.create(raw)
    assert name is not None and bytes(shm.attach(name, raw.nbytes)) == bytes(raw)
    assert shm.space() == (0, 0)


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
