"""False alarms of `eyas doctor` on healthy exports: drafters trained for a few to many steps, over
several seeds, each exported to the vllm and speculators layouts and checked with and without
--prompts. A healthy export must never get an error (exit 0); warnings (undertrained, say) are fine.

    python bench/doctor_false_alarms.py --out /tmp/dfa [--seeds 0,1,2,3,4] [--steps 1,10,60,300]
    python bench/doctor_false_alarms.py --out /tmp/dfa --drafter RUN_OR_CKPT --target smollm2-135m \\
        --prompts PROMPTS.jsonl   # a real drafter instead of the tiny ones

Tiny drafters are trained on a tiny random Llama target (tests/tiny.py) with their lm_head started
from the target's rows, as `eyas train` does. Writes OUT/doctor_false_alarms.md and .json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
PROMPTS = ["the model token draft", "python code function return", "math two plus three equals",
           "the cat and the dog", "explain the speculative decoding", "write a story about a river"]


def doctor(ckpt: Path, target: str, prompts: Path | None, engine: str) -> dict:
    argv = [sys.executable, "-m", "eyas", "doctor", str(ckpt), "--engine", engine, "--target", target, "--json"]
    if prompts:
        argv += ["--prompts", str(prompts), "--num-prompts", "4", "--new-tokens", "16", "--steps", "3"]
    p = subprocess.run(argv, capture_output=True, text=True)
    rep = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {"findings": [], "error": p.stderr[-300:]}
    return {"exit": p.returncode, "errors": [f["id"] for f in rep["findings"] if f["severity"] == "error"],
            "warnings": [f["id"] for f in rep["findings"] if f["severity"] == "warning"]}


def tiny_exports(out: Path, seeds: list[int], steps: list[int]) -> tuple[str, list[tuple[str, Path]]]:
    import tiny

    from eyas.formats import engines

    target = out / "target"
    if not target.is_dir():
        tiny.build_target(target, kind="llama")
    made = []
    for seed in seeds:
        for n in steps:
            d, _ = tiny.train_tiny_drafter(target, steps=n, seed=seed, head_from_target=True)
            for fmt in ("vllm", "speculators"):
                dst = out / f"seed{seed}-steps{n}-{fmt}"
                if not dst.is_dir():
                    dst.mkdir(parents=True)
                    engines.write_layout(d.cfg, d.trainable_state_dict(), fmt, dst, target=target)
                made.append((f"seed {seed}, {n} steps, {fmt}", dst))
    return str(target), made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--steps", default="1,10,60,300")
    ap.add_argument("--drafter", type=Path, nargs="*", help="real drafter exports (vllm or speculators layout)")
    ap.add_argument("--target", default=None, help="with --drafter: their target")
    ap.add_argument("--prompts", type=Path, default=None, help="with --drafter: prompts for the dynamic checks")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.drafter:
        target, made, prompts = a.target, [(str(p), p) for p in a.drafter], a.prompts
    else:
        target, made = tiny_exports(a.out, [int(s) for s in a.seeds.split(",")], [int(s) for s in a.steps.split(",")])
        prompts = a.out / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rows = []
    for name, ckpt in made:
        for with_prompts in (False, True):
            r = doctor(ckpt, target, prompts if with_prompts else None, "vllm")
            rows.append({"export": name, "prompts": with_prompts, **r})
            print(f"{name:40s} prompts={with_prompts!s:5s} exit={r['exit']} errors={r['errors']} "
                  f"warnings={r['warnings']}", flush=True)
    alarms = [r for r in rows if r["exit"] != 0 or r["errors"]]
    (a.out / "doctor_false_alarms.json").write_text(json.dumps(rows, indent=2))
    lines = ["| export | --prompts | exit | errors | warnings |", "|---|---|---|---|---|"]
    lines += [f"| {r['export']} | {r['prompts']} | {r['exit']} | {', '.join(r['errors']) or '-'} | "
              f"{', '.join(sorted(set(r['warnings']))) or '-'} |" for r in rows]
    lines.append(f"\n{len(alarms)} false alarm(s) in {len(rows)} doctor runs.")
    (a.out / "doctor_false_alarms.md").write_text("\n".join(lines) + "\n")
    print(lines[-1])
    return 0 if not alarms else 1


if __name__ == "__main__":
    raise SystemExit(main())
