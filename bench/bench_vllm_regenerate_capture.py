"""Regeneration and capture tokens/s through vLLM (`--engine vllm`) against eyas's own loops.

Runs the real commands (`eyas data prepare --regenerate`, `eyas capture`) once per engine on the
same prompts and reports, per engine: regeneration tok/s over generation time alone (engine start
and model load left out, as `data prepare --json` reports it) and over the whole command; capture
tok/s over the whole command (model load / engine start included: capture reports no inner time)
and, for vLLM, with its measured start subtracted.

    .venv/bin/python bench/bench_vllm_regenerate_capture.py \
        --prompts ../shared/data/prompts/codealpaca__code_alpaca_2k.json --limit 128 \
        --max-new-tokens 160 --dtype bf16 --out /tmp/bench_vllm

Numbers on a shared CPU are noisy: run it on an idle machine, and more than once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

EYAS = [sys.executable, "-m", "eyas"]


def run(argv: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    p = subprocess.run(EYAS + argv + ["--json"], capture_output=True, text=True,
                       env={**os.environ, "EYAS_NO_PROGRESS": "1"})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--engines", default="eyas,vllm")
    ap.add_argument("--vllm-args", default="{}", help="vllm.LLM keywords as JSON, e.g. '{\"enforce_eager\": true}'")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    report = {}
    for engine in a.engines.split(","):
        data, cap = a.out / f"data-{engine}", a.out / f"capture-{engine}"
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(cap, ignore_errors=True)
        extra = ["--engine", engine] + (["--vllm-args", a.vllm_args] if engine == "vllm" else [])
        prep, prep_wall = run(["data", "prepare", "--target", a.target, "--input", a.prompts, "--limit", str(a.limit),
                               "--regenerate", "--max-new-tokens", str(a.max_new_tokens), "--batch-size",
                               str(a.batch_size), "--dtype", a.dtype, "--out", str(data), *extra])
        g = prep["regeneration"]
        capture, cap_wall = run(["capture", "--target", a.target, "--data", str(data), "--dtype", a.dtype,
                                 "--out", str(cap), *extra])
        report[engine] = {
            "regenerate": {"new_tokens": g["new_tokens"], "generation_s": g["seconds"],
                           "tok_s_generation": g["tokens_per_s"], "wall_s": round(prep_wall, 1),
                           "tok_s_wall": round(g["new_tokens"] / prep_wall, 1)},
            "capture": {"tokens": capture["tokens"], "wall_s": round(cap_wall, 1),
                        "tok_s_wall": round(capture["tokens"] / cap_wall, 1)},
        }
        start = prep_wall - g["seconds"]  # vLLM: child start + engine start (+ tokenizing): what capture pays too
        if engine == "vllm" and cap_wall > start:
            report[engine]["capture"]["tok_s_without_start"] = round(capture["tokens"] / (cap_wall - start), 1)
        print(json.dumps({engine: report[engine]}), flush=True)
    print(json.dumps({"settings": vars(a) | {"out": str(a.out)}, "results": report}, indent=1))


if __name__ == "__main__":
    main()
