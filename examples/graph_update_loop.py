"""An explicitly built CUDA graph, updated in a loop instead of rebuilt.

Pattern: the "update an instantiated graph" loop of the CUDA Programming Guide (and of
cuda.core's graph examples). Building and instantiating a graph costs far more than
launching it, so an application whose per-step work keeps its shape builds the graph
once and, every step, only changes the parameters of its nodes in the executable graph.

This program
1. builds a three-node graph by hand -- copy x to the device (pinned host memory), run
   ``y = a * x + y`` (``saxpy``) after it, copy y back after that -- and instantiates it;
2. runs it for several steps, each with a new ``a`` and new input, changing only the
   kernel node (``exec.set_kernel_params``) and checking every result against numpy;
3. switches the executable graph to another graph of the same shape with
   ``exec.update(graph)`` (other buffers), and shows that a graph of another shape is
   refused with ``GraphUpdateError`` naming why.

    python examples/graph_update_loop.py [--n 1048576] [--steps 8]
"""

from __future__ import annotations

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus

import ctxkit as ck

BLOCK = 256


def build(kernel: ck.Kernel, x_host, y_host, x, y, n: int, a: float):
    """H2D copies -> saxpy -> D2H copy; returns the graph and its kernel node."""
    g = ck.Graph()
    up_x = g.memcpy(x, x_host)
    up_y = g.memcpy(y, y_host)
    run = g.kernel(kernel, blocks_for(n, BLOCK), BLOCK, a, x, y, n, depends_on=[up_x, up_y])
    g.memcpy(y_host, y, depends_on=run)
    return g, run


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--n", type=int, default=1 << 20, help="elements per vector")
    parser.add_argument("--steps", type=int, default=8, help="update-and-launch steps")
    args = parser.parse_args()
    require_gpus("graph_update_loop.py")
    n = args.n
    with ck.registry.context(0) as ctx:
        saxpy = ck.Module.load(ck.compile(ck.kernel_source("saxpy.cu"), arch=ctx.device.arch))
        kernel = saxpy.function("saxpy")
        stream = ck.Stream()
        x_host, y_host = ck.pinned_empty(n, np.float32), ck.pinned_empty(n, np.float32)
        x, y = ck.device_array(n, np.float32), ck.device_array(n, np.float32)
        graph, node = build(kernel, x_host, y_host, x, y, n, 0.0)
        exe = graph.instantiate()
        rng = np.random.default_rng(0)
        for step in range(args.steps):
            a = float(step) + 0.5
            x_host[:] = rng.integers(-1000, 1000, n)  # a * x + y is exact in float32
            y_host[:] = rng.integers(-1000, 1000, n)
            want = np.float32(a) * x_host + y_host
            exe.set_kernel_params(node, a, x, y, n)
            exe.launch(stream)
            stream.synchronize()
            check(f"step {step} (a={a})", y_host, want)

        x2, y2 = ck.device_array(n, np.float32), ck.device_array(n, np.float32)
        other, _ = build(kernel, x_host, y_host, x2, y2, n, -1.0)
        exe.update(other)  # same shape, other buffers and a
        x_host[:] = 1.0
        y_host[:] = 3.0
        exe.launch(stream)
        stream.synchronize()
        check("after exec.update(graph)", y_host, np.full(n, 2.0, np.float32))

        bigger, last = build(kernel, x_host, y_host, x, y, n, 1.0)
        bigger.empty(depends_on=last)
        try:
            exe.update(bigger)
            refused = ""
        except ck.GraphUpdateError as exc:
            refused = exc.reason
        expect("a graph of another shape is refused", refused == "topology_changed", refused)
    ok(f"{args.steps} updated launches of a {graph.num_nodes}-node graph, {n} elements each")


if __name__ == "__main__":
    main()
