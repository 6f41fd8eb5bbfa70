"""The one table of CTXKIT_* variables (ctxkit/_env.py) and its readers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ctxkit._env import VARIABLES, env_flag, env_off, env_text

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_docs_table_is_the_env_table():
    rows = re.findall(r"^\| `(CTXKIT_[A-Z_]+)` \| (.*?) \| (.*?) \| .+ \|$", DOCS.read_text(), re.M)
    assert [r[0] for r in rows] == list(VARIABLES)
    for name, kind, default in rows:
        assert (kind, default) == (VARIABLES[name].type, VARIABLES[name].default), name


def test_a_variable_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="VARIABLES"):
        env_text("CTXKIT_NO_SUCH_THING")
    with pytest.raises(KeyError):
        env_flag("CTXKIT_AUTO_BIND")


@pytest.mark.parametrize(
    ("value", "on", "off"),
    [
        ("1", True, False),
        (" Yes ", True, False),
        ("off", False, True),
        ("", False, False),
        ("maybe", False, False),
    ],
)
def test_flags(monkeypatch, value, on, off):
    monkeypatch.setenv("CTXKIT_STRICT_ASYNC", value)
    assert (env_flag("CTXKIT_STRICT_ASYNC"), env_off("CTXKIT_STRICT_ASYNC")) == (on, off)
    assert env_text("CTXKIT_STRICT_ASYNC") == value.strip()
