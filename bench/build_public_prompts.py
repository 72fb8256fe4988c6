"""Build `src/eyas/data/public_prompts.jsonl.gz`, the public prompt pool behind
`eyas data prepare --input builtin-public` (and `eyas quickstart --budget medium|large`).

Reads the byte-exact copies in ../shared/data/prompts (provenance in that folder's
SOURCES.md), keeps only sources whose licence allows redistribution (MIT, Apache-2.0),
parses each with eyas's own loader, drops prompts over MAX_CHARS, samples a fixed number per
source with a fixed seed, and writes first user turns only, as `{"turns", "category",
"source"}` records, gzip with mtime 0 (the same inputs give the same bytes). MT-bench and
MBPP are left out on purpose: they are the bench prompts.

    python bench/build_public_prompts.py [--src ../shared/data/prompts]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
from pathlib import Path

from eyas.formats.prompts import load_prompt_files

# file -> (prompts to keep, category, licence). Counts balance code, math and chat the way
# the bench mixes them (MT-bench: eight chat categories; MBPP: code).
SOURCES = {
    "GPTeacher__codegen-instruct.json": (800, "code", "MIT (teknium1/GPTeacher)"),
    "grade-school-math__train.jsonl": (300, "math", "MIT (openai/grade-school-math)"),
    "SVAMP__SVAMP.json": (100, "math", "MIT (arkilpatel/SVAMP)"),
    "GPTeacher__roleplay-simple-deduped-roleplay-instruct.json": (250, "roleplay", "MIT (teknium1/GPTeacher)"),
    "arena-hard-auto__arena-hard-v0.1__question.jsonl": (250, None, "Apache-2.0 (lmarena/arena-hard-auto)"),
    "arena-hard-auto__arena-hard-v2.0__question.jsonl": (250, None, "Apache-2.0 (lmarena/arena-hard-auto)"),
    "Open-Assistant__prompt_lottery_en_250_text.jsonl": (250, "chat", "Apache-2.0 (LAION-AI/Open-Assistant)"),
    "Open-Assistant__en_100_text.jsonl": (100, "chat", "Apache-2.0 (LAION-AI/Open-Assistant)"),
    "self-instruct__seed_tasks.jsonl": (175, "chat", "Apache-2.0 (yizhongw/self-instruct)"),
}
MAX_CHARS = 2000
SEED = 0
OUT = Path(__file__).resolve().parents[1] / "src/eyas/data/public_prompts.jsonl.gz"


def build(src: Path) -> list[dict]:
    rng = random.Random(SEED)
    records = []
    for name, (count, category, _) in SOURCES.items():
        convs = [c for c in load_prompt_files([src / name]) if c.user_turns and len(c.user_turns[0]) <= MAX_CHARS]
        picked = rng.sample(convs, min(count, len(convs)))
        for c in picked:
            records.append({"turns": [c.user_turns[0]], "category": category or c.category,
                            "source": name.rsplit(".", 1)[0]})
    return records


def write(records: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz:
        for r in records:
            gz.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    out.write_bytes(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/prompts")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    records = build(args.src)
    write(records, args.out)
    print(f"{len(records)} prompts -> {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
