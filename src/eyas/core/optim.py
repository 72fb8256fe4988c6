"""The optimizers and the learning-rate schedule of drafter training (DESIGN 6)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from eyas.core.drafter import Eagle3Drafter
from eyas.core.muon import MuonAdamW


def lr_lambda(total: int, warmup: int, time_progress: Callable[[], float] | None = None) -> Callable[[int], float]:
    """Linear warmup to 1 over `warmup` steps, then cosine to 0 at `total`. With `time_progress`
    (share of a time budget spent, 0..1) the run is as far along as the further of steps and time:
    warmup ends at `warmup` steps or the same share of the time, and the cosine follows the same."""
    def f(step: int) -> float:
        prog = (step - warmup) / max(1, total - warmup)
        if time_progress is not None:
            share = warmup / max(1, total)  # of the steps, hence of the time
            t = time_progress()
            if step < warmup and t < share:
                return max((step + 1) / warmup, t / share) if share > 0 else 1.0
            prog = max(prog, (t - share) / max(1e-9, 1 - share))
        elif step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))
    return f


def make_optimizer(drafter: Eagle3Drafter, optimizer: str = "muon", lr: float = 1e-3, weight_decay: float = 0.0,
                   dtype: str = "bf16", fused: bool = True) -> torch.optim.Optimizer:
    """AdamW on every trainable parameter (`adamw`), or (`muon`) Muon on the hidden matrices (fc and the
    midlayer's projections) with AdamW on the draft head and norms; betas 0.9/0.95 either way.
    `dtype` is the training's compute dtype; `fused` AdamW (not with FSDP's sharded parameters)."""
    trainable = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    if optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in trainable], lr=lr, betas=(0.9, 0.95),
                                 weight_decay=weight_decay, fused=fused)  # fused: faster (docs/cpu-performance.md)
    hidden = [p for n, p in trainable if p.ndim == 2 and not n.startswith("lm_head")]
    ids = {id(p) for p in hidden}
    # the Newton-Schulz iteration in the training's compute dtype: bf16 (as torch.optim.Muon) where bf16 is
    # native, fp32 where it is not: there a bf16 iteration is far slower (docs/cpu-performance.md)
    return MuonAdamW(hidden, [p for _, p in trainable if id(p) not in ids], lr=lr, weight_decay=weight_decay,
                     ns_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
