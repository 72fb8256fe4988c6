"""The doctor against the real engine: build fault classes, ask both, compare the verdicts.

How verdicts map (the contract tested in tests/doctor/test_doctor_vllm.py):
- engine side (`eyas.serve.vllm_serve.serve_series`): `refuses` (vLLM raised while starting),
  `fails` (it started, then raised while serving) and `collapses` (acceptance below
  1 + 0.5 * (healthy - 1)) mean *broken*; `unaffected` means *serves*.
- doctor side (`eyas doctor DIR --engine vllm --target T --json`): any error finding means
  *broken*; warnings and infos mean *serves* (a warning names something to look at that does
  not change what vLLM computes, e.g. a t2d vLLM never reads).
A fault class agrees when both sides say the same. `needs_target` classes (aux ids against the
target's depth) are judged on the `--target` verdict; the verdict without it is shown beside.

Every export of one comparison is served in one child process, one `LLM` after another
(fp32, greedy, k = 3, eager, all prompts in flight, every request `new_tokens` long).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from eyas.serve.vllm_engine import speculative_config
from eyas.serve.vllm_serve import SERVES, Outcome, ServeJob, serve_series

from doctor_faults import FAULTS, build  # bench/doctor_faults.py, beside this file

log = logging.getLogger(__name__)
BROKEN = ("refuses", "fails", "collapses")
K, NEW_TOKENS, NUM_PROMPTS = 3, 48, 4
MAX_MODEL_LEN = 1024
COLLAPSE_SHARE = 0.5  # collapse: losing more than half of what the healthy drafter gains
JOB_TIMEOUT_S = 300.0  # one export: a start (25-60 s on 2 cores) and four short requests


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
    new_tokens: int | None = None  # tokens generated per request when served (None: the comparison's own)

    @property
    def name(self) -> str:
        return f"{self.fault}-{self.layout}" + (f"-{self.new_tokens}tok" if self.new_tokens else "")

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
                rows.append(Row(f.name, layout, f.what, str(p), new_tokens=f.new_tokens))
    return rows


def with_baselines(rows: list[Row]) -> list[Row]:
    """`rows` and, for each length some row is served at, the healthy export of its layout at that
    length (a fault served longer is judged against the healthy drafter served as long)."""
    healthy = {r.layout: r for r in rows if r.fault == "healthy" and r.new_tokens is None}
    have = {(r.layout, r.new_tokens) for r in rows if r.fault == "healthy"}
    extra = {(r.layout, r.new_tokens) for r in rows if r.new_tokens is not None} - have
    return rows + [replace(healthy[lay], new_tokens=n) for lay, n in sorted(extra) if lay in healthy]


# ---------------------------------------------------------------- the doctor


def doctor_report(ckpt: Path, target: str | None) -> dict:
    """The JSON report of `eyas doctor CKPT --engine vllm [--target T] --json` (run in this process)."""
    from eyas.cli import main

    argv = ["doctor", str(ckpt), "--engine", "vllm", *(["--target", str(target)] if target else []), "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code not in (0, 1):  # 1: error findings, the report is still printed
        raise RuntimeError(f"eyas {' '.join(argv)} exited {code}: {err.getvalue().strip()}")
    return json.loads(out.getvalue())


def verdict(report: dict) -> tuple[str, list[str]]:
    """('error' | 'warning' | 'clean', ids of the worst severity) of a doctor report."""
    for sev in ("error", "warning"):
        ids = sorted({f["id"] for f in report["findings"] if f["severity"] == sev})
        if ids:
            return sev, ids
    return "clean", []


def ask_doctor(rows: list[Row], target: str, without_target: bool = True) -> None:
    """The doctor's verdict on every row with `--target` (and without it, for the table)."""
    for r in rows:
        r.doctor, r.findings = verdict(doctor_report(Path(r.path), target))
        if without_target:
            r.doctor_no_target, _ = verdict(doctor_report(Path(r.path), None))


# ---------------------------------------------------------------- the engine


