"""The doctor against real vLLM: for every fault class in the catalogue, `eyas doctor --engine
vllm --target T` must call the export broken exactly when vLLM refuses it, fails on it or
collapses (bench/doctor_agreement.py states the mapping).

Three layers, to keep CI short (each vLLM start costs 25-60 s on the 2-core CI box):
- every fault class: the doctor's verdict against the outcome real vLLM 0.32 gave for it
  (`Fault.vllm`, recorded by bench/doctor_vs_vllm.py); no engine is started.
- a representative subset served in real vLLM, all in one child process one LLM after another
  (eyas.serve.vllm_serve.serve_series): the live outcome must equal the recorded one (so an
  engine upgrade that changes it is seen) and agree with the doctor.
- in the same child, one collapsing export repaired by the command the doctor prints for it:
  served, it must accept what the healthy export accepts.

The fault catalogue and the comparison live in bench/ beside the bench that records them
(doctor_faults.py, doctor_agreement.py): they measure eyas, they are not part of it.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import doctor_agreement as agreement  # noqa: E402  bench/doctor_agreement.py
from doctor_faults import FAULTS, by_name  # noqa: E402  bench/doctor_faults.py

pytestmark = pytest.mark.slow

# Served live in CI (8 vLLM starts): both healthy exports (no false alarm), a refusal at load, a
# failure while serving, a collapse through the embedding, two faults vLLM serves unaffected that
# the doctor must not call errors (a stale t2d; a speculators config whose missing
# norm_before_residual vLLM reads as true), and REPAIR after the doctor's own repair command.
LIVE = ["healthy", "keys-unknown-vllm", "d2t-absolute-vllm", "embed-random-speculators",
        "t2d-inconsistent-vllm", "nbr-absent-speculators"]
# A class the doctor must call an error and vLLM serves collapsed (recorded, not served here): an
# exporter that never filled d2t. Its repair is served instead, against the healthy export.
REPAIR = ("d2t-zeros", "vllm")
REPAIR_TOL = 0.05  # acceptance length of the repaired export vs the healthy one


@pytest.fixture(scope="module")
def exports(smollm2_drafter, tmp_path_factory):
    from eyas.formats.engines import export_checkpoint

    root = tmp_path_factory.mktemp("doctor_vllm")
    healthy = {}
    for fmt in ("vllm", "speculators"):
        healthy[fmt] = root / f"export-{fmt}"
        healthy[fmt].mkdir()
        export_checkpoint(smollm2_drafter.ckpt, fmt, healthy[fmt], smollm2_drafter.target)
    return healthy, root


@pytest.fixture(scope="module")
def all_rows(exports, smollm2_drafter):
    healthy, root = exports
    rows = agreement.build_all(healthy, root / "faults")
    agreement.ask_doctor(rows, str(smollm2_drafter.target), without_target=False)  # the verdict judged
    return {(r.fault, r.layout): r for r in rows}


def repair(broken: Path, target: Path, out: Path) -> tuple[Path | None, str, str]:
    """(repaired export, why the check cannot run, what is wrong) after running the command of the
    doctor's first error finding that has one, with its "OUT" placeholder replaced by `out`.
    Only a doctor whose findings carry no `command` field at all makes the check skip."""
    from eyas.cli import main

    report = agreement.doctor_report(broken, str(target))
    if not any("command" in f for f in report["findings"]):
        return None, ("the doctor's findings have no `command` field yet (argv of an eyas command writing a "
                      "repaired checkpoint to OUT): the repair check is ready and runs once they do"), ""
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    with_command = [f for f in errors if f.get("command")]
    if not with_command:
        return None, "", (f"the doctor offers no repair command for {broken.name}: errors "
                          f"{[f['id'] for f in errors] or 'none'}")
    argv = [str(out) if a == "OUT" else str(a) for a in with_command[0]["command"]]
    argv = argv[1:] if argv and argv[0] == "eyas" else argv
    try:
        code = main(argv)
    except SystemExit as e:  # argparse refused the command line
        code = e.code
    if code != 0:
        return None, "", f"{with_command[0]['id']}: `eyas {' '.join(argv)}` exited {code}"
    return out, "", ""


@pytest.fixture(scope="module")
def live(all_rows, exports, smollm2_drafter, vllm_ready):
    """The LIVE rows (their doctor verdicts from all_rows) and the repaired REPAIR export, all
    served in one vLLM child: (rows, {layout: healthy acceptance}, repair status)."""
    healthy, root = exports
    picked = [replace(r) for (f, lay), r in all_rows.items() if f in LIVE or f"{f}-{lay}" in LIVE]
    fixed, skip, problem = repair(Path(all_rows[REPAIR].path), smollm2_drafter.target, root / "repaired")
    served = picked + ([agreement.Row("repaired", REPAIR[1], f"{'-'.join(REPAIR)} repaired", str(fixed))]
                       if fixed else [])
    base = agreement.ask_engine(served, smollm2_drafter.target, smollm2_drafter.prompts, root / "vllm-logs")
    status = {"skip": skip, "problem": problem, "row": served[-1] if fixed else None}
    if fixed:
        status["doctor_after"] = agreement.verdict(agreement.doctor_report(fixed, str(smollm2_drafter.target)))
    return picked, base, status


CASES = [(f.name, layout) for f in FAULTS for layout in f.layouts]


@pytest.mark.parametrize("fault,layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_doctor_agrees_with_recorded_vllm(all_rows, fault, layout):
    r = replace(all_rows[(fault, layout)], engine=by_name(fault).vllm)
    assert r.engine, f"{fault}: no vLLM outcome recorded; run bench/doctor_vs_vllm.py --faults {fault}"
    assert r.agree, (f"{fault} ({layout}): vLLM 0.32 {r.engine}, doctor --engine vllm --target says {r.doctor} "
                     f"{r.findings}")


def test_healthy_exports_no_false_alarm(all_rows):
    for layout in ("vllm", "speculators"):
        r = all_rows[("healthy", layout)]
        without, ids = agreement.verdict(agreement.doctor_report(Path(r.path), None))
        assert r.doctor != "error" and without != "error", (layout, r.findings, ids)


def test_live_vllm_matches_record_and_doctor(live):
    rows, base, _ = live
    assert all(v > 2.0 for v in base.values()), f"the healthy exports accept {base}: the drafter fixture is broken"
    moved = [(r.fault, r.layout, by_name(r.fault).vllm, r.engine, r.accept_len, r.error) for r in rows
             if r.engine != by_name(r.fault).vllm]
    assert not moved, f"vLLM's behaviour changed (fault, layout, recorded, now, acceptance, error): {moved}"
    disagree = [(r.fault, r.layout, r.engine, r.doctor, r.findings) for r in rows if not r.agree]
    assert not disagree, f"doctor disagrees with vLLM: {disagree}\n{agreement.table(rows, base)}"


def test_doctor_repair_command_restores_served_acceptance(live, all_rows):
    _, base, status = live
    if status["skip"]:
        pytest.skip(status["skip"])
    broken = all_rows[REPAIR]
    assert by_name(REPAIR[0]).vllm == "collapses" and broken.doctor == "error", (
        f"{'-'.join(REPAIR)} must be a fault vLLM serves collapsed and the doctor calls an error: recorded "
        f"{by_name(REPAIR[0]).vllm}, doctor {broken.doctor} {broken.findings}")
    assert not status["problem"], status["problem"]
    r = status["row"]
    assert r.accept_len is not None and abs(r.accept_len - base[REPAIR[1]]) <= REPAIR_TOL, (
        f"{'-'.join(REPAIR)} repaired by the doctor's command serves at acceptance {r.accept_len} "
        f"({r.engine}{': ' + r.error if r.error else ''}); the healthy export at {base[REPAIR[1]]:.3f}")
    assert status["doctor_after"][0] != "error", f"the doctor still finds errors after its repair: {status}"
