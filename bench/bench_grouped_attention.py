"""transformers' sdpa attention vs `cpu.attention.sdpa_grouped` for the target, side by side in one run.

On a CPU, transformers copies every KV head to each of its query heads whenever a mask is
present (every verification forward of more than one token); `sdpa_grouped` lets SDPA group the
heads itself. Forward cost: T tokens appended to a KV cache of --context tokens, the two
attentions alternating forward by forward (median ms, and whether logits and features are bit
for bit the same). Decoding (with --drafter and --prompts): chain and tree greedy decoding of
each prompt with both, interleaved prompt by prompt; tokens/s and whether every output is the
same. Both on prepacked fp32 weights, as `eyas bench` runs them.

    python bench/bench_grouped_attention.py [--sizes 1,2,6,16] [--context 300]
    python bench/bench_grouped_attention.py --sizes '' --drafter RUN/final --prompts mt.jsonl mbpp.jsonl
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from eyas import runtime, targets

import ab_args  # bench/ab_args.py, beside this script


def forwards(tr: runtime.TargetRunner, grouped, context: int, sizes: list[int], repeats: int) -> None:
    prompt = torch.randint(100, 20000, (context,))
    print(f"{'T':>3} {'sdpa ms':>8} {'grouped ms':>11} {'ratio':>6} {'same':>5}")
    for T in sizes:
        ts, same = {None: [], "g": []}, True
        for r in range(repeats):
            outs = []
            for key, cfg in ((None, None), ("g", grouped)):
                tr.grouped = cfg
                tr.reset(context + T)
                tr.forward(prompt, torch.arange(context), features=False)
                toks = torch.randint(100, 20000, (T,), generator=torch.Generator().manual_seed(r))
                t0 = time.perf_counter()
                outs.append(tr.forward(toks, context + torch.arange(T)))
                ts[key].append(time.perf_counter() - t0)
            same &= all(torch.equal(a, b) for a, b in zip(*outs))
        a, b = statistics.median(ts[None]) * 1e3, statistics.median(ts["g"]) * 1e3
        print(f"{T:>3} {a:>8.1f} {b:>11.1f} {b / a:>6.3f} {str(same):>5}", flush=True)
    tr.grouped = grouped


def decoding(model, tok, grouped, drafter: str, prompt_files: list[str], limit: int, new_tokens: int,
             k: int, tree: str) -> None:
    from eyas.formats.prompts import load_prompt_files
    from eyas.stages import bench

    convs = load_prompt_files([Path(p) for p in prompt_files], flag="--prompts", keywords=())
    items = bench.spread([(c.id, c.category, c.user_turns[0]) for c in convs if c.user_turns], limit)
    loaded = runtime.load_drafter(Path(drafter), model, "eyas", torch.float32)
    targets.prepack_for_decoding(loaded.drafter, weights="fp16") or targets.prepack_for_decoding(loaded.drafter)
    tr, dr = runtime.runners(model, loaded, runtime.Timer(torch.device("cpu")))
    s = runtime.DecodeSettings(k=k, tree=bench.parse_tree(tree), max_new_tokens=new_tokens,
                               eos_ids=bench.eos_ids(model, tok), cutoff=0.1)
    tot: dict[tuple[str, str], list[float]] = {}
    same = True
    for _, _, text in items:
        ids = bench.render(tok, text, 1024)
        for method in ("plain", "chain", "tree"):
            ref = None
            for name, cfg in (("sdpa", None), ("grouped", grouped)):
                tr.grouped = cfg
                r = runtime.generate(tr, dr, ids, runtime.DecodeSettings(**{**s.__dict__, "method": method}))
                ref = ref or r.tokens
                same &= r.tokens == ref
                t = tot.setdefault((name, method), [0, 0.0])
                t[0] += len(r.tokens)
                t[1] += r.wall_s
    print(f"{len(items)} prompts, {new_tokens} new tokens, k {k}, tree {tree}, cutoff 0.1; all outputs equal: {same}")
    for method in ("plain", "chain", "tree"):
        a, b = (tot[(n, method)][0] / tot[(n, method)][1] for n in ("sdpa", "grouped"))
        print(f"{method:>6}: sdpa {a:.1f} tok/s, grouped {b:.1f} tok/s ({b / a:.3f}x)")


def main() -> None:
    a = ab_args.parser(__doc__, 11, "1,2,6,16", 48).parse_args()
    torch.set_num_threads(a.threads)
    model, tok = targets.load(targets.resolve(a.target), dtype="fp32", device="cpu")
    targets.prepack_for_decoding(model)
    tr = runtime.TargetRunner(model, targets.default_aux_layers(model.config.num_hidden_layers),
                              runtime.Timer(torch.device("cpu")))
    grouped = tr.grouped
    if grouped is None:
        raise SystemExit("this target does not use sdpa with grouped KV heads on a CPU: nothing to compare")
    with torch.inference_mode():
        sizes = [int(x) for x in a.sizes.split(",") if x]
        if sizes:
            forwards(tr, grouped, a.context, sizes, a.repeats)
        if a.drafter:
            decoding(model, tok, grouped, a.drafter, a.prompts, a.limit, a.max_new_tokens, a.k, a.tree)


if __name__ == "__main__":
    main()
