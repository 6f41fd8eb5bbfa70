"""A vector addition on buffers striped over every GPU with CUDA virtual memory management.

Pattern: NVIDIA's ``vectorAddMMAP`` sample (cuda-samples and cuda-python's examples).
``ctxkit.memory.vmm.VirtualBuffer(nbytes, devices=[...])`` reserves one contiguous device
address range and backs it with a physical chunk on each device, round-robin; the kernel
on device 0 reads and writes all of it through NVLink/PCIe. No ``enable_peer_access`` is
needed: the buffer grants every device access to its chunks (``cuMemSetAccess``), which
still needs a peer path (``can_access_peer``) between them. Then the result buffer grows
to twice its size without a copy: new chunks are mapped after the old ones.

With one GPU (or GPUs without a peer path) the buffers are striped over device 0 only,
and the program says so.

The raw Driver-API version needs ``cuMemGetAllocationGranularity`` for every device,
``cuMemAddressReserve``, a ``cuMemCreate`` + ``cuMemMap`` per chunk, ``cuMemSetAccess``
with one access descriptor per device, and ``cuMemUnmap`` / ``cuMemRelease`` /
``cuMemAddressFree`` in that order for every buffer, also on every error path.

    python examples/vmm_striped.py [--mb 64]
"""

from __future__ import annotations

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus

import ctxkit as ck


def backing_devices(count: int) -> list[int]:
    """Device 0 and every device with a peer path to and from it."""
    out = [0]
    for d in range(1, count):
        if ck.Device(0).can_access_peer(d) and ck.Device(d).can_access_peer(0):
            out.append(d)
    return out


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=int, default=64, help="MiB per vector")
    args = parser.parse_args()
    count = require_gpus("vmm_striped.py")
    from ctxkit.memory.vmm import VirtualBuffer

    devices = backing_devices(count)
    if len(devices) == 1:
        why = "one GPU" if count == 1 else "no peer path between the GPUs"
        print(f"{why}: striping over device 0 only")
    else:
        print(f"striping over devices {devices}")
    n = args.mb * 2**20 // 4
    rng = np.random.default_rng(0)
    h_a, h_b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    with ck.bind(0):
        source = ck.kernel_source("vector_add.cu")
        vector_add = ck.Module.load(ck.compile(source, name="vector_add.cu")).function("vector_add")
        a, b, c = (VirtualBuffer(n * 4, devices=devices) for _ in range(3))
        for chunk in c.chunks:
            end = chunk.offset + chunk.nbytes
            print(f"  bytes {chunk.offset:>11,}..{end:>11,} on device {chunk.device}")
        a.copy_from_host(h_a)
        b.copy_from_host(h_b)
        vector_add.launch(blocks_for(n), 256, a, b, c, n)
        want = h_a + h_b
        check("c = a + b", c.copy_to_host().view(np.float32), want)
        moved = c.grow(2 * n * 4)
        where = "moved" if moved else "in place"
        print(f"grew c to {c.nbytes:,} bytes in {len(c.chunks)} chunks ({where})")
        expect("c has twice the size", c.nbytes == 2 * n * 4)
        check("c kept its values without a copy", c.copy_to_host()[: n * 4].view(np.float32), want)
        for vb in (a, b, c):
            vb.close()
    ok(f"vector_add of {n:,} floats on buffers striped over {len(devices)} device(s)")


if __name__ == "__main__":
    main()
