"""Plain vs oneDNN-prepacked weights (`eyas.cpu.prepack`), side by side in one run.

Forward cost: each forward appends T tokens to a KV cache of --context tokens (a
verification step); the two builds alternate forward by forward; median of --repeats in ms,
and as a ratio to the unpacked 1-token forward.
Decoding (with --drafter and --prompts): plain, chain and tree greedy decoding of each prompt
with unpacked and packed models, interleaved prompt by prompt; tokens/s, speedup over the
same build's plain decoding, and whether every output is the unpacked plain output.

    python bench/bench_prepack.py [--target smollm2-135m] [--threads 2] [--context 300]
    python bench/bench_prepack.py --sizes '' --drafter RUN/final --prompts mt.jsonl mbpp.jsonl --limit 10
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from eyas import runtime, targets
from eyas.cpu import prepack

import ab_args  # bench/ab_args.py, beside this script


def forward_ms(runners: dict, prompt: torch.Tensor, T: int, repeats: int) -> dict[str, float]:
    """Median ms of a T-token forward after `prompt`, per runner, the runners alternating
    forward by forward so that machine drift hits them alike."""
    n, ts = prompt.numel(), {name: [] for name in runners}
    for _ in range(repeats):
        for name, tr in runners.items():
            tr.reset(n + 64)
            tr.forward(prompt, torch.arange(n), features=False)
            toks = torch.randint(100, 20000, (T,))
            t0 = time.perf_counter()
            tr.forward(toks, n + torch.arange(T))
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1000 for name, v in ts.items()}


def decoding(models: dict, tok, drafter: str, prompt_files: list[str], limit: int, new_tokens: int,
             k: int, tree: str) -> None:
    from pathlib import Path

    from eyas.formats.prompts import load_prompt_files
    from eyas.stages import bench

    convs = load_prompt_files([Path(p) for p in prompt_files], flag="--prompts", keywords=())
    items = bench.spread([(c.id, c.category, c.user_turns[0]) for c in convs if c.user_turns], limit)
    runs = {}
    for name, m in models.items():
        loaded = runtime.load_drafter(Path(drafter), m, "eyas", torch.float32)
        if name == "packed":
            prepack.prepack(loaded.drafter)
        runs[name] = runtime.runners(m, loaded, runtime.Timer(torch.device("cpu")))
    s = runtime.DecodeSettings(k=k, tree=bench.parse_tree(tree), max_new_tokens=new_tokens,
                               eos_ids=bench.eos_ids(models["plain"], tok))
    tot: dict[tuple[str, str], list[float]] = {}
    same = True
    for _, _, text in items:
        ids = bench.render(tok, text, 1024)
        ref = None
        for method in ("plain", "chain", "tree"):
            for name, (tr, dr) in runs.items():
                r = runtime.generate(tr, dr, ids, runtime.DecodeSettings(**{**s.__dict__, "method": method}))
                ref = ref or r.tokens
                same &= r.tokens == ref
                t = tot.setdefault((name, method), [0, 0.0, 0, 0])
                t[0] += len(r.tokens); t[1] += r.wall_s; t[2] += sum(r.accepted) + r.steps; t[3] += r.steps
    print(f"{len(items)} prompts, {new_tokens} new tokens, k {k}, tree {tree}; all outputs equal: {same}")
    print(f"{'build':>9} {'method':>6} {'tok/s':>6} {'vs plain':>9} {'accept':>7}")
    for (name, method), (n, sec, acc, steps) in tot.items():
        base = tot[(name, "plain")][0] / tot[(name, "plain")][1]
        al = f"{acc / steps:.2f}" if method != "plain" else "-"
        print(f"{name:>9} {method:>6} {n / sec:>6.1f} {n / sec / base:>8.2f}x {al:>7}")


def main() -> None:
    a = ab_args.parser(__doc__, 7, "1,2,4,6,8,12,16,24,32", 64).parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model, tok = targets.load(targets.resolve(a.target), dtype="fp32", device="cpu")
    packed = copy.deepcopy(model)
    print(f"packed {prepack.prepack(packed)} linear layers")
    aux = targets.default_aux_layers(model.config.num_hidden_layers)
    runners = {name: runtime.TargetRunner(m, aux, runtime.Timer(torch.device("cpu")))
               for name, m in (("plain", model), ("packed", packed))}
    prompt = torch.randint(100, 20000, (a.context,))
    with torch.inference_mode():
        ids = torch.randint(100, 20000, (1, 64))
        top = [m(ids).logits[0].argmax(-1) for m in (model, packed)]
        print(f"greedy agreement over 64 positions: {(top[0] == top[1]).float().mean().item():.3f}")
        base = None
        print(f"{'T':>3} {'unpacked ms':>12} {'packed ms':>10} {'unpacked x':>11} {'packed x':>9}")
        for T in (int(s) for s in a.sizes.split(",") if s):
            ms = forward_ms(runners, prompt, T, a.repeats)
            u, p = ms["plain"], ms["packed"]
            base = base or u
            print(f"{T:>3} {u:>12.1f} {p:>10.1f} {u / base:>11.2f} {p / base:>9.2f}", flush=True)
        if a.drafter:
            decoding({"plain": model, "packed": packed}, tok, a.drafter, a.prompts, a.limit, a.max_new_tokens, a.k,
                     a.tree)


if __name__ == "__main__":
    main()
