"""Regeneration throughput: eyas's batched decoder (`eyas.runtime.batched.decode_batch`) vs
transformers' `generate()` on the same prompts, side by side in one run.

Usage: EYAS_HOME=... python bench/bench_regenerate.py [--prompts 64] [--max-new-tokens 192]
       [--dtype bf16] [--hf-batch 8] [--eyas-batch 128[,64,...]] [--attention auto[,sdpa,matmul]]
       [--rounds 2] [--threads 2]
The prompts are the first N built-in prompts (first user turn, chat template applied), sorted
by length as `eyas data prepare` batches them; each round runs every arm once (eyas at each
`--eyas-batch` and `--attention` kernel of bf16 decoding, `attention.LOW_PRECISION_SDPA`; HF
unless `--hf-batch 0`), in reversed order every other round. Counted tokens
stop at the first end-of-turn token, as `eyas data prepare --regenerate` counts them. Also
reports how many answers each arm writes identically to the reference arm (HF, else the first
eyas batch size): bf16 batching changes rounding, so some differ; fp32 should not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eyas import targets
from eyas.cpu import attention
from eyas.formats.builtin_prompts import builtin_prompts
from eyas.formats.data import end_of_turn_ids
from eyas.runtime.batched import decode_batch
from eyas.stages.data import REGEN_BATCH


DEFAULT_SDPA = attention.LOW_PRECISION_SDPA


def hf_generate(model, prompts: list[list[int]], max_new: int, stops: list[int], pad: int, batch: int):
    out = []
    for b in range(0, len(prompts), batch):
        chunk = prompts[b:b + batch]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=stops, pad_token_id=pad)
        for row in gen[:, L:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), None)
            out.append(row if cut is None else row[: cut + 1])
    return out


def eyas_generate(model, prompts, max_new, stops, batch, sdpa=None):
    """`sdpa`: None = this CPU's default kernel for bf16 decoding attention, else forced."""
    attention.LOW_PRECISION_SDPA = DEFAULT_SDPA if sdpa is None else sdpa
    out = []
    for b in range(0, len(prompts), batch):
        out += decode_batch(model, prompts[b:b + batch], max_new, stops, 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=targets.DEFAULT_TARGET)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--hf-batch", type=int, default=8, help="0 = no transformers arm")
    ap.add_argument("--eyas-batch", default=str(REGEN_BATCH), help="comma list: one eyas arm per batch size")
    ap.add_argument("--attention", default="auto",
                    help="comma list of auto, sdpa, matmul: one eyas arm per kernel of bf16 decoding attention")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    kernels = {"auto": None, "sdpa": True, "matmul": False}
    if bad := set(args.attention.split(",")) - set(kernels):
        ap.error(f"--attention {args.attention}: unknown {', '.join(sorted(bad))}; use auto, sdpa or matmul")
    torch.set_num_threads(args.threads)
    model, tok = targets.load(targets.resolve(args.target), dtype=args.dtype)
    stops = end_of_turn_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    convs = builtin_prompts()[: args.prompts]
    prompts = [tok(tok.apply_chat_template([c.turns[0]], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for c in convs]
    prompts.sort(key=len)
    arms = {f"eyas@{b}" + ("" if a == "auto" else f"/{a}"):
            (lambda b=b, a=a: eyas_generate(model, prompts, args.max_new_tokens, stops, b, kernels[a]))
            for b in map(int, args.eyas_batch.split(",")) for a in args.attention.split(",")}
    if args.hf_batch > 0:
        arms["hf"] = lambda: hf_generate(model, prompts, args.max_new_tokens, stops, pad, args.hf_batch)
    rates: dict[str, list[float]] = {k: [] for k in arms}
    answers = {}
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            t0 = time.perf_counter()
            answers[name] = arms[name]()
            secs = time.perf_counter() - t0
            rates[name].append(sum(len(a) for a in answers[name]) / secs)
            print(f"round {r} {name}: {rates[name][-1]:.1f} tok/s ({secs:.1f} s)", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ref = "hf" if "hf" in arms else next(iter(arms))
    print(json.dumps({"prompts": len(prompts), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                      "tokens_per_s_median": med, f"ratio_over_{ref}": {k: round(v / med[ref], 3) for k, v in med.items()},
                      f"answers_identical_to_{ref}": {k: f"{sum(a == b for a, b in zip(answers[ref], v))}/{len(prompts)}"
                                                      for k, v in answers.items()}}, indent=1))


if __name__ == "__main__":
    main()
