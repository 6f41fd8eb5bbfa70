"""``ctxkit compile FILE.cu``: NVRTC from the command line; no GPU needed with ``--arch``.

The output goes to the current directory (``FILE.cubin``, or ``FILE.ptx`` for PTX)
unless ``-o`` names a file. ``--arch sm_XY`` makes a cubin and ``--arch compute_XY``
PTX; an architecture this NVRTC does not know is an error. Template kernels need
``--name-expression``: their mangled names are printed. Every error exits 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path
from typing import Any

__all__ = ["DESCRIPTION", "add_arguments", "cli_compile", "run"]


#: The ``compile`` subcommand's description (plain text, for ``--help``).
DESCRIPTION = (
    "Compile a CUDA C++ file with NVRTC; no GPU needed with --arch. The output goes to "
    "the current directory (FILE.cubin, or FILE.ptx for --arch compute_XY) unless -o "
    "names a file. Template kernels need --name-expression; their mangled names are "
    "printed. Every error exits 1."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of the ``compile`` subcommand."""
    p.add_argument("file", help="CUDA C++ source file")
    p.add_argument(
        "--arch",
        help="sm_XY for a cubin (e.g. sm_90), compute_XY for PTX (e.g. compute_90); "
        "default: the GPU of this machine (required without one)",
    )
    p.add_argument(
        "--target",
        choices=("ptx", "cubin"),
        default=None,
        help="output kind (default: cubin, or ptx with --arch compute_XY)",
    )
    p.add_argument(
        "-o",
        "--output",
        help="output file (default: FILE.cubin or FILE.ptx in the current directory)",
    )
    p.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="define a preprocessor macro, e.g. -D N=4 or -DFAST (repeatable)",
    )
    p.add_argument(
        "-I",
        dest="include_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help='add DIR to the header search path (repeatable); #include "x.h" also '
        "looks next to FILE",
    )
    p.add_argument(
        "--name-expression",
        dest="name_expressions",
        action="append",
        default=[],
        metavar="EXPR",
        help="instantiate a template kernel, e.g. --name-expression 'axpy<float>' "
        "(repeatable); its mangled name is printed, for Module.function()",
    )
    p.add_argument("--std", default=None, help="C++ standard, e.g. c++17")
    p.add_argument("--no-cache", action="store_true", help="bypass the kernel cache")


def cli_compile(args: argparse.Namespace) -> int:
    """``ctxkit compile``: see :func:`run`."""
    return run(args)


class _Usage(Exception):
    """A command-line mistake: the message says what to pass instead."""


def run(args: argparse.Namespace) -> int:
    """Compile ``args.file`` and write the result; 0 on success, 1 on any error.

    ``args`` carries the attributes defined by :func:`add_arguments`.
    """
    from ..errors import CompileError, PtxVersionWarning

    src_path = Path(args.file)
    try:
        source = src_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return _fail(f"cannot read {src_path}: {exc}")
    try:
        arch, target = _arch_and_target(args.arch, args.target)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PtxVersionWarning)
            obj = _compile(args, source, str(src_path), arch, target)
        out = _output_path(args.output, src_path, obj.target)
    except _Usage as exc:
        return _fail(str(exc))
    except CompileError as exc:
        if not exc.name:  # no NVRTC call failed: NVRTC itself is missing
            return _fail(str(exc))
        print(str(exc), file=sys.stderr)
        return _fail(f"{src_path} failed to compile ({exc.name})")
    except ValueError as exc:
        if args.arch is None:
            return _fail(f"{exc}\nctxkit compile: pass --arch, e.g. --arch sm_90")
        return _fail(str(exc))
    try:
        obj.save(out)
    except OSError as exc:
        return _fail(f"cannot write {out}: {exc}")
    if obj.log:
        print(obj.log, file=sys.stderr)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if not _has_entry_points(obj.ptx):
        print(_no_kernels_warning(src_path, source), file=sys.stderr)
    cached = " (from cache)" if obj.from_cache else ""
    print(f"wrote {out} ({obj.target}, {obj.arch}, {len(obj.code)} bytes){cached}")
    for expr, mangled in obj.lowered_names.items():
        print(f"  {expr} -> {mangled}")
    return 0


def _fail(message: str) -> int:
    print(f"ctxkit compile: {message}", file=sys.stderr)
    return 1


def _compile(
    args: argparse.Namespace, source: str, name: str, arch: str | None, target: str
) -> Any:
    from ..compiler.program import compile

    return compile(
        source,
        name=name,
        arch=arch,
        target=target,
        defines=args.defines or None,
        include_dirs=args.include_dirs,
        name_expressions=args.name_expressions,
        std=args.std,
        cache=not args.no_cache,
    )


def _arch_and_target(arch: str | None, target: str | None) -> tuple[str | None, str]:
    """The arch for ``compile()`` and the target: ``compute_XY`` means PTX.

    Raises
    ------
    _Usage
        An arch this NVRTC does not know, or a cubin asked for a virtual arch.
    """
    if arch is None:
        return None, target or "auto"
    from ..compiler.nvrtc import arch_number, normalize_arch, nvrtc_version, supported_archs

    virtual = arch.strip().lower().startswith("compute_")
    real = normalize_arch(arch)  # ValueError names the accepted spellings
    known = supported_archs()
    if arch_number(real) not in known:
        nv = "{}.{}".format(*nvrtc_version())
        names = ", ".join(f"sm_{a}" for a in known)
        raise _Usage(
            f"NVRTC {nv} does not know the architecture {arch!r}; it compiles for {names}. "
            f"Pass one of those (PTX for the newest one runs on newer GPUs: "
            f"--arch compute_{known[-1]})"
        )
    if not virtual:
        return real, target or "auto"
    if target == "cubin":
        raise _Usage(
            f"{arch} is a virtual architecture, compiled to PTX; for a cubin pass --arch {real}"
        )
    return real, "ptx"


def _output_path(output: str | None, src_path: Path, target: str) -> Path:
    if output:
        return Path(output)
    out = Path(f"{src_path.stem}.{target}")
    if out.resolve() == src_path.resolve():
        raise _Usage(f"the output would overwrite {src_path}; name another file with -o")
    return out


_ENTRY_RE = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s", re.MULTILINE)


def _has_entry_points(ptx: str | None) -> bool:
    return ptx is None or _ENTRY_RE.search(ptx) is not None


def _no_kernels_warning(src_path: Path, source: str) -> str:
    text = f"warning: {src_path} compiled to code with no kernels (no .entry)"
    if re.search(r"template\s*<", source):
        return (
            f"{text}: template kernels exist only once instantiated; pass "
            "--name-expression for each, e.g. --name-expression 'axpy<float>'"
        )
    return f'{text}: kernels are __global__ functions (extern "C" keeps their names)'
