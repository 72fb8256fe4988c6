"""The doctor against real vLLM on every fault class: build each broken export of a healthy
SmolLM2 drafter, serve it in vLLM (fp32, greedy, k=3, eager), run `eyas doctor --engine vllm`
with and without --target, and write the matrix as a markdown table.

    python bench/doctor_vs_vllm.py --run /tmp/fx/run --prompts /tmp/fx/bench_prompts.jsonl --out /tmp/dvv

Writes OUT/doctor_vs_vllm.md and OUT/doctor_vs_vllm.json (vLLM's logs per export under
OUT/vllm-logs). Takes about 25-60 s per export served (one vLLM start each, all in one child
process: eyas.serve.vllm_serve.serve_series). The fault catalogue is doctor_faults.py and the
comparison doctor_agreement.py, both beside this script; `Fault.vllm` there records what this
bench measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from eyas import targets

import doctor_agreement as agreement  # bench/doctor_agreement.py, beside this script
from doctor_faults import by_name  # bench/doctor_faults.py


def export(run: Path, fmt: str, out: Path, target: str) -> Path:
    dest = out / f"export-{fmt}"
    if not dest.is_dir():
        subprocess.run([sys.executable, "-m", "eyas", "export", str(run), "--to", fmt, "--out", str(dest),
                        "--target", target], check=True)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="training run (or checkpoint) of a healthy drafter")
    ap.add_argument("--prompts", type=Path, required=True, help="prompts it serves well (jsonl)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--faults", nargs="*", default=None,
                    help="FAULT or FAULT-LAYOUT names (default: all; the healthy exports always run)")
    ap.add_argument("--num-prompts", type=int, default=agreement.NUM_PROMPTS)
    ap.add_argument("--new-tokens", type=int, default=agreement.NEW_TOKENS)
    ap.add_argument("--reuse-engine", action="store_true", help="keep vLLM outcomes in OUT/engine.json and "
                    "serve only exports not in it (the exports are rebuilt identically)")
    ap.add_argument("--engine-only", action="store_true", help="serve in vLLM and stop (fills the cache)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    a.out.mkdir(parents=True, exist_ok=True)
    tdir = targets.resolve(a.target)
    healthy = {fmt: export(a.run, fmt, a.out, a.target) for fmt in ("vllm", "speculators")}
    names = ["healthy", *a.faults] if a.faults else None
    rows = agreement.build_all(healthy, a.out / "faults", names)
    t0 = time.time()
    cache = a.out / "engine.json" if a.reuse_engine else None
    base = agreement.ask_engine(rows, tdir, a.prompts, a.out / "vllm-logs", cache, num_prompts=a.num_prompts,
                                new_tokens=a.new_tokens)
    t1 = time.time()
    if a.engine_only:
        return 0
    agreement.ask_doctor(rows, str(tdir))
    t2 = time.time()
    md = agreement.table(rows, base)
    md += (f"\n\nvLLM outcomes for {len(rows)} exports in {t1 - t0:.0f} s (with --reuse-engine, only those not in "
           f"OUT/engine.json were served); doctor (with and without --target) in {t2 - t1:.0f} s.")
    moved = [f"{r.name}: recorded {by_name(r.fault).vllm or 'nothing'}, measured {r.engine}" for r in rows
             if by_name(r.fault).vllm != r.engine]
    if moved:  # Fault.vllm in doctor_faults.py is what the tests check the doctor against
        md += "\n\nMeasured outcomes that differ from Fault.vllm (update the record):\n" + "\n".join(
            f"- {m}" for m in moved)
    (a.out / "doctor_vs_vllm.md").write_text(md + "\n")
    (a.out / "doctor_vs_vllm.json").write_text(json.dumps([asdict(r) | {"agree": r.agree} for r in rows], indent=2))
    print(md)
    return 0 if all(r.agree for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
