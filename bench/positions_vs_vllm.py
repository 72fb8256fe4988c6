"""Does a drafter's config `max_position_embeddings` collapse acceptance in vLLM, or is it the
length the drafter was trained at? Serve exports that differ ONLY in that field, on short and
long contexts, in real vLLM and in eyas's runtime, and write one table.

    python bench/positions_vs_vllm.py --root /tmp/pv/drafter --out /tmp/pv/out

Steps (each skipped when its output exists): train the tests' SmolLM2 drafter
(tests/smollm2_drafter.py; `--train-max-len L --train-context N` trains one on long samples
instead), export it `--to vllm` and `--to speculators`, copy each export once per value of
`--positions` with only that field changed (speculators: transformer_layer_config's), build
short prompts (the drafter's MT-bench questions, and as many it never saw) and long ones (the same questions after about
`--long-tokens` tokens of news articles from EAGLE's summarization set), then:
  vLLM: one engine per variant, greedy, fp32, eager, eagle3 k=3, one request at a time;
        acceptance = 1 + accepted / drafts from vLLM's counters, per context length;
  eyas: `eyas bench --engine vllm --methods chain --k 3` over all variants per length.
Writes OUT/positions_vs_vllm.md and .json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
PROMPTS = REPO.parent / "shared" / "data" / "prompts"
ARTICLES = PROMPTS / "EAGLE__sum__question.jsonl"


def eyas(*argv) -> None:
    subprocess.run([sys.executable, "-m", "eyas", *map(str, argv)], check=True)


def build_drafter(root: Path, target: Path, max_len: int, context: int) -> Path:
    """The tests' drafter (max_len 512, no context), or the same recipe on long samples: every
    training question behind `context` tokens of articles, prepared and trained at `max_len`."""
    import smollm2_drafter as sd

    if (root / "run" / "best").is_dir():
        return root / "run"
    root.mkdir(parents=True, exist_ok=True)
    if max_len == 512 and context == 0:
        from eyas.cli import main
        return sd.build(root, target, PROMPTS, lambda *a: main([str(x) for x in a])).run
    lines = (PROMPTS / sd.PROMPT_FILE).read_text().splitlines()[:sd.N_PROMPTS]
    ctx = contexts(target, context, len(lines))
    train = root / "train_prompts.jsonl"
    train.write_text("".join(json.dumps({"turns": [c + json.loads(x)["turns"][0]]}) + "\n"
                             for c, x in zip(ctx, lines)))
    data, vocab, cap, run = root / "data", root / "vocab.safetensors", root / "capture", root / "run"
    eyas("data", "prepare", "--target", target, "--input", train, "--out", data, "--regenerate", "--max-new-tokens",
         sd.ANSWER_TOKENS, "--eval-fraction", "0.1", "--max-len", max_len, "--dtype", "fp32")
    eyas("vocab", "build", "--data", data, "--size", 2048, "--out", vocab)
    eyas("capture", "--target", target, "--data", data, "--out", cap, "--dtype", "fp32")
    argv = list(sd.train_argv(target, cap, vocab, run))
    argv[argv.index("--max-len") + 1] = max_len
    argv[argv.index("--batch-tokens") + 1] = max(1024, max_len)
    eyas(*argv)
    return run


def contexts(target: Path, n_tokens: int, count: int) -> list[str]:
    """`count` distinct prefixes of about `n_tokens` tokens: news articles (EAGLE sum set) joined
    in turn, cut at a token boundary, followed by a blank line ("" when n_tokens is 0)."""
    if n_tokens <= 0:
        return [""] * count
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    arts = [json.loads(x)["turns"][0].removeprefix("Summarize: ") for x in ARTICLES.read_text().splitlines()]
    out = []
    for i in range(count):
        text, j = "", i
        while len(tok(text)["input_ids"]) < n_tokens:
            text, j = text + arts[j % len(arts)] + "\n\n", j + 1
        out.append("Background reading:\n\n" + tok.decode(tok(text)["input_ids"][:n_tokens]) + "\n\n")
    return out


def variants(run: Path, target: str, positions: list[int], layouts: list[str], root: Path) -> dict[str, Path]:
    """{name: dir}: each layout's export copied once per value, differing only in the field."""
    out = {}
    for fmt in layouts:
        base = root / f"export-{fmt}"
        if not base.is_dir():
            eyas("export", run, "--to", fmt, "--target", target, "--out", base)
        for p in positions:
            dest = root / "variants" / f"{fmt}-p{p}"
            if not dest.is_dir():
                shutil.copytree(base, dest)
                cfg = json.loads((dest / "config.json").read_text())
                (cfg["transformer_layer_config"] if fmt == "speculators" else cfg)["max_position_embeddings"] = p
                (dest / "config.json").write_text(json.dumps(cfg, indent=2))
            out[dest.name] = dest
    return out


