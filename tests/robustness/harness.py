"""Table-driven bad-input harness: every case must exit 2 with one line naming the file or
flag, print no traceback, leave every input byte-identical and leave no output behind."""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Case:
    """One malformed input: `argv(env)` builds the command line from the artifact paths in
    `env`; `mutate(env, scratch)` copies a healthy artifact into scratch and breaks it."""

    id: str
    argv: Callable[[dict], list]
    mutate: Callable[[dict, Path], dict] | None = None
    expect: tuple[str, ...] = ()  # the error line must contain one of these (case-insensitive)
    code: int = 2
    out_preexists: bool = False  # the case plants --out itself (it is then an input)


def tree_hash(root: Path) -> dict[str, str]:
    """sha256 of every file under root, plus every directory (marked 'dir')."""
    out = {}
    root = Path(root)
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[rel] = "dir"
    return out


def run_case(case: Case, env: dict, scratch: Path, cli) -> str:
    """Apply the case, run the CLI, and check the four promises; returns the error line."""
    env = dict(env)
    scratch.mkdir(parents=True, exist_ok=True)
    env["scratch"] = scratch
    env["out"] = scratch / "out"
    if case.mutate is not None:
        env = case.mutate(env, scratch) or env
    out = Path(env["out"])
    roots = [Path(env["root"]), scratch]
    before = [tree_hash(r) for r in roots]
    code, stdout, stderr = cli(*[str(a) for a in case.argv(env)])
    after = [tree_hash(r) for r in roots]
    lines = error_lines(stderr)
    assert "Traceback" not in stderr, f"{case.id}: traceback printed:\n{stderr[-3000:]}"
    assert code == case.code, f"{case.id}: exit {code}, want {case.code}; stderr={stderr[-2000:]!r}"
    assert len(lines) == 1, f"{case.id}: want one error line, got {lines!r}; stdout={stdout[-500:]!r} stderr={stderr[-1500:]!r}"
    if case.expect:
        assert any(e.lower() in lines[0].lower() for e in case.expect), \
            f"{case.id}: {lines[0]!r} names none of {case.expect!r}"
    if not case.out_preexists:
        assert not out.exists(), f"{case.id}: output {out} was written"
    changed = _diff(before[0], after[0]) + _diff(before[1], after[1])
    assert not changed, f"{case.id}: inputs or scratch changed (new/removed/modified): {changed[:8]}"
    return lines[0]


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


_BAR = re.compile(r"^[^\n]*?\d+%\|[^|]*\|[^\]]*\]")  # a tqdm bar (label, percent, bar, stats)


def error_lines(stderr: str) -> list[str]:
    """The non-noise lines of stderr. A progress bar that was not closed before the error
    shares its terminal line with it; the bar prefix is cut off (reported as cosmetic)."""
    out = []
    for seg in stderr.replace("\r", "\n").splitlines():
        seg = _BAR.sub("", seg).strip()
        if seg and not _is_noise(seg):
            out.append(seg)
    return out


def _is_noise(line: str) -> bool:
    """Progress bars and log lines that precede the error are not the error message."""
    return (line.startswith(("INFO ", "DEBUG ", "WARNING ")) or "it/s]" in line or "%|" in line
            or "s/it]" in line)


def copy_artifact(src: Path, scratch: Path, name: str) -> Path:
    dst = Path(scratch) / name
    if Path(src).is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
    return dst
