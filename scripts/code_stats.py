"""Shape measures of the package (issue 57): lines per module, the longest functions, lines over
120 characters. Run on any checkout to compare before and after a change:

    python scripts/code_stats.py [SRC_DIR] [--top N]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def functions(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in `path`."""
    tree = ast.parse(path.read_text())
    out = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
    walk(tree, "")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", nargs="?", default="src/eyas", type=Path)
    p.add_argument("--top", type=int, default=10)
    a = p.parse_args()
    files = sorted(a.src.rglob("*.py"))
    sizes = sorted(((len(f.read_text().splitlines()), f.relative_to(a.src).as_posix()) for f in files), reverse=True)
    total = sum(n for n, _ in sizes)
    top_level = sum(n for n, name in sizes if "/" not in name and name not in ("cli.py", "config.py", "errors.py",
                                                                                "__init__.py", "__main__.py"))
    print(f"{len(files)} modules, {total} lines; outside the declared layers (top-level modules other than cli, "
          f"config, errors): {top_level} lines ({top_level / total:.0%})")
    print(f"largest modules: " + ", ".join(f"{name} {n}" for n, name in sizes[: a.top]))
    funcs = sorted(((n, f"{f.relative_to(a.src).as_posix()}:{name}") for f in files for n, name in functions(f)),
                   reverse=True)
    print(f"longest functions: " + ", ".join(f"{name} {n}" for n, name in funcs[: a.top]))
    long_lines = sum(1 for f in files for line in f.read_text().splitlines() if len(line) > 120)
    print(f"lines over 120 characters: {long_lines}")


if __name__ == "__main__":
    main()
