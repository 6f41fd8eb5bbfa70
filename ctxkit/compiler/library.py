"""The kernel library: CUDA C++ sources and hand-written PTX shipped in ``ptx/``.

In a wheel the files live in ``ctxkit/ptx/`` (see ``[tool.setuptools]`` in
pyproject.toml); in a source checkout (``PYTHONPATH=.``) they are ``../ptx/``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["kernel_names", "kernel_path", "kernel_source"]


def _ptx_dir() -> Path:
    here = Path(__file__).resolve().parent.parent  # the ctxkit package
    for candidate in (here / "ptx", here.parent / "ptx"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"the ctxkit kernel library (ptx/) is missing next to {here}; reinstall ctxkit"
    )


def kernel_names() -> list[str]:
    """File names in the kernel library (``*.cu`` sources and hand-written ``*.ptx``)."""
    return sorted(p.name for p in _ptx_dir().iterdir() if p.suffix in (".cu", ".cuh", ".ptx"))


def kernel_path(name: str) -> Path:
    """Path of a kernel library file; ``"saxpy"`` means ``"saxpy.cu"``.

    Raises
    ------
    FileNotFoundError
        No such file; the message lists the files there are.
    """
    directory = _ptx_dir()
    base = Path(name).name
    for candidate in (base, base + ".cu"):
        p = directory / candidate
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"no kernel {name!r} in the ctxkit kernel library ({directory}); available: "
        f"{', '.join(kernel_names())}"
    )


def kernel_source(name: str) -> str:
    """Text of a kernel library file (``ptx/<name>``), e.g. ``kernel_source("saxpy.cu")``."""
    return kernel_path(name).read_text(encoding="utf-8")
