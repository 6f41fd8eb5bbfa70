"""Two processes share one GPU buffer, ordered by an IPC event, with no copy via the host.

Pattern: NVIDIA's ``simpleIPC`` sample. A child process scales the parent's buffer in
place; the parent waits for the child's kernel with an event both processes share. The
parent exports a ``DeviceBuffer`` with ``ctxkit.memory.ipc.export_buffer``
(``cuIpcGetMemHandle``) and an event made by ``ipc_event`` with ``export_event``; both
handles are small picklable values, passed to a spawned child as arguments. The child
opens them (``import_buffer`` / ``import_event``: the buffer is mapped in the child's
context of the same GPU, found by its UUID), runs a kernel on the shared memory and
records the event after it; the parent's stream waits for that event, then the parent
reads the result. Closing the child's buffer only unmaps it: the memory stays the
parent's.

Where the driver refuses CUDA IPC (some containers do), the program prints the driver's
error and stops.

    python examples/ipc_share_buffer.py [--mb 256]
"""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus, timed

import ctxkit as ck


def child(handle: Any, event_handle: Any, alpha: float, q: Any) -> None:
    """Scale the parent's buffer in place on a stream and record the parent's event."""
    from ctxkit.memory.ipc import import_buffer, import_event

    try:
        buf = import_buffer(handle)
        done = import_event(event_handle)
    except ck.CudaError as exc:
        q.put(("refused", str(exc)))
        return
    with buf.context:
        source = ck.kernel_source("scale.cu")
        scale = ck.Module.load(ck.compile(source, name="scale.cu")).function("scale_f32")
        s = ck.Stream()
        n = buf.nbytes // 4
        scale.launch(blocks_for(n), 256, buf, buf, n, np.float32(alpha), stream=s)
        done.record(s)
        q.put(("recorded", n))  # the parent may wait for the event from now on
        s.synchronize()
        buf.close()  # unmaps it here; the parent still owns the memory
    q.put(("closed", n))


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=int, default=256, help="MiB to share")
    args = parser.parse_args()
    require_gpus("ipc_share_buffer.py")
    from ctxkit.memory.ipc import export_buffer, export_event, ipc_event

    n = args.mb * 2**20 // 4
    x = np.arange(n, dtype=np.float32)
    with ck.bind(0):
        buf = ck.DeviceBuffer(x.nbytes)
        buf.copy_from_host(x)
        try:
            done = ipc_event()
            handles = (export_buffer(buf), export_event(done))
        except ck.CudaError as exc:
            ok(f"not run: the driver refuses CUDA IPC here: {exc}")
            return
        size = sum(len(pickle.dumps(h)) for h in handles)
        print(f"sharing {buf.nbytes:,} bytes with a child process through {size} bytes of handles")
        mp = multiprocessing.get_context("spawn")
        q = mp.Queue()
        p = mp.Process(target=child, args=(*handles, 2.0, q))
        with timed() as t:
            p.start()
            kind, value = q.get(timeout=300)
            if kind == "refused":
                p.join(60)
                ok(f"not run: the driver refuses CUDA IPC in the child: {value}")
                return
            expect("the child recorded the event", kind == "recorded", f"{kind}: {value}")
            s = ck.Stream()
            s.wait(done)  # the copy below is ordered after the child's kernel
            out = ck.pinned_empty(n, np.float32)
            buf.copy_to_host(out, stream=s)
            s.synchronize()
        check("the child doubled the parent's buffer in place", out, 2 * x)
        kind, value = q.get(timeout=60)
        p.join(60)
        expect("the child closed its mapping and exited", kind == "closed" and p.exitcode == 0)
    ok(f"{args.mb} MiB shared with a child process, scaled there in {t[0]:.2f} s (incl. its start)")


if __name__ == "__main__":
    main()
