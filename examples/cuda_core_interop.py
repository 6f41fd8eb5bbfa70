"""ctxkit beside cuda.core: streams and device memory handed both ways, no copies.

Pattern: a program that uses NVIDIA's ``cuda.core`` (pythonic devices, streams, buffers,
programs) and ctxkit together. Both use device 0's *primary* context, so:

* a cuda.core ``Stream`` is a ctxkit stream through ``__cuda_stream__``
  (``stream=cc_stream`` in a launch, ``ck.Stream.wrap(cc_stream)``), and a ctxkit
  ``Stream`` is a cuda.core stream the same way (``device.create_stream(ck_stream)``);
* a cuda.core ``Buffer`` is a ctxkit kernel argument through DLPack (``__dlpack__``), and
  ctxkit memory is a cuda.core ``Buffer`` with ``Buffer.from_handle(ptr, nbytes,
  owner=array)`` (the Buffer keeps the ctxkit array alive).

cuda.core ignores the stream a DLPack consumer passes: order the work yourself, as here
by running it on one stream or by ``stream.wait(other)``. Needs ``pip install cuda-core``.

    python examples/cuda_core_interop.py
"""

from __future__ import annotations

import sys

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus

import ctxkit as ck

N = 1 << 20


def main() -> None:
    example_parser(__doc__).parse_args()
    require_gpus("cuda_core_interop.py")
    try:
        from cuda.core import Buffer, Device
    except ImportError as exc:
        sys.exit(f"cuda_core_interop.py needs cuda.core ({exc}): pip install cuda-core")

    dev = Device(0)
    dev.set_current()  # device 0's primary context: ctxkit's registry.context(0) too
    expect(
        "cuda.core made the registry's context current",
        ck.current_context() == ck.registry.context(0),
    )
    scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"))).function("scale_f32")
    x = np.arange(N, dtype=np.float32)

    # ctxkit memory as a cuda.core Buffer; cuda.core memory and stream for a ctxkit kernel
    cc_stream = dev.create_stream()
    dx = ck.to_device(x)  # returns when the data is on the device
    cc_in = dev.allocate(x.nbytes, stream=cc_stream)
    cc_out = dev.allocate(x.nbytes, stream=cc_stream)
    cc_in.copy_from(Buffer.from_handle(dx.ptr, dx.nbytes, owner=dx), stream=cc_stream)
    scale.launch(blocks_for(N), 256, cc_in, cc_out, N, np.float32(2.0), stream=cc_stream)

    # a ctxkit stream as a cuda.core stream, ordered after cuda.core's
    ks = ck.Stream()
    ks.wait(cc_stream)  # a foreign stream: ctxkit records an event on it and waits
    cc_view = dev.create_stream(ks)  # through ks.__cuda_stream__
    y = ck.device_array((N,), np.float32)
    Buffer.from_handle(y.ptr, y.nbytes, owner=y).copy_from(cc_out, stream=cc_view)
    with ck.Stream.wrap(cc_view):  # the same stream, seen from ctxkit: current here
        scale.launch(blocks_for(N), 256, y, y, N, np.float32(1.5))
    ks.synchronize()
    check("cuda.core buffers through a ctxkit kernel, back in ctxkit", y.copy_to_host(), 3 * x)
    for buf in (cc_in, cc_out):
        buf.close(cc_stream)
    cc_stream.sync()
    ok("cuda.core streams and buffers used by ctxkit, ctxkit's by cuda.core")


if __name__ == "__main__":
    main()
