"""What NVRTC can read for a program: the files its ``#include`` directives reach.

A cached kernel is stale when a header it was compiled from changes, so the cache key
holds a fingerprint of every file NVRTC would open. :func:`fingerprint` resolves each
directive with NVRTC's own rules (checked against NVRTC 12 and 13):

* ``#include "x.h"``: the directory of the including file (for the program itself the
  directory part of its ``name``, i.e. the *working directory* when the name has none),
  unless ``--no-source-include`` is given; then each ``-I`` directory in order.
* ``#include <x.h>``: the ``-I`` directories only.
* a name given in ``headers=`` wins over any file, from any including file.

Each file found adds its path and the SHA-256 of its contents; each candidate tried
before it adds "absent", so a new header that would shadow the one used changes the key
too. Contents, not timestamps, go into the key: touching a header, or checking out a
branch and back, keeps the cached kernel.
``-include``/``--pre-include`` files and ``__has_include`` tests count as includes.
Directives inside comments or ``#if 0`` are followed as well (a superset is safe). The
CUDA include directories are not followed: a canary file per directory stands for them
(:func:`ctxkit.compiler.nvrtc.cuda_dirs_fingerprint`).

A warm lookup costs one ``stat`` per candidate path, whatever the size of the include
directories: a header's digest and directives are remembered per ``(size, mtime, ctime,
inode)``, except for a header changed within :data:`RACY_NS` of being read (timestamps
are coarse; it is read again until it has aged).
A computed include (``#include MACRO``) cannot be resolved statically; then the whole
of every search directory is fingerprinted instead (bounded, see
:func:`tree_fingerprint`). At most :data:`MAX_FILES` headers are followed.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["MAX_FILES", "directives", "fingerprint", "search_path", "tree_fingerprint"]


#: Headers followed per program at most (edits past the limit go unseen).
MAX_FILES = 4096


_DIRECTIVE_RE = re.compile(
    r"#[ \t]*include(?:_next)?[ \t]*([<\"])([^>\"\n]+)[>\"]"
    r"|__has_include(?:_next)?[ \t]*\([ \t]*([<\"])([^>\"\n]+)[>\"]"
)


_COMPUTED_RE = re.compile(r"^[ \t]*#[ \t]*include(?:_next)?[ \t]+[A-Za-z_]", re.MULTILINE)


_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


_MAX_HEADER_BYTES = 64 << 20


Directive = tuple[bool, str]  # (quoted, name as written)


@lru_cache(maxsize=1024)
def directives(text: str) -> tuple[tuple[Directive, ...], bool]:
    """The include directives of *text* and whether it has a computed include."""
    if "include" not in text:
        return (), False
    text = text.replace("\\\r\n", "").replace("\\\n", "")
    found: dict[Directive, None] = {}
    for m in _DIRECTIVE_RE.finditer(text):
        quote, target = m.group(1, 2) if m.group(1) else m.group(3, 4)
        if target.strip():
            found[(quote == '"', target.strip())] = None
    return tuple(found), _COMPUTED_RE.search(text) is not None


@dataclass(frozen=True)
class SearchPath:
    """Where NVRTC looks for headers, from a program's name and options."""

    source_dir: str | None  # the program's own directory; None with --no-source-include
    dirs: tuple[str, ...]  # the -I directories, in order
    cuda_dirs: tuple[str, ...]  # the CUDA include directories (searched last, not followed)
    pre_includes: tuple[str, ...]  # -include / --pre-include files


def _option_values(options: Sequence[str], short: str, long: str) -> list[str]:
    """Values of ``-Xvalue``, ``-X value``, ``--long=value`` and ``--long value``."""
    out: list[str] = []
    for i, opt in enumerate(options):
        if opt in (short, long):
            out.extend(v for v in options[i + 1 : i + 2] if v)
        elif opt.startswith(long + "="):
            out.append(opt[len(long) + 1 :])
        elif short == "-I" and opt.startswith("-I"):
            out.append(opt[2:].removeprefix("="))
    return out


def search_path(name: str, options: Sequence[str], cuda_dirs: Iterable[str]) -> SearchPath:
    """The :class:`SearchPath` NVRTC uses for a program *name* compiled with *options*."""
    return _search_path(name, tuple(options), tuple(cuda_dirs), os.getcwd())


@lru_cache(maxsize=256)
def _search_path(
    name: str, options: tuple[str, ...], cuda_dirs: tuple[str, ...], cwd: str
) -> SearchPath:
    no_source = any(o in ("--no-source-include", "-no-source-include") for o in options)
    return SearchPath(
        source_dir=None if no_source else os.path.abspath(os.path.dirname(name)),
        dirs=tuple(os.path.abspath(d) for d in _option_values(options, "-I", "--include-path")),
        cuda_dirs=tuple(os.path.abspath(d) for d in cuda_dirs),
        pre_includes=tuple(_option_values(options, "-include", "--pre-include")),
    )


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@dataclass(frozen=True)
class _Header:
    """What a header file holds, as read at one ``stat`` signature."""

    signature: tuple[int, ...]
    digest: str  # of the contents: what goes into the cache key
    found: tuple[tuple[Directive, ...], bool]  # its directives
    racy: bool  # changed too recently for its signature to tell later edits apart


#: A file changed less than this long before it was read may change again with the same
#: size and timestamps (file systems keep coarse times); it is read again each time.
RACY_NS = 2_000_000_000


