"""The doctor against the real engine: build every fault class, ask both, compare the verdicts.

How verdicts map (the contract tested in tests/doctor/test_doctor_vllm.py):
- engine side: `refuses` (vLLM raised while starting), `fails` (it started, then raised while
  serving) and `collapses` (acceptance below 1 + 0.5 * (healthy - 1)) mean *broken*;
  `unaffected` means *serves*.
- doctor side (`eyas doctor --engine vllm --target T`): any error finding means *broken*;
  warnings and infos mean *serves* (a warning names something to look at that does not
  change what vLLM computes, e.g. a t2d vLLM never reads).
A fault class agrees when both sides say the same. `needs_target` classes (aux ids against the
target's depth) are judged on the `--target` verdict; the verdict without it is shown beside.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eyas.doctor.faults import FAULTS, build
from eyas.doctor.vllm_probe import EngineOutcome, probe

log = logging.getLogger(__name__)
BROKEN = ("refuses", "fails", "collapses")


@dataclass
class Row:
    """One fault class in one layout: what vLLM did and what the doctor said."""

    fault: str
    layout: str
    what: str
    path: str
    engine: str = ""  # refuses | fails | collapses | unaffected
    accept_len: float | None = None
    error: str = ""
    doctor: str = ""  # error | warning | clean (with --target)
    doctor_no_target: str = ""
    findings: list[str] = field(default_factory=list)  # error (or warning) finding ids

    @property
    def agree(self) -> bool:
        return (self.engine in BROKEN) == (self.doctor == "error")


def build_all(healthy: dict[str, Path], out: Path, cases: list[str] | None = None) -> list[Row]:
    """Broken exports for every fault in every layout it applies to, or only the `cases` named
    ('FAULT' for all its layouts, 'FAULT-LAYOUT' for one)."""
    rows = []
    for f in FAULTS:
        for layout in f.layouts:
            if cases and f.name not in cases and f"{f.name}-{layout}" not in cases:
                continue
            if layout in healthy:
                p = build(f, healthy[layout], Path(out) / f"{f.name}-{layout}")
                rows.append(Row(f.name, layout, f.what, str(p)))
    return rows


def doctor_verdict(ckpt: Path, target: str | None) -> tuple[str, list[str]]:
    """('error' | 'warning' | 'clean', ids of the worst severity) of `eyas doctor --engine vllm`."""
    from eyas.doctor.run import DoctorOptions, diagnose

    rep = diagnose(DoctorOptions(Path(ckpt), target, ("vllm",), True))
    for sev in ("error", "warning"):
        ids = sorted(set(rep.ids(sev)))
        if ids:
            return sev, ids
    return "clean", []


def ask_doctor(rows: list[Row], target: str) -> None:
    for r in rows:
        r.doctor, r.findings = doctor_verdict(Path(r.path), target)
        r.doctor_no_target, _ = doctor_verdict(Path(r.path), None)


def ask_engine(rows: list[Row], target: Path, prompts: Path, cache: Path | None = None, **kw) -> dict[str, float]:
    """Serve every row in real vLLM; classify against each layout's healthy acceptance.
    `cache` (a json file) keeps the outcomes: rows already in it are not served again."""
    known: dict[str, EngineOutcome] = {}
    if cache is not None and Path(cache).is_file():
        known = {d["drafter"]: EngineOutcome(**d) for d in json.loads(Path(cache).read_text())}
    todo = [Path(r.path) for r in rows if r.path not in known]
    outcomes = {**known, **(probe(target, todo, prompts, **kw) if todo else {})}
    if cache is not None:
        Path(cache).write_text(json.dumps([asdict(o) for o in outcomes.values()], indent=2))
    healthy = {r.layout: outcomes[r.path].accept_len for r in rows if r.fault == "healthy"}
    for r in rows:
        o = outcomes[r.path]
        ref = healthy.get(r.layout)
        if ref is None:
            raise RuntimeError(f"the healthy {r.layout} export did not serve ({o.error}); nothing to compare with")
        r.engine, r.accept_len, r.error = o.classify(ref), o.accept_len, o.error
    return healthy


def table(rows: list[Row], healthy: dict[str, float]) -> str:
    """The matrix as markdown."""
    head = ("| fault class | layout | what | vLLM outcome | acceptance / error | doctor (--target) | doctor (no target) "
            "| findings | agree |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ev = f"{r.accept_len:.2f}" if r.accept_len is not None else r.error.replace("|", "/")[:160]
        lines.append(f"| {r.fault} | {r.layout} | {r.what} | {r.engine} | {ev} | {r.doctor} | {r.doctor_no_target} | "
                     f"{', '.join(r.findings)} | {'yes' if r.agree else '**NO**'} |")
    agree = sum(r.agree for r in rows)
    base = ", ".join(f"{k} {v:.2f}" for k, v in healthy.items())
    lines.append(f"\n{agree}/{len(rows)} agree. Healthy acceptance: {base}; collapse = below 1 + 0.5 x (healthy - 1).")
    return "\n".join(lines)

