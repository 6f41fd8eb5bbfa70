"""``.. ctxkit-module:: ctxkit.memory``: document a ctxkit module's public names once.

A public name is listed in the module's ``__all__`` or mapped to the module by
``ctxkit._EXPORTS`` (the top-level ``ck.X`` names). Families re-export a few names that
live elsewhere (``ctxkit.memory.PageableCopyWarning`` is ``ctxkit.errors``'s); such a name
is documented only where it is defined, so every object has exactly one entry to link to.
The directive expands to ``automodule`` (docstring only) plus one ``autoclass`` /
``autofunction`` / ``autodata`` per name.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.nodes import nested_parse_with_titles

log = logging.getLogger(__name__)

#: Modules with an API page; a name is documented in the most specific one it lives in.
DOCUMENTED = (
    "ctxkit.device",
    "ctxkit.context",
    "ctxkit.binding",
    "ctxkit.executor",
    "ctxkit.stream",
    "ctxkit.graph",
    "ctxkit.memory",
    "ctxkit.compiler",
    "ctxkit.module",
    "ctxkit.pipeline",
    "ctxkit.procs",
    "ctxkit.trace",
    "ctxkit.lifetime",
    "ctxkit.errors",
)


def public_names(module: str) -> list[str]:
    """The names *module* offers: its ``__all__`` plus the top-level names mapped to it."""
    import ctxkit

    mod = importlib.import_module(module)
    names = list(getattr(mod, "__all__", ()))
    short = module.removeprefix("ctxkit.")
    names += [n for n, m in ctxkit._EXPORTS.items() if m == short and n not in names]
    return names


def home(obj: Any) -> str | None:
    """The documented module *obj* is defined in (``None`` for plain values)."""
    where = getattr(obj, "__module__", None)
    if not isinstance(where, str) or not (inspect.isclass(obj) or callable(obj)):
        return None
    best = None
    for m in DOCUMENTED:
        if (where == m or where.startswith(m + ".")) and (best is None or len(m) > len(best)):
            best = m
    return best


def documented_here(module: str, name: str) -> bool:
    obj = getattr(importlib.import_module(module), name)
    where = home(obj)
    return where is None or where == module


def undocumented_members(cls: type) -> list[str]:
    """Public methods and properties *cls* defines without a docstring."""
    missing = []
    members = {k: v for c in (*implementation_bases(cls), cls) for k, v in vars(c).items()}
    for name, value in members.items():
        if name.startswith("_"):
            continue
        func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if (isinstance(value, property) or inspect.isfunction(func)) and not inspect.getdoc(func):
            missing.append(name)
    return missing


def implementation_bases(cls: type) -> list[type]:
    """The non-public ctxkit classes *cls* inherits from: their members are documented as
    the class's own."""
    public = {n for m in DOCUMENTED for n in public_names(m)}
    return [
        b
        for b in cls.__mro__[1:]
        if b.__module__.startswith("ctxkit.") and b.__name__ not in public
    ]


def directive_for(obj: Any) -> str:
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if callable(obj):
        return "autofunction"
    return "autodata"


def canonical_path(name: str) -> str:
    """Where the top-level ``ctxkit.<name>`` is documented, e.g. ``ctxkit.memory.DeviceBuffer``."""
    import ctxkit

    obj = getattr(ctxkit, name)
    if inspect.ismodule(obj):
        return obj.__name__
    where = home(obj)
    if where is not None:
        return f"{where}.{name}"
    short = ctxkit._EXPORTS.get(name)
    return f"ctxkit.{short}.{name}" if short else f"ctxkit.{name}"


class CtxkitModule(Directive):
    required_arguments = 1

    def run(self) -> list[Any]:
        module = self.arguments[0]
        mod = importlib.import_module(module)
        lines = [f".. automodule:: {module}", "   :no-members:", ""]
        for name in public_names(module):
            if not documented_here(module, name):
                continue
            obj = getattr(mod, name)
            if not inspect.getdoc(obj) and (inspect.isclass(obj) or callable(obj)):
                self._warn(f"{module}.{name} has no docstring")
            lines.append(f".. {directive_for(obj)}:: {module}.{name}")
            if inspect.isclass(obj):
                for member in undocumented_members(obj):
                    self._warn(f"{module}.{name}.{member} is public but has no docstring")
                lines.append("   :members:")
                private = implementation_bases(obj)
                if private:
                    others = [b.__name__ for b in obj.__mro__[1:] if b not in private]
                    lines.append(f"   :inherited-members: {', '.join(others)}")
                if not issubclass(obj, BaseException):
                    lines.append("   :special-members: __call__, __enter__, __exit__")
            lines.append("")
        content = StringList(lines, source=f"<ctxkit-module {module}>")
        node = nodes.section()
        nested_parse_with_titles(self.state, content, node)
        return node.children

    def _warn(self, message: str) -> None:
        env = self.state.document.settings.env
        log.warning(message, location=(env.docname, self.lineno))


class CtxkitToplevel(Directive):
    """A table: every ``ctxkit.<name>`` and the entry that documents it."""

    def run(self) -> list[Any]:
        import ctxkit

        rows = [".. list-table::", "   :header-rows: 1", "", "   * - name", "     - documented at"]
        for name in ctxkit.__all__:
            if name.startswith("_"):
                continue
            path = canonical_path(name)
            role = "mod" if inspect.ismodule(getattr(ctxkit, name)) else "obj"
            rows += [f"   * - ``ctxkit.{name}``", f"     - :py:{role}:`{path}`"]
        content = StringList(rows, source="<ctxkit-toplevel>")
        node = nodes.section()
        nested_parse_with_titles(self.state, content, node)
        return node.children


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("ctxkit-module", CtxkitModule)
    app.add_directive("ctxkit-toplevel", CtxkitToplevel)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