def serve_vllm(target: Path, name: str, drafter: Path, groups: dict[str, list], args, work: Path) -> dict:
    """One vLLM engine for `drafter`: acceptance per prompt group, the outputs, the override logs."""
    from eyas.serve.vllm_serve import ServeJob, serve

    prompts = [ids for g in groups.values() for ids in g]
    job = ServeJob(target=str(target), prompts=prompts, max_new_tokens=args.new_tokens, concurrency=[1],
                   speculative_config={"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3},
                   enforce_eager=True, max_model_len=args.max_model_len, name=name)
    level = serve(job, work)["levels"][0]
    reqs, out, i = level["per_request"], {}, 0
    for g, ids in groups.items():
        part = reqs[i:i + len(ids)]
        drafts, acc = sum(r.get("drafts", 0) for r in part), sum(r.get("accepted", 0) for r in part)
        out[g] = {"acceptance": 1 + acc / drafts if drafts else None, "drafts": drafts,
                  "outputs": level["outputs"][i:i + len(ids)]}
        i += len(ids)
    log = (work / f"{name}.log").read_text(errors="replace").splitlines()
    out["log"] = [line.split("] ", 1)[-1] for line in log if "Overriding draft" in line or "max model len" in line]
    return out


def bench_eyas(target: str, dirs: dict[str, Path], prompt_file: Path, args, out: Path) -> dict[str, float]:
    """eyas's runtime, reading each variant as vLLM does: {variant: chain k=3 acceptance}."""
    if not (out / "report.json").is_file():
        eyas("bench", "--target", target, "--drafter", *dirs.values(), "--prompts", prompt_file, "--methods",
             "chain", "--k", 3, "--baselines", "plain", "--engine", "vllm", "--draft-cutoff", 0, "--max-new-tokens",
             args.new_tokens, "--max-prompt-tokens", 1 << 16, "--threads", args.threads, "--out", out, "--force")
    s = json.loads((out / "report.json").read_text())["summary"]
    by_dir = {str(Path(d).resolve()): m for m, d in s.get("drafters", {}).items()}
    return {n: s["methods"][f"chain@{by_dir[str(d.resolve())]}"]["acceptance_length"] for n, d in dirs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="drafter work directory (reused when built)")
    ap.add_argument("--out", type=Path, required=True, help="results directory (vLLM/eyas results reused)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--positions", default="256,1024,8192", help="values of max_position_embeddings to serve")
    ap.add_argument("--layouts", default="vllm,speculators")
    ap.add_argument("--long-tokens", type=int, default=1100, help="tokens of context before each long prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8, help="questions per context length")
    ap.add_argument("--max-model-len", type=int, default=None, help="vLLM max_model_len (default: the target's)")
    ap.add_argument("--train-max-len", type=int, default=512, help="train the drafter at this length")
    ap.add_argument("--train-context", type=int, default=0, help="tokens of context before each training question")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of eyas bench")
    ap.add_argument("--skip", default="", help="comma list of vllm, eyas")
    ap.add_argument("--eyas-variants", default=None, help="comma list of variant names eyas benches (default all; "
                    "eyas reads the field only for scaled RoPE, so two tell as much as six)")
    a = ap.parse_args()
    from eyas import targets
    from eyas.stages.bench import render
    from transformers import AutoTokenizer
    import smollm2_drafter as sd

    tdir = targets.resolve(a.target)
    run = build_drafter(a.root, tdir, a.train_max_len, a.train_context)
    dirs = variants(run, a.target, [int(p) for p in a.positions.split(",")], a.layouts.split(","), a.root)
    a.out.mkdir(parents=True, exist_ok=True)
    mt = [json.loads(x)["turns"][0] for x in (PROMPTS / sd.PROMPT_FILE).read_text().splitlines()]
    qs, unseen = mt[:a.num_prompts], mt[sd.N_PROMPTS:sd.N_PROMPTS + a.num_prompts]  # trained on / not
    tok = AutoTokenizer.from_pretrained(tdir)
    # "unseen": short questions the drafter never trained on, the baseline for answers it did not memorise
    long = [c + q for c, q in zip(contexts(tdir, a.long_tokens, len(qs)), qs)]
    texts = {"short": qs, "unseen": unseen, "long": long}
    groups = {g: [render(tok, t, 1 << 16).tolist() for t in ts] for g, ts in texts.items()}
    res_file = a.out / "positions_vs_vllm.json"
    res = json.loads(res_file.read_text()) if res_file.is_file() else {}
    res["prompt_tokens"] = {g: [len(x) for x in ids] for g, ids in groups.items()}
    for name, d in dirs.items():
        if "vllm" not in a.skip and name not in res.get("vllm", {}):
            res.setdefault("vllm", {})[name] = serve_vllm(tdir, name, d, groups, a, a.out / "vllm")
            res_file.write_text(json.dumps(res))
    for g, ts in texts.items():
        pf = a.out / f"{g}.jsonl"
        pf.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ts))
        if "eyas" not in a.skip:
            pick = {n: d for n, d in dirs.items() if not a.eyas_variants or n in a.eyas_variants.split(",")}
            res.setdefault("eyas", {})[g] = bench_eyas(a.target, pick, pf, a, a.out / f"eyas-{g}")
            res_file.write_text(json.dumps(res))
    (a.out / "positions_vs_vllm.md").write_text(table(res, dirs))
    print(table(res, dirs))
    return 0


def table(res: dict, dirs: dict) -> str:
    t = res["prompt_tokens"]
    span = {g: f"{min(v)}-{max(v)}" for g, v in t.items()}
    rows = ["| variant | " + " | ".join(f"vLLM {g} ({span[g]} prompt tok)" for g in t) + " | "
            + " | ".join(f"eyas {g}" for g in t) + " |", "|---" * (1 + 2 * len(t)) + "|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for n in dirs:
        v = res.get("vllm", {}).get(n, {})
        e = res.get("eyas", {})
        rows.append(f"| {n} | " + " | ".join(fmt(v.get(g, {}).get("acceptance")) for g in t) + " | "
                    + " | ".join(fmt(e.get(g, {}).get(n)) for g in t) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
