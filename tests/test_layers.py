"""The layers of docs/design.md §8: every module under src/eyas belongs to one, and imports go one
way, down ORDER (a module may import its own layer and those below it, never one above). Every
`import` / `from` counts, function-local ones too; `from eyas import targets` imports eyas.targets."""

import ast
from pathlib import Path

ORDER = ("cli", "stages", "doctor", "serve", "runtime", "targets", "cpu", "config", "formats", "core", "errors")

SRC = Path(__file__).resolve().parents[1] / "src" / "eyas"
FILE_LAYERS = ("cli", "config", "errors")  # single modules at the top level; the others are folders
EXEMPT = {"__init__.py", "__main__.py"}  # the package's own, at the top level

def layer_of(rel: Path) -> str | None:
    """`stages/train.py` -> stages, `cli.py` -> cli; None for a module outside every layer."""
    if len(rel.parts) == 1:
        return rel.stem if rel.stem in FILE_LAYERS else None
    return rel.parts[0] if rel.parts[0] in ORDER and rel.parts[0] not in FILE_LAYERS else None


def imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (a relative import keeps its dots: eyas has none)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        mod = "." * node.level + (node.module or "")
        return [f"eyas.{a.name}" for a in node.names] if mod == "eyas" else [mod]
    return []


def modules() -> list[Path]:
    return sorted(p.relative_to(SRC) for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_belongs_to_a_layer():
    unplaced = [str(rel) for rel in modules() if layer_of(rel) is None and str(rel) not in EXEMPT]
    assert not unplaced, f"modules outside every layer of ORDER: {unplaced}"


def test_imports_go_down_the_layers():
    messages = []
    for rel in modules():
        own = layer_of(rel)
        if own is None:
            continue
        for node in ast.walk(ast.parse((SRC / rel).read_text(), str(rel))):
            for mod in imported(node):
                parts = mod.split(".")
                other = parts[1] if parts[0] == "eyas" and len(parts) > 1 else None
                if mod.startswith(".") or (other in ORDER and ORDER.index(other) < ORDER.index(own)):
                    messages.append(f"src/eyas/{rel.as_posix()}:{node.lineno}: {own} imports {mod}")
    assert not messages, "imports of a layer above the module's own:\n" + "\n".join(messages)
