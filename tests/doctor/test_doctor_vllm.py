"""The doctor against real vLLM: for every fault class the doctor knows, `eyas doctor --engine
vllm --target T` must call the export broken exactly when vLLM refuses it, fails on it or
collapses (eyas.doctor.agreement states the mapping).

Two layers, to keep CI short (each vLLM start costs 25-60 s on the 2-core CI box):
- every fault class: the doctor's verdict against the outcome real vLLM 0.32 gave for it
  (`Fault.vllm`, recorded by bench/doctor_vs_vllm.py); no engine is started.
- a representative subset served in real vLLM, all in one child process one LLM after another:
  the live outcome must equal the recorded one (so an engine upgrade that changes it is seen)
  and agree with the doctor. About 5 minutes here.
"""

from __future__ import annotations

import pytest

from eyas.doctor import agreement
from eyas.doctor.faults import FAULTS

pytestmark = pytest.mark.slow

# Served live in CI (8 vLLM starts): both healthy exports (no false alarm), a refusal at load, a
# failure while serving, collapses through the aux path and the embedding, and two faults vLLM
# serves unaffected that the doctor must not call errors (a stale t2d; a speculators config whose
# missing norm_before_residual vLLM reads as true).
LIVE = ["healthy", "keys-unknown-vllm", "d2t-absolute-vllm", "aux-disabled-vllm", "embed-random-speculators",
        "t2d-inconsistent-vllm", "nbr-absent-speculators"]


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
    agreement.ask_doctor(rows, str(smollm2_drafter.target))
    return {(r.fault, r.layout): r for r in rows}


@pytest.fixture(scope="module")
def live(exports, smollm2_drafter, vllm_ready):
    healthy, root = exports
    rows = agreement.build_all(healthy, root / "live", LIVE)
    base = agreement.ask_engine(rows, smollm2_drafter.target, smollm2_drafter.prompts)
    agreement.ask_doctor(rows, str(smollm2_drafter.target))
    return rows, base


CASES = [(f.name, layout) for f in FAULTS for layout in f.layouts]


@pytest.mark.parametrize("fault,layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_doctor_agrees_with_recorded_vllm(all_rows, fault, layout):
    r = all_rows[(fault, layout)]
    r.engine = next(f for f in FAULTS if f.name == fault).vllm
    assert r.agree, (f"{fault} ({layout}): vLLM 0.32 {r.engine}, doctor --engine vllm --target says {r.doctor} "
                     f"{r.findings}")


def test_healthy_exports_no_false_alarm(all_rows):
    for layout in ("vllm", "speculators"):
        r = all_rows[("healthy", layout)]
        assert r.doctor != "error" and r.doctor_no_target != "error", (layout, r.findings)


def test_live_vllm_matches_record_and_doctor(live):
    rows, base = live
    assert all(v > 2.0 for v in base.values()), f"the healthy exports accept {base}: the drafter fixture is broken"
    recorded = {f.name: f.vllm for f in FAULTS}
    moved = [(r.fault, r.layout, recorded[r.fault], r.engine, r.accept_len, r.error) for r in rows
             if r.engine != recorded[r.fault]]
    assert not moved, f"vLLM's behaviour changed (fault, layout, recorded, now, acceptance, error): {moved}"
    disagree = [(r.fault, r.layout, r.engine, r.doctor, r.findings) for r in rows if not r.agree]
    assert not disagree, f"doctor disagrees with vLLM: {disagree}\n{agreement.table(rows, base)}"
