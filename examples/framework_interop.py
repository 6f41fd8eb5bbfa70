"""ctxkit kernels on PyTorch tensors and CuPy arrays, and ctxkit memory seen by both.

Pattern: embedding ctxkit in a program that already uses a framework. PyTorch and CuPy use
each device's *primary* context, which is also what ``ctxkit.registry`` hands out by
default, so all three share memory and streams with no copies:

* a ctxkit kernel takes a torch tensor / CuPy array directly as an argument (through
  ``__cuda_array_interface__``) and runs on the framework's current stream;
* a ctxkit ``DeviceArray`` is viewed by torch (``torch.from_dlpack``, ``torch.as_tensor``)
  and CuPy (``cupy.asarray``, ``cupy.from_dlpack``) without a copy: the framework writes
  it and ctxkit reads the result.

A framework that is not installed (or sees no GPU) is skipped with a note.

The raw Driver-API version needs ``cuDevicePrimaryCtxRetain`` (a ``cuCtxCreate`` context
would not share the frameworks' memory handles), the tensor's pointer and stream dug out by
hand, and a DLPack capsule written with ctypes for the other direction.

    python examples/framework_interop.py
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus

import ctxkit as ck

N = 1 << 20
TWO = np.float32(2.0)


def optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        print(f"{name} is not installed: skipping the {name} part")
        return None


def ctxkit_array(fill: ck.Kernel, value: float) -> ck.DeviceArray:
    """A ctxkit array filled by a ctxkit kernel (legacy default stream), then synced."""
    arr = ck.device_array((N,), np.float32)
    fill.launch(blocks_for(N), 256, arr, value, N)
    ck.current_context().synchronize()
    return arr


def with_torch(torch: ModuleType, scale: ck.Kernel, fill: ck.Kernel) -> None:
    x = torch.rand(N, device="cuda:0")
    y = torch.empty_like(x)
    expect(
        "torch made device 0's primary context current, the registry's context",
        ck.current_context() == ck.registry.context(0),
    )
    stream = torch.cuda.current_stream()
    scale.launch(blocks_for(N), 256, x, y, N, TWO, stream=stream)  # tensors as arguments
    stream.synchronize()
    check("torch: ctxkit scale_f32 on tensors", y.cpu().numpy(), x.cpu().numpy() * TWO)

    arr = ctxkit_array(fill, 7.0)
    t = torch.from_dlpack(arr)  # no copy
    expect("torch.from_dlpack shares ctxkit memory", t.data_ptr() == arr.ptr)
    t.mul_(3)  # torch writes ctxkit memory
    torch.cuda.synchronize()
    check("torch wrote a ctxkit array", arr.to_host(), np.full(N, 21, np.float32))
    t2 = torch.as_tensor(arr, device="cuda:0")  # through __cuda_array_interface__
    expect("torch.as_tensor shares ctxkit memory", t2.data_ptr() == arr.ptr)


def with_cupy(cp: ModuleType, scale: ck.Kernel, fill: ck.Kernel) -> None:
    x = cp.random.random(N, dtype=cp.float32)
    y = cp.empty_like(x)
    stream = cp.cuda.get_current_stream()
    scale.launch(blocks_for(N), 256, x, y, N, TWO, stream=stream)  # CuPy arrays as arguments
    stream.synchronize()
    check("cupy: ctxkit scale_f32 on CuPy arrays", cp.asnumpy(y), cp.asnumpy(x) * TWO)

    arr = ctxkit_array(fill, 5.0)
    c = cp.asarray(arr)  # through __cuda_array_interface__, no copy
    expect("cupy.asarray shares ctxkit memory", c.data.ptr == arr.ptr)
    c *= 2  # CuPy writes ctxkit memory
    cp.cuda.Device(0).synchronize()
    check("cupy wrote a ctxkit array", arr.to_host(), np.full(N, 10, np.float32))
    c2 = cp.from_dlpack(arr)
    expect("cupy.from_dlpack shares ctxkit memory", c2.data.ptr == arr.ptr)


def main() -> None:
    example_parser(__doc__).parse_args()
    require_gpus("framework_interop.py")
    scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"))).function("scale_f32")
    fill = ck.Module.load(ck.compile(ck.kernel_source("fill.cu"))).function("fill_f32")
    done = []
    torch = optional("torch")
    if torch is not None and not torch.cuda.is_available():
        print("torch sees no GPU (a CPU-only build?): skipping the torch part")
        torch = None
    if torch is not None:
        with_torch(torch, scale, fill)
        done.append(f"torch {torch.__version__}")
    cp = optional("cupy")
    if cp is not None:
        with ck.bind(0):  # CuPy's current device 0 is the same primary context
            with_cupy(cp, scale, fill)
        done.append(f"cupy {cp.__version__}")
    ok("interop with " + (", ".join(done) if done else "no framework installed"))


if __name__ == "__main__":
    main()
