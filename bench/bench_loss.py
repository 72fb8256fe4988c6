"""The training loss at one TTT step: eyas's chunked head + soft cross-entropy vs the plain
log_softmax form, forward + backward through the draft head, interleaved in one process.

    python bench/bench_loss.py [--rows 1200] [--vocab 8192] [--hidden 576] [--dtype bf16|fp32]
                               [--rounds 15] [--threads 2]

`rows` is the supervised positions of one step (a 2048-token batch of the quickstart has
about 1,200); the head is `vocab x hidden` (SmolLM2 with an 8k draft vocabulary). Both arms
compute the same function (tests/core/test_ttt.py checks values and gradients); the plain arm is
`-(probs[rows] * log_softmax(logits.float())).sum(-1)` plus the argmax, as `ttt_forward` did
before the chunked form. Also times the head's matrix products alone (`F.linear`, forward and
backward), so the loss's own share is the difference (negative when the chunked form's products
run faster than the plain ones).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from eyas.core import ttt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1200)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    head = (torch.randn(a.vocab, a.hidden) * 0.05).requires_grad_()
    x = torch.randn(a.rows, a.hidden).requires_grad_()  # the drafter states: their gradient is part of the cost
    probs = torch.softmax(torch.randn(a.rows + 100, a.vocab) * 3, -1)
    rows = torch.randperm(a.rows + 100)[: a.rows]
    bf16 = a.dtype == "bf16"

    def logits():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return F.linear(x, head)

    def plain():
        z = logits().float()
        ce = -(probs[rows] * torch.log_softmax(z, -1)).sum(-1)
        z.argmax(-1)
        ce.sum().backward()

    def chunked():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            ce, _, _ = ttt.head_soft_cross_entropy(x, head, probs, rows)
        ce.sum().backward()

    def head_only():
        z = logits()
        z.backward(torch.ones_like(z))

    arms = {"log_softmax form": plain, "eyas chunked": chunked, "head matmuls only": head_only}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.rounds + 1):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            head.grad = None
            t0 = time.perf_counter()
            arms[name]()
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mm = med["head matmuls only"]
    print(json.dumps({"settings": vars(a), "median_ms": {k: round(v, 1) for k, v in med.items()},
                      "loss_share_ms": {k: round(med[k] - mm, 1) for k in ("log_softmax form", "eyas chunked")},
                      "speedup_with_head": round(med["log_softmax form"] / med["eyas chunked"], 3)}, indent=1))


if __name__ == "__main__":
    main()
