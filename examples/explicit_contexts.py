"""Explicit contexts: create / push / pop / destroy, and the worker-thread INVALID_CONTEXT bug.

Pattern: "CUDA context and device management", as Driver-API tutorials write it. With
the Driver API you own contexts: ``cuCtxCreate``, ``cuCtxPushCurrent``, ``cuCtxPopCurrent``,
``cuCtxDestroy``. The classic bug: the main thread creates a context, a worker thread uses
it and gets ``CUDA_ERROR_INVALID_CONTEXT``, because the current context is per thread; the
worker must push the context itself.

This program
1. creates an owned context and uses it with ``with ctx:`` and ``push()``/``pop()``, nested
   with device 0's primary context, then destroys it with ``close()``;
2. shows the bug with raw cuda.bindings in a worker thread, and the raw fix (push/pop);
3. shows the same worker the ctxkit way: without a binding ctxkit raises
   ``NoCurrentContextError`` naming the thread and the fix, ``with ctxkit.bind(ctx):``
   fixes it, and ``ContextExecutor``/``@ctxkit.bound`` bind once for a whole pool.

The raw version of step 1 also needs the 12.x/13.x ``cuCtxCreate`` signatures handled,
every ``CUresult`` checked, and a ``try/finally`` per push so an exception cannot leave the
context current (ctxkit's ``with`` does both, and verifies each pop).

    python examples/explicit_contexts.py
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus

import ctxkit as ck

N = 1 << 16


def fill_and_read(fill: ck.Kernel, value: float) -> np.ndarray:
    """Fill a fresh buffer in the *current* context and read it back."""
    buf = ck.DeviceBuffer(N * 4)
    fill.launch(blocks_for(N), 256, buf, value, N)
    out = buf.copy_to_host(np.empty(N, np.float32))
    buf.close()
    return out


def explicit_lifecycle(fill: ck.Kernel) -> None:
    print("-- 1. cuCtxCreate / push / pop / destroy")
    ctx = ck.Context.create(0)  # cuCtxCreate; ctxkit does not leave it current
    primary = ck.registry.context(0)
    print(f"created {ctx!r}")
    expect("a new context is not left current", ck.current_context() != ctx)
    with ctx:  # cuCtxPushCurrent ... cuCtxPopCurrent (verified)
        expect("inside `with ctx:` it is current", ck.current_context() == ctx)
        check("kernel in the owned context", fill_and_read(fill, 1.5), np.full(N, 1.5, np.float32))
        with primary:  # nest another context: push on top, pop back
            expect("nested primary is current", ck.current_context() == primary)
        expect("owned context is current again", ck.current_context() == ctx)
    ctx.push()  # the explicit form of the same
    try:
        check("kernel after push()", fill_and_read(fill, 2.5), np.full(N, 2.5, np.float32))
    finally:
        ctx.pop()
    ctx.close()  # cuCtxDestroy
    expect("closed", ctx.closed)
    try:
        with ctx:
            raise AssertionError("a closed context was pushed")
    except ck.ContextClosedError as exc:
        print(f"using it afterwards raises ContextClosedError: {str(exc).splitlines()[0]}")


def raw_bug(ctx: ck.Context) -> None:
    print("-- 2. the bug with raw cuda.bindings: a worker thread uses the main thread's context")
    from cuda.bindings import driver as cu

    seen: dict[str, Any] = {}

    def worker() -> None:
        err, ptr = cu.cuMemAlloc(1024)  # no context is current in this thread
        seen["cuMemAlloc without a context"] = err
        if not err:  # the driver refuses it; free in case it ever does not
            cu.cuMemFree(ptr)
        seen["cuCtxPushCurrent(main's context)"] = cu.cuCtxPushCurrent(cu.CUcontext(ctx.handle))[0]
        err, ptr = cu.cuMemAlloc(1024)
        seen["cuMemAlloc after the push"] = err
        if not err:
            cu.cuMemFree(ptr)
        seen["cuCtxPopCurrent"] = cu.cuCtxPopCurrent()[0]

    t = threading.Thread(target=worker, name="raw-worker")
    t.start()
    t.join()
    for what, err in seen.items():
        print(f"raw-worker: {what}: {err.name}")
    errs = list(seen.values())
    expect(
        "raw worker without a push gets CUDA_ERROR_INVALID_CONTEXT",
        errs[0] == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT,
        str(errs[0]),
    )
    expect("raw worker after cuCtxPushCurrent allocates", not any(errs[1:]), str(errs[1:]))


def ctxkit_fix(ctx: ck.Context, fill: ck.Kernel) -> None:
    print("-- 3. the same worker with ctxkit")
    seen: dict[str, Any] = {}

    def worker() -> None:
        try:
            ck.DeviceBuffer(1024)
        except ck.NoCurrentContextError as exc:
            seen["error"] = exc
        with ck.bind(ctx):  # the fix: make ctx current in this thread for the block
            seen["values"] = fill_and_read(fill, 4.0)

    t = threading.Thread(target=worker, name="ctxkit-worker")
    t.start()
    t.join()
    err = seen.get("error")
    expect("unbound worker gets NoCurrentContextError", err is not None)
    print(f"ctxkit-worker without a binding: {str(err).splitlines()[0][:160]}...")
    check("ctxkit-worker inside ck.bind(ctx)", seen["values"], np.full(N, 4.0, np.float32))

    with ck.ContextExecutor(ctx, max_workers=4) as pool:  # every worker has ctx current
        results = list(pool.map(lambda v: fill_and_read(fill, v), [5.0, 6.0, 7.0, 8.0]))
    for v, got in zip([5.0, 6.0, 7.0, 8.0], results):
        check(f"ContextExecutor task value {v}", got, np.full(N, v, np.float32))

    @ck.bound(0)  # the registry's shared context of device 0, bound per call
    def on_device0(v: float) -> np.ndarray:
        return fill_and_read(fill, v)

    out: list[np.ndarray] = []
    t = threading.Thread(target=lambda: out.append(on_device0(9.0)), name="decorated")
    t.start()
    t.join()
    check("@ck.bound(0) in a fresh thread", out[0], np.full(N, 9.0, np.float32))


def main() -> None:
    example_parser(__doc__).parse_args()
    require_gpus("explicit_contexts.py")
    # A context-independent library: the one Kernel runs in whichever context is current.
    fill = ck.Module.load(ck.compile(ck.kernel_source("fill.cu"))).function("fill_f32")
    explicit_lifecycle(fill)
    shared = ck.Context.create(0)  # "the main thread created the context"
    try:
        raw_bug(shared)
        ctxkit_fix(shared, fill)
    finally:
        shared.close()
    ok("explicit contexts, and the worker-thread INVALID_CONTEXT bug shown and fixed")


if __name__ == "__main__":
    main()
