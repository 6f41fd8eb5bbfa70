"""The ``ctxkit`` command (also ``python -m ctxkit``): info, compile, demo, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import compile as compile_command

EXIT_NO_GPU = 2
#: The status of a command whose reader went away (``ctxkit info | head -1``): 128 + SIGPIPE,
#: what a shell reports for a program that SIGPIPE ended.
EXIT_BROKEN_PIPE = 128 + 13

DESCRIPTION = """\
ctxkit: explicit CUDA contexts, run-time compiled kernels and multi-GPU pipelines.

  ctxkit info                       what this machine offers (works without a GPU)
  ctxkit compile k.cu --arch sm_90  compile CUDA C++ with NVRTC (no GPU needed)
  ctxkit demo                       the multi-GPU copy -> kernel -> copy demo
  ctxkit bench [names]              the benchmarks of a source checkout
"""


def prog_name(argv0: str | None = None) -> str:
    """The program name for usage lines: the script's name, ``ctxkit`` for ``python -m``.

    ``python -m ctxkit`` runs ``ctxkit/__main__.py``; its name says nothing to a user, and
    ``ctxkit`` is the command the package installs.
    """
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    return "ctxkit" if not name or name in ("-c", "-m") or name.endswith(".py") else name


def _no_gpu_message() -> str | None:
    """A one-line reason when no GPU can be used, else ``None``."""
    from .. import _driver
    from ..device import device_count
    from ..errors import DriverNotFoundError

    try:
        _driver.init()
    except DriverNotFoundError as exc:
        return f"ctxkit: no GPU: {exc}"
    if device_count() == 0:
        return "ctxkit: no GPU: the NVIDIA driver loaded but reports no CUDA device"
    return None


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed subcommand; its module is imported on use (``--help`` stays light)."""
    if args.command == "info":
        from .info import print_info

        return print_info()
    if args.command == "compile":
        return compile_command.run(args)
    if args.command == "bench":
        from .bench import cli_bench

        return cli_bench(args, _no_gpu_message)
    if reason := _no_gpu_message():
        print(reason, file=sys.stderr)
        return EXIT_NO_GPU
    from .demo import run_demo

    return run_demo(args)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``ctxkit`` command."""
    from .. import __version__

    p = argparse.ArgumentParser(
        prog=prog or prog_name(),
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"ctxkit {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "info",
        help="versions, supported GPU architectures, devices and peer access (no GPU needed)",
        description="Print the ctxkit, cuda-bindings, NVRTC and driver versions, the GPU "
        "architectures NVRTC compiles for, the kernel cache, the devices and their peer "
        "access. Without a GPU it prints what it can and says so; it exits 0.",
    )

    compile_help = "compile a .cu file with NVRTC (no GPU needed)"
    c = sub.add_parser("compile", help=compile_help, description=compile_command.DESCRIPTION)
    compile_command.add_arguments(c)

    d = sub.add_parser("demo", help="the multi-GPU copy -> kernel -> copy pipeline demo")
    d.add_argument(
        "--size-mb",
        type=float,
        help="input size in MiB (default: 1024 where the GPUs and host have the memory, else 256)",
    )
    d.add_argument("--devices", type=int, help="use the first N devices")
    d.add_argument("--trace", default="ctxkit-demo-trace.json", help="Chrome-trace output")
    d.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")

    b = sub.add_parser("bench", help="run the benchmarks (ctxkit vs raw cuda.bindings vs CuPy)")
    b.add_argument("names", nargs="*", help="benchmark names (default: all)")
    b.add_argument("--quick", action="store_true", help="shorter runs")
    b.add_argument(
        "--list", action="store_true", help="name the benchmarks and exit (no GPU needed)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ctxkit`` command with *argv* (default: ``sys.argv[1:]``); return its exit code."""
    args = build_parser().parse_args(argv)
    try:
        status = run_command(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # stdout's reader closed the pipe (``ctxkit info | head -1``): exit quietly, with
        # stdout pointed at /dev/null so the interpreter's last flush at exit does not raise
        # again (the recipe of the Python documentation's "Note on SIGPIPE")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return status