_headers: dict[str, _Header] = {}


def _now_ns() -> int:
    return time.time_ns()


def _header(path: str, st: os.stat_result) -> _Header | None:
    """The contents' digest and directives of *path* (remembered per signature)."""
    sig = _signature(st)
    known = _headers.get(path)
    if known is not None and known.signature == sig and not known.racy:
        return known
    try:
        fd = os.open(path, _READ_FLAGS)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = os.read(fd, _MAX_HEADER_BYTES)
        finally:
            os.close(fd)
    except OSError:
        return None
    racy = _now_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS
    text = data.decode("utf-8", "replace")
    info = _Header(sig, hashlib.sha256(data).hexdigest(), directives(text), racy)
    if len(_headers) >= 4 * MAX_FILES:
        _headers.clear()
    _headers[path] = info
    return info


class _Scan:
    def __init__(self, sp: SearchPath, headers: Mapping[str, str]) -> None:
        self.sp = sp
        self.headers = headers
        self.files: dict[str, str | None] = {}
        self.followed: set[str] = set()
        self.computed = False
        self.truncated = False
        self.todo: list[tuple[tuple[Directive, ...], str | None]] = []

    def add_text(self, found: tuple[tuple[Directive, ...], bool], includer: str | None) -> None:
        self.computed |= found[1]
        if found[0]:
            self.todo.append((found[0], includer))

    def candidates(self, quoted: bool, target: str, includer: str | None) -> list[str]:
        """The paths NVRTC tries for *target*, in order (the CUDA include directories,
        searched last and not followed, need no look: whatever they hold adds nothing)."""
        if os.path.isabs(target):
            return [target]
        first = [includer] if quoted and includer is not None else []
        return [os.path.join(d, target) for d in (*first, *self.sp.dirs)]

    def resolve(self, quoted: bool, target: str, includer: str | None) -> None:
        if target in self.headers:
            tag = "headers:" + target
            if tag not in self.followed:
                self.followed.add(tag)
                base = self.sp.source_dir
                here = os.path.join(base, os.path.dirname(target)) if base is not None else None
                self.add_text(directives(self.headers[target]), here)
            return
        for path in self.candidates(quoted, target, includer):
            try:
                st = os.stat(path)
            except (OSError, ValueError):
                st = None
            info = _header(path, st) if st is not None and stat.S_ISREG(st.st_mode) else None
            self.files[path] = info.digest if info is not None else None
            if info is None:
                continue
            if path not in self.followed and len(self.followed) >= MAX_FILES:
                self.truncated = True
            elif path not in self.followed:
                self.followed.add(path)
                includer = os.path.dirname(path) if self.sp.source_dir is not None else None
                self.add_text(info.found, includer)
            return


def fingerprint(
    source: str,
    name: str,
    headers: Mapping[str, str],
    options: Sequence[str],
    cuda_dirs: Iterable[str] = (),
) -> list[Any]:
    """A JSON-able fingerprint of every file NVRTC can read for this program.

    Empty when the program includes nothing from disk. See the module docstring.
    """
    pre_includes = _option_values(options, "-include", "--pre-include")
    if not pre_includes and not any(any(directives(t)) for t in (source, *headers.values())):
        return []
    sp = search_path(name, options, cuda_dirs)
    scan = _Scan(sp, headers)
    scan.add_text(directives(source), sp.source_dir)
    scan.add_text((tuple((True, p) for p in sp.pre_includes), False), sp.source_dir)
    while scan.todo:
        items, includer = scan.todo.pop()
        for quoted, target in items:
            scan.resolve(quoted, target, includer)
    out: list[Any] = [[path, digest] for path, digest in scan.files.items()]
    if scan.computed:
        roots = [sp.source_dir] if sp.source_dir is not None else []
        out.append(["computed include", tree_fingerprint([*roots, *sp.dirs])])
    if scan.truncated:
        out.append(["truncated", MAX_FILES])
    return out


_HEADER_SUFFIXES = frozenset(
    {"", ".h", ".hh", ".hpp", ".hxx", ".cuh", ".inl", ".inc", ".ipp", ".tcc", ".cu", ".def"}
)


def tree_fingerprint(dirs: Iterable[str], limit: int = 2000) -> list[Any]:
    """``(relative path, size, mtime, ctime, inode)`` of the header-like files under each
    directory.

    Only header-like files count (``.h``, ``.cuh``, ``.hpp``, ``.cu``..., or no suffix),
    so compiler outputs written there do not. Hidden directories are skipped and at most
    *limit* entries are visited per directory, so a huge tree costs a bounded number of
    ``stat`` calls (edits past the limit go unseen).
    """
    return [[os.path.abspath(d), _tree_files(d, limit)] for d in dirs]


def _tree_files(d: str, limit: int) -> list[Any]:
    """The entries of :func:`tree_fingerprint` for the directory *d*."""
    files: list[Any] = []
    visited = 0
    for root, subdirs, names in os.walk(d):
        subdirs[:] = sorted(s for s in subdirs if not s.startswith(".") and s != "__pycache__")
        visited += len(subdirs)
        for name in sorted(names):
            visited += 1
            if os.path.splitext(name)[1].lower() not in _HEADER_SUFFIXES:
                continue
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:
                continue
            files.append([os.path.relpath(os.path.join(root, name), d), *_signature(st)[:4]])
            if visited >= limit:
                return files
        if visited >= limit:
            return files
    return files
