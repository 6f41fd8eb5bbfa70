"""Command line: ``python -m ctxkit {info, compile, demo, bench}``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXIT_NO_GPU = 2


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


def cmd_info(args: argparse.Namespace) -> int:
    from .info import print_info

    return print_info()


def cmd_compile(args: argparse.Namespace) -> int:
    from .compile import cli_compile

    return cli_compile(args)


def cmd_demo(args: argparse.Namespace) -> int:
    reason = _no_gpu_message()
    if reason:
        print(reason, file=sys.stderr)
        return EXIT_NO_GPU
    from .demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    reason = _no_gpu_message()
    if reason:
        print(reason, file=sys.stderr)
        return EXIT_NO_GPU
    from .bench import run_benchmarks

    return run_benchmarks(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ctxkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    sub.add_parser("info", help="driver, bindings, NVRTC, devices and peer access")

    c = sub.add_parser("compile", help="compile a .cu file with NVRTC (no GPU needed)")
    c.add_argument("file", help="CUDA C++ source file")
    c.add_argument("--arch", help="target, e.g. sm_90 (required without a GPU)")
    c.add_argument("--target", choices=("ptx", "cubin"), default=None)
    c.add_argument("-o", "--output", help="output file (default: FILE.ptx / FILE.cubin)")
    c.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME[=VAL]")
    c.add_argument("-I", dest="include_dirs", action="append", default=[], metavar="DIR")
    c.add_argument("--std", default=None, help="C++ standard, e.g. c++17")
    c.add_argument("--no-cache", action="store_true", help="bypass the on-disk cache")

    d = sub.add_parser("demo", help="the multi-GPU copy -> kernel -> copy pipeline demo")
    d.add_argument("--size-mb", type=float, default=512.0, help="input size in MiB")
    d.add_argument("--devices", type=int, default=None, help="use the first N devices")
    d.add_argument("--trace", default="ctxkit-demo-trace.json", help="Chrome-trace output")
    d.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")

    b = sub.add_parser("bench", help="run the benchmarks (ctxkit vs raw cuda.bindings vs CuPy)")
    b.add_argument("names", nargs="*", help="benchmark names (default: all)")
    b.add_argument("--quick", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {
        "info": cmd_info,
        "compile": cmd_compile,
        "demo": cmd_demo,
        "bench": cmd_bench,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
