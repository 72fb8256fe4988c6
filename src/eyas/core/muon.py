"""Muon for the drafter's hidden matrices and AdamW for everything else, as one optimizer.

Muon (Jordan et al., 2024) updates a weight matrix by its momentum orthogonalised: the
Newton-Schulz iteration below maps the momentum M = U S V^T to about U V^T (singular values
of random rectangular matrices land in 0.68-1.13; tiny ones grow less), so every direction of
the update moves at a similar rate. The step is scaled by 0.2 * sqrt(max(rows, cols)) so that
its RMS matches an AdamW step's and the same learning rate serves both kinds of parameter
("match_rms_adamw" in `torch.optim.Muon`). Matrices that read or write the vocabulary (the
draft head) stay on AdamW, as in Muon's own recipe, as do norms and anything not 2-D.

The iteration: Muon's reference (`REFERENCE`, `torch.optim.Muon`'s) divides by the Frobenius
norm and applies one quintic five times. eyas's default (`FAST`) divides further by
||X X^T||_F^(1/2) = (sum s^4)^(1/4), a bound on the largest singular value that is within 1.3x
of it on the drafter's momenta where the Frobenius norm is 1.3-3x off (it costs no product: the
Gram matrix is the first step's), and then applies three quintics, each its own, fitted to map
every singular value in [0.01, 1] into [0.75, 1.31] (the reference maps [0.01, 1] into
[0.68, 1.13] in five). Three matrix-product steps instead of five (timed in docs/cpu-performance.md).

Why eyas has its own and not `torch.optim.Muon`: that one runs the iteration in bf16, which
on a CPU without native bf16 is far slower than fp32's (docs/cpu-performance.md); here the iteration's
dtype is the caller's (`eyas.stages.trainer` passes the training's compute dtype), and with the
reference iteration in bf16 the update equals `torch.optim.Muon`'s (tests/core/test_muon.py). The
AdamW half is torch's AdamW update written out (equal to `torch.optim.AdamW` in tests), so one
optimizer, one state dict and one scheduler carry both halves through checkpoints and `--resume`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

Coefficients = tuple[tuple[float, float, float], ...]  # (a, b, c) of a x + b x^3 + c x^5, one per step
REFERENCE: Coefficients = ((3.4445, -4.7750, 2.0315),) * 5  # Muon's reference quintic, five times
# fitted here by minimising max |log p(s)| over s in [0.01, 1] (p: the three quintics composed)
FAST: Coefficients = ((5.1954, -15.0754, 11.1093), (3.891, -7.0082, 3.3289), (3.9702, -6.1495, 2.9468))


def orthogonalize(g: torch.Tensor, coefficients: Coefficients = FAST,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """About U V^T of g = U S V^T by Newton-Schulz steps in `dtype`; g's dtype back. `REFERENCE`
    normalises by the Frobenius norm alone, as Muon does; any other schedule also by (sum s^4)^(1/4)."""
    x = g.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T  # iterate on the (small, small x large) side: the Gram matrix is the smaller one
    x = x / x.norm().clamp(min=1e-7)  # spectral norm <= Frobenius norm = 1
    gram = x @ x.T  # (m, m)
    if coefficients != REFERENCE:  # by value: an equal schedule built elsewhere is the reference too
        t = gram.float().norm().clamp(min=1e-30).rsqrt()  # s_max <= ||gram||_F^(1/2) = (sum s^4)^(1/4) <= 1
        x, gram = x * t.to(dtype), gram * (t * t).to(dtype)
    for i, (a, b, c) in enumerate(coefficients):
        if i:
            gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b A + c A^2) x
    return (x.T if tall else x).to(g.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer, two kinds of parameter group: `muon` (2-D matrices) and `adamw`.

    Both take `lr` and `weight_decay` (decoupled: p -= lr * wd * p), so a scheduler scales both.
    `ns`, `ns_dtype`: the Newton-Schulz schedule and dtype (not saved in the state dict)."""

    def __init__(self, muon_params: Iterable[torch.Tensor], adamw_params: Iterable[torch.Tensor], lr: float,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 momentum: float = 0.95, ns: Coefficients = FAST, ns_dtype: torch.dtype = torch.float32):
        groups = [{"params": list(muon_params), "kind": "muon"}, {"params": list(adamw_params), "kind": "adamw"}]
        for p in groups[0]["params"]:
            if p.ndim != 2:
                raise ValueError(f"Muon updates 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
        super().__init__([g for g in groups if g["params"]],
                         dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, momentum=momentum))
        self.ns, self.ns_dtype = ns, ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            update = self._muon if group["kind"] == "muon" else self._adamw
            for p in group["params"]:
                if p.grad is not None:
                    update(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, mu = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - mu)
        direction = orthogonalize(p.grad.lerp(buf, mu), self.ns, self.ns_dtype)  # Nesterov
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(direction, alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        (b1, b2), g = group["betas"], p.grad
        state["step"] += 1
        t = state["step"]
        p.mul_(1 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(g, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))
