"""``ctxkit compile FILE.cu``: NVRTC from the command line; no GPU needed with ``--arch``.

The output goes to the current directory (``FILE.cubin``, or ``FILE.ptx`` for PTX)
unless ``-o`` names a file. ``--arch sm_XY`` makes a cubin and ``--arch compute_XY``
PTX; an architecture this NVRTC does not know is an error. Template kernels need
``--name-expression``: their mangled names are printed. Every error exits 1.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import stat
import sys
import warnings
from pathlib import Path

__all__ = ["DESCRIPTION", "MAX_SOURCE_BYTES", "add_arguments", "run"]


#: The largest source file ``ctxkit compile`` reads (bytes); NVRTC takes far longer
#: on anything near it.
MAX_SOURCE_BYTES = 64 << 20


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
        help="output kind (default: cubin, or ptx with --arch compute_XY)",
    )
    p.add_argument(
        "-o",
        "--output",
        help="output file (default: FILE.cubin or FILE.ptx in the current directory)",
    )
    repeatable = functools.partial(p.add_argument, action="append", default=[])
    repeatable(
        "-D",
        dest="defines",
        metavar="NAME[=VALUE]",
        help="define a preprocessor macro, e.g. -D N=4 or -DFAST (repeatable)",
    )
    repeatable(
        "-I",
        dest="include_dirs",
        metavar="DIR",
        help='add DIR to the header search path (repeatable); #include "x.h" also '
        "looks next to FILE",
    )
    repeatable(
        "--name-expression",
        dest="name_expressions",
        metavar="EXPR",
        help="instantiate a template kernel, e.g. --name-expression 'axpy<float>' "
        "(repeatable); its mangled name is printed, for Module.function()",
    )
    p.add_argument("--std", help="C++ standard, e.g. c++17")
    p.add_argument("--no-cache", action="store_true", help="bypass the kernel cache")


class _Usage(ValueError):
    """A command-line mistake: the message says what to pass instead (reported as any
    other ``ValueError`` of a compile is)."""


def run(args: argparse.Namespace) -> int:
    """Compile ``args.file`` and write the result; 0 on success, 1 on any error.

    ``args`` carries the attributes defined by :func:`add_arguments`.
    """
    from ..compiler.program import compile
    from ..errors import CompileError, PtxVersionWarning

    src_path = Path(args.file)
    try:
        source = _read_source(src_path)
    except (OSError, UnicodeDecodeError) as exc:
        return _fail(f"cannot read {src_path}: {exc}")
    except _Usage as exc:
        return _fail(str(exc))
    try:
        if args.output:
            _refuse_source(Path(args.output), src_path, f"-o {args.output}")
        arch, target = _arch_and_target(args.arch, args.target)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PtxVersionWarning)
            obj = compile(
                source,
                name=str(src_path),
                arch=arch,
                target=target,
                defines=args.defines or None,
                include_dirs=args.include_dirs,
                name_expressions=args.name_expressions,
                std=args.std,
                cache=not args.no_cache,
            )
        out = _output_path(args.output, src_path, obj.target)
    except CompileError as exc:
        if not exc.name:  # no NVRTC call failed: NVRTC itself is missing
            return _fail(str(exc))
        print(str(exc), file=sys.stderr)
        return _fail(f"{src_path} failed to compile ({exc.name})")
    except ValueError as exc:
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


def _read_source(path: Path) -> str:
    """The text of *path*, a regular file of at most :data:`MAX_SOURCE_BYTES`.

    Opened without blocking, so a FIFO without a writer is refused rather than waited on.

    Raises
    ------
    _Usage
        *path* is not a regular file (a FIFO, a device such as ``/dev/zero``, a
        directory) or is larger than the limit.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(mode := os.fstat(fd).st_mode):
            raise _Usage(f"{path} is {_file_kind(mode)}, not a source file; pass a .cu file")
        with open(fd, "rb", closefd=False) as fh:  # reads until the limit or the end
            data = fh.read(MAX_SOURCE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SOURCE_BYTES:
        mib, rest = divmod(MAX_SOURCE_BYTES, 1 << 20)
        limit = f"{mib} MiB" if mib and not rest else f"{MAX_SOURCE_BYTES} bytes"
        raise _Usage(f"{path} is larger than {limit}, the most ctxkit compile reads as a source")
    return data.decode("utf-8")


def _file_kind(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((text for test, text in kinds.items() if test(mode)), "not a regular file")


def _refuse_source(out: Path, src_path: Path, flag: str) -> None:
    """Raise :class:`_Usage` when writing *out* would overwrite the source file."""
    try:
        same = os.path.samefile(out, src_path)  # also a hard link or a symlink to it
    except OSError:
        same = out.resolve() == src_path.resolve()
    if same:
        raise _Usage(
            f"{flag} would overwrite the source file {src_path}; name another output "
            f"file, e.g. -o {src_path.stem}.cubin"
        )


def _fail(message: str) -> int:
    print(f"ctxkit compile: {message}", file=sys.stderr)
    return 1


def _arch_and_target(arch: str | None, target: str | None) -> tuple[str | None, str]:
    """The arch for ``compile()`` and the target: ``compute_XY`` means PTX.

    Raises
    ------
    _Usage
        An arch this NVRTC does not know, or a cubin asked for a virtual arch.
    """
    if arch is None:
        return _device_arch(), target or "auto"
    from ..compiler.nvrtc import arch_number, normalize_arch, nvrtc_version, supported_archs

    virtual = arch.strip().lower().startswith("compute_")
    try:
        real = normalize_arch(arch)
    except ValueError:
        raise _Usage(
            f"--arch {arch} is not an architecture; pass sm_XY for a cubin or compute_XY "
            "for PTX, e.g. --arch sm_90 or --arch compute_90"
        ) from None
    if arch_number(real) not in (known := supported_archs()):
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


def _device_arch() -> str:
    """The arch of this machine's GPU, for a compile without ``--arch``."""
    from ..compiler.program import device_arch

    try:
        return device_arch()
    except ValueError as exc:
        raise _Usage(
            f"no --arch given and no GPU here ({exc}); pass --arch, e.g. --arch sm_90 "
            "(cubin) or --arch compute_90 (PTX)"
        ) from None


def _output_path(output: str | None, src_path: Path, target: str) -> Path:
    if output:
        return Path(output)
    out = Path(f"{src_path.stem}.{target}")
    _refuse_source(out, src_path, f"the default output {out}")
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
