"""README.md and docs/ as a newcomer reads them: the first commands, the tour, the commands and
files they name, the configuration table (docs/configuration.md), and no words only this
project's tooling knows."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from tests.examples.test_examples import _private_uses

REPO = Path(__file__).resolve().parents[2]

README = REPO / "README.md"
#: Words only this project's own tooling knows; user-facing text says what the thing is.
JARGON = re.compile(
    r"device machine|steering repo|DESIGN\.md|\b\d{3}_[0-9a-f]{16}\.txt\b|issue \d+|"
    r"pattern \d+\b|the document'?s\b|source documents?\b",
    re.IGNORECASE,
)


def _user_facing_files() -> list[Path]:
    files = [README, REPO / "CHANGELOG.md", REPO / "pyproject.toml"]
    for folder, pattern in (
        ("docs", "*.md"),
        ("docs", "*.rst"),
        ("examples", "*.py"),
        ("examples", "*.ipynb"),
        ("ctxkit", "*.py"),
        ("scripts", "*"),
        ("benchmarks", "*.py"),
    ):
        files += [
            p for p in (REPO / folder).rglob(pattern) if p.is_file() and "_build" not in p.parts
        ]
    return sorted(set(files))


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    first = _code_blocks(text, "bash")[0]
    assert text.index("```bash") < text.index("\n## "), "the commands come before any section"
    lines = [ln.split("#")[0].strip() for ln in first.strip().splitlines()]
    assert lines == [
        'pip install -e ".[cu13]" && python -m ctxkit demo',
        'pip install -e ".[cu13,test]" && python -m pytest',
    ]


def test_user_facing_text_has_no_internal_jargon() -> None:
    hits = []
    for path in _user_facing_files():
        for i, line in enumerate(
            path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
        ):
            m = JARGON.search(line)
            if m:
                hits.append(f"{path.relative_to(REPO)}:{i}: {m.group(0)!r}")
    assert not hits, "say what the thing is instead:\n" + "\n".join(hits)


def test_no_install_hint_names_the_unrelated_ctxkit_package() -> None:
    wrong = re.compile(r"pip install ['\"]?ctxkit\[")
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for p in _user_facing_files()
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if wrong.search(line)
    ]
    assert not hits, "`ctxkit` on the package index is another project: " + ", ".join(hits)


def test_no_mention_of_the_old_gpu_test_folder() -> None:
    hits = [
        str(p.relative_to(REPO))
        for p in [*_user_facing_files(), REPO / "tests" / "conftest.py"]
        if "tests/gpu" in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert not hits, f"GPU tests live in tests/<family>/test_*_gpu.py now: {hits}"


def test_every_environment_variable_is_in_the_configuration_table_and_real() -> None:
    used = set()
    for path in (REPO / "ctxkit").rglob("*.py"):
        used |= set(re.findall(r"CTXKIT_[A-Z_]+", path.read_text(encoding="utf-8")))
    table = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(CTXKIT_[A-Z_]+)`", table, re.M))
    assert used - documented == set(), (
        f"add to the table in docs/configuration.md: {used - documented}"
    )
    assert documented - used == set(), f"no longer read by ctxkit: {documented - used}"
    assert (
        "docs/configuration.md" in README.read_text(encoding="utf-8").split("## Configuration")[1]
    )


def test_readme_commands_and_files_exist() -> None:
    from ctxkit.cli import build_parser

    text = README.read_text(encoding="utf-8")
    parser = build_parser("ctxkit")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    for block in _code_blocks(text, "bash"):
        for cmd in re.findall(r"(?:^|&& |python -m )ctxkit (\w[\w-]*)", block, re.M):
            assert cmd in commands, f"README runs `ctxkit {cmd}`, which does not exist"
    docs = " ".join(p.read_text(encoding="utf-8") for p in (REPO / "docs").rglob("*.md"))
    for name in set(
        re.findall(r"\b((?:examples|scripts|docs|benchmarks)/[\w./-]+\.\w+)", text + docs)
    ):
        assert (REPO / name).exists(), f"README/docs name {name}, which does not exist"


def test_readme_tour_is_python_with_public_names(tmp_path: Path) -> None:
    blocks = _code_blocks(README.read_text(encoding="utf-8"), "python")
    assert blocks, "the README has no Python tour"
    script = tmp_path / "tour.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    ast.parse(script.read_text(encoding="utf-8"))
    bad = _private_uses(script)
    assert not bad, "README tour: " + "; ".join(bad)


def test_readme_names_the_nvrtc_targets_of_this_nvrtc() -> None:
    from ctxkit.compiler import nvrtc_version, supported_archs

    major, minor = nvrtc_version()
    text = README.read_text(encoding="utf-8")
    listed = " ".join(str(a) for a in supported_archs())
    if (major, minor) == (13, 5):
        assert f"NVRTC 13.5 lists {listed}" in text
    else:
        assert f"NVRTC {major}." in text, f"the README says nothing about NVRTC {major}.x"
