"""``python -m ctxkit compile``: NVRTC from the command line, no GPU needed with --arch."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from ..compiler.program import compile
from ..errors import CompileError, PtxVersionWarning

__all__ = ["cli_compile", "run"]


def cli_compile(args: argparse.Namespace) -> int:
    """``python -m ctxkit compile FILE.cu``: write FILE.cubin/.ptx; exit 1 on any error."""
    pass

    return run(args)


def run(args: argparse.Namespace) -> int:
    """Compile ``args.file``; write FILE.cubin/.ptx (or ``-o``); exit code 1 on any error.

    ``args`` carries file, arch, target, output, defines, include_dirs, std, no_cache
    (the ``compile`` subparser of ``ctxkit.__main__``).
    """
    src_path = Path(args.file)
    try:
        source = src_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"ctxkit compile: cannot read {src_path}: {exc}", file=sys.stderr)
        return 1
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PtxVersionWarning)
            obj = compile(
                source,
                name=src_path.name,
                arch=args.arch,
                target=args.target or "auto",
                defines=args.defines or None,
                include_dirs=[str(src_path.parent or "."), *args.include_dirs],
                std=args.std,
                cache=not args.no_cache,
            )
    except CompileError as exc:
        print(str(exc), file=sys.stderr)
        print(f"ctxkit compile: {src_path} failed to compile ({exc.name})", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"ctxkit compile: {exc}", file=sys.stderr)
        if args.arch is None:
            print("ctxkit compile: pass --arch, e.g. --arch sm_90", file=sys.stderr)
        return 1
    out = Path(args.output) if args.output else src_path.with_suffix("." + obj.target)
    try:
        obj.save(out)
    except OSError as exc:
        print(f"ctxkit compile: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    if obj.log:
        print(obj.log, file=sys.stderr)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    cached = " (from cache)" if obj.from_cache else ""
    print(f"wrote {out} ({obj.target}, {obj.arch}, {len(obj.code)} bytes){cached}")
    return 0
