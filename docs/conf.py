"""Sphinx configuration: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.

The API pages are built from the numpydoc docstrings by autodoc; importing ctxkit needs no
GPU or driver, so the docs build anywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

import ctxkit  # noqa: E402

project = "ctxkit"
author = "ctxkit contributors"
copyright = "ctxkit contributors"
release = ctxkit.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "myst_parser",
    "ctxkit_api",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext"]
root_doc = "index"

myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

html_theme = "alabaster"
html_title = f"ctxkit {release}"
html_static_path: list[str] = []