def prompt_ids(target: Path, prompts_file: Path, limit: int = NUM_PROMPTS) -> list[list[int]]:
    """The prompts as `eyas bench` renders them (first user turn, the target's chat template)."""
    from transformers import AutoTokenizer

    from eyas.stages import bench

    tok = AutoTokenizer.from_pretrained(str(target))
    cfg = bench.BenchConfig(prompts=[str(prompts_file)], limit=limit)
    return [p["ids"].tolist() for p in bench.load_prompts(cfg, tok)]


def serve_rows(rows: list[Row], target: Path, prompts: list[list[int]], workdir: Path,
               new_tokens: int = NEW_TOKENS) -> dict[str, Outcome]:
    """Serve every row's export in real vLLM, all in one child process: {row name: Outcome}."""
    jobs = [ServeJob(target=str(target), prompts=prompts, max_new_tokens=r.new_tokens or new_tokens,
                     concurrency=[len(prompts)],
                     dtype="fp32", speculative_config=speculative_config(r.path, K), enforce_eager=True,
                     max_model_len=MAX_MODEL_LEN, ignore_eos=True, name=r.name) for r in rows]
    return {o.name: o for o in serve_series(jobs, workdir, timeout_s=JOB_TIMEOUT_S)}


def engine_verdict(o: Outcome, healthy_accept: float) -> str:
    """'refuses' | 'fails' | 'collapses' | 'unaffected' (collapse: below 1 + share * (healthy - 1));
    served without a single draft counts as a failure to speculate."""
    if o.outcome != SERVES or o.acceptance_length is None:
        return o.outcome if o.outcome != SERVES else "fails"
    return "collapses" if o.acceptance_length < 1 + COLLAPSE_SHARE * (healthy_accept - 1) else "unaffected"


def ask_engine(rows: list[Row], target: Path, prompts_file: Path, workdir: Path, cache: Path | None = None,
               num_prompts: int = NUM_PROMPTS, new_tokens: int = NEW_TOKENS) -> dict[str, float]:
    """Serve every row (and the healthy baselines `with_baselines` adds); classify each against the
    healthy acceptance of its layout at its length. Returns {layout (or layout@tokens): acceptance}.
    `cache` (a json file) keeps the outcomes: rows already in it are not served again."""
    known: dict[str, Outcome] = {}
    if cache is not None and Path(cache).is_file():
        known = {d["name"]: Outcome(**d) for d in json.loads(Path(cache).read_text())}
    served = with_baselines(rows)
    todo = [r for r in served if r.name not in known]
    if todo:
        known.update(serve_rows(todo, target, prompt_ids(target, prompts_file, num_prompts), workdir, new_tokens))
    if cache is not None:
        Path(cache).write_text(json.dumps([asdict(o) for o in known.values()], indent=1))
    healthy = {(r.layout, r.new_tokens): known[r.name] for r in served if r.fault == "healthy"}
    for r in rows:
        o, ref = known[r.name], healthy[(r.layout, r.new_tokens)]
        if ref.acceptance_length is None:
            raise RuntimeError(f"the healthy {r.layout} export did not serve ({ref.outcome}: {ref.error}); "
                               "nothing to compare with")
        r.engine, r.accept_len, r.error = engine_verdict(o, ref.acceptance_length), o.acceptance_length, o.error
    return {lay + (f"@{n}" if n else ""): o.acceptance_length for (lay, n), o in healthy.items()}


def table(rows: list[Row], healthy: dict[str, float]) -> str:
    """The matrix as markdown."""
    head = ("| fault class | layout | what | vLLM outcome | acceptance / error | doctor (--target) "
            "| doctor (no target) | findings | agree |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ev = f"{r.accept_len:.2f}" if r.accept_len is not None else r.error.replace("|", "/")[:160]
        lines.append(f"| {r.fault} | {r.layout} | {r.what} | {r.engine} | {ev} | {r.doctor} | {r.doctor_no_target} | "
                     f"{', '.join(r.findings)} | {'yes' if r.agree else '**NO**'} |")
    agree = sum(r.agree for r in rows)
    base = ", ".join(f"{k} {v:.2f}" for k, v in healthy.items())
    lines.append(f"\n{agree}/{len(rows)} agree. Healthy acceptance: {base}; collapse = below 1 + 0.5 x (healthy - 1).")
    return "\n".join(lines)
