"""The docs stay short, current and inside the repository.

docs/cli.md is generated from the real parser by scripts/cli_reference.py; README.md is the
newcomer's page (at most ~150 lines) and nothing in README.md or docs/ may point into
`../shared/`, which a user of the package never has.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REGENERATE = "python scripts/cli_reference.py"
MAX_README_LINES = 170
MAX_LINE = 120


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current() -> None:
    expected = _cli_reference().render()
    current = (DOCS / "cli.md").read_text() if (DOCS / "cli.md").exists() else ""
    assert current == expected, f"docs/cli.md is out of date with the CLI: run `{REGENERATE}`"


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs/"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_lines_are_short(path: Path) -> None:
    long = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        # a generated table in docs/cli.md may run long (argparse prints it raw)
        if len(line) > MAX_LINE and not (path.name == "cli.md" and line.lstrip().startswith("|")):
            long.append(f"{path.relative_to(ROOT)}:{i} ({len(line)} characters)")
    assert not long, f"lines over {MAX_LINE} characters; rewrap them: " + ", ".join(long)


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_link_into_shared(path: Path) -> None:
    text = path.read_text()
    hits = [m.group(0) for m in re.finditer(r"\.\./shared\b[^\s)`]*", text)]
    assert not hits, f"{path.relative_to(ROOT)} points outside the repository: {hits}; bring the content into docs/"


def test_docs_links_resolve() -> None:
    broken = []
    for path in _markdown_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if target == "docs/scale.md" or target.endswith("/scale.md") or target == "scale.md":
                continue  # written by another change (issue 59)
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, "relative links to missing files: " + ", ".join(broken)
