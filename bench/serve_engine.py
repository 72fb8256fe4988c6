"""Serve a target with an eyas-exported drafter in SGLang or vLLM and print the engine's own
acceptance length next to `eyas bench`'s. For a CUDA machine where the engine is installed;
not run in CI (neither engine installs beside the CPU torch).

    eyas export runs/smol --to vllm --out exports/smol-vllm --target smollm2-135m
    eyas bench ... --json > bench.json          # optional: eyas's own measurement
    python bench/serve_engine.py --engine vllm --target ~/.cache/eyas/targets/smollm2-135m \\
        --drafter exports/smol-vllm --prompts ../shared/data/prompts/mtbench.jsonl --eyas-bench bench.json

Acceptance length = generated tokens per target verification step (1 + accepted draft
tokens per step), greedy, chain of --num-spec-tokens drafts:
- SGLang: sum(meta_info.completion_tokens) / sum(meta_info.spec_verify_ct) over the outputs.
- vLLM: 1 + spec_decode_num_accepted_tokens / spec_decode_num_drafts from LLM.get_metrics().
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, choices=("sglang", "vllm"))
    p.add_argument("--target", required=True, help="target HF directory (or an eyas built-in name)")
    p.add_argument("--drafter", required=True, type=Path, help="directory written by `eyas export --to ENGINE`")
    p.add_argument("--prompts", type=Path, nargs="+", required=True, help="prompt files (any format eyas reads)")
    p.add_argument("--limit", type=int, default=80, help="number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-spec-tokens", type=int, default=5, help="draft chain length")
    p.add_argument("--eyas-bench", type=Path, help="`eyas bench --json` output to print beside the engine's")
    p.add_argument("--skip-check", action="store_true", help="serve even if eyas's static check finds problems")
    return p.parse_args(argv)


def check_drafter(engine: str, drafter: Path, target: str) -> None:
    """Refuse a drafter that the engine would load broken (the same check `eyas export` runs)."""
    from eyas import targets
    from eyas.formats import engines

    tdir = targets.resolve(target)
    problems = engines.static_check(drafter, engine, target=tdir)
    for line in problems:
        print(f"static check: {line}", file=sys.stderr)
    for note in engines.engine_reading(drafter, engine, tdir).notes:
        print(f"note: {note}", file=sys.stderr)
    if problems:
        raise SystemExit(f"{drafter} would load broken in {engine}; re-export it (or pass --skip-check)")


def load_prompts(paths: list[Path], target: Path, limit: int) -> list[str]:
    """First user turn of each conversation, rendered with the target's chat template."""
    from transformers import AutoTokenizer

    from eyas.formats.prompts import load_prompt_files

    tok = AutoTokenizer.from_pretrained(target)
    convs = load_prompt_files(paths)[:limit]
    first = [[t for t in c.turns if t["role"] == "user"][:1] for c in convs]
    return [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in first if m]


def run_sglang(target: Path, drafter: Path, prompts: list[str], args) -> dict:
    import sglang as sgl

    llm = sgl.Engine(model_path=str(target), speculative_algorithm="EAGLE3",
                     speculative_draft_model_path=str(drafter), speculative_num_steps=args.num_spec_tokens,
                     speculative_eagle_topk=1, speculative_num_draft_tokens=args.num_spec_tokens + 1)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, {"temperature": 0.0, "max_new_tokens": args.max_new_tokens})
        dt = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return {"acceptance_length": tokens / steps if steps else None, "tokens": tokens, "seconds": dt}


def run_vllm(target: Path, drafter: Path, prompts: list[str], args) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": str(drafter),
                                  "num_speculative_tokens": args.num_spec_tokens})
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens))
    dt = time.perf_counter() - t0
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"acceptance_length": 1 + accepted / drafts if drafts else None, "tokens": tokens, "seconds": dt}


def eyas_acceptance(path: Path | None) -> float | None:
    """The acceptance length in an `eyas bench --json` summary (first key naming it)."""
    if path is None:
        return None

    def find(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                if "accept" in k and "len" in k and isinstance(v, (int, float)):
                    return float(v)
            for v in obj.values():
                if (got := find(v)) is not None:
                    return got
        return None

    return find(json.loads(path.read_text()))


def main(argv=None) -> int:
    args = parse_args(argv)
    from eyas import targets

    target = targets.resolve(args.target)
    if not args.skip_check:
        check_drafter(args.engine, args.drafter, str(target))
    prompts = load_prompts(args.prompts, target, args.limit)
    run = run_sglang if args.engine == "sglang" else run_vllm
    res = run(target, args.drafter, prompts, args)
    ours = eyas_acceptance(args.eyas_bench)
    print(json.dumps({"engine": args.engine, "prompts": len(prompts), "num_spec_tokens": args.num_spec_tokens,
                      **res, "eyas_bench_acceptance_length": ours}, indent=2))
    al = res["acceptance_length"]
    print(f"{args.engine} acceptance length {al if al is None else round(al, 3)}   "
          f"eyas bench {ours if ours is None else round(ours, 3)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
