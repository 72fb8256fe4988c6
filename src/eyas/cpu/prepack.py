"""Weights prepacked for small-batch CPU inference (oneDNN), the decoding-time form of every
`nn.Linear` of a model.

Why: decoding multiplies a few rows (1 token, or the 2-32 of a verification step) by every
weight matrix. With the plain row-major weight, PyTorch's CPU GEMM for more than one row
repacks the weight on every call, so in fp32 a forward of a few tokens cost far more than a
1-token forward and verifying drafts was never cheap. With the weights reordered once into
oneDNN's blocked layout that overhead is mostly gone (`bench/bench_prepack.py`; figures in
docs/cpu-performance.md). Inductor's CPU "freezing" and IPEX do the same.

Only the forward changes: the module keeps its `weight` Parameter (state dicts, tied
embeddings and Hugging Face `generate()` see the same model), plus a packed copy that is not
part of the state dict. Inference only (no autograd through the packed op).

`weights="fp16"` is for a drafter: fbgemm multiplies by an fp16 copy of each weight (fp32
accumulation), half the bytes a few-row product reads. Not exact, so never for a target: a
drafter's proposals are verified by the target, so greedy output stays identical and sampling
stays lossless (the drafts are drawn from, and judged against, the same distribution).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PACK_ROWS = 16  # the row count oneDNN tunes the layout for; best for 1..24 rows (docs/cpu-performance.md)


def supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether this PyTorch build can prepack `dtype` weights on `device` (CPU fp32 only:
    oneDNN refuses bf16 packing without AVX-512 or AVX-NE-CONVERT, and on the AMX machines
    that have them bf16 packing was never measured)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def fp16_supported(device: torch.device | str) -> bool:
    """Whether fbgemm's fp16-weight linear is available (x86 CPU builds)."""
    return (torch.device(device).type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_prepack_fp16"))


def _sharing(cls: type[nn.Linear], lin: nn.Linear) -> nn.Linear:
    """A `cls` module over `lin`'s own weight and bias Parameters (ties stay tied, state dicts
    unchanged), without allocating weights of its own."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = lin.in_features, lin.out_features
    new.weight, new.bias = lin.weight, lin.bias
    return new


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward uses a oneDNN-packed copy of its weight."""

    COPY_BYTES = 4  # per weight element

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> PackedLinear:
        new = _sharing(cls, lin)
        new.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), PACK_ROWS),
                            persistent=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")


class Fp16Linear(nn.Linear):
    """An `nn.Linear` whose forward multiplies by an fp16 copy of its weight (fbgemm, fp32
    accumulation). Each input column j is first scaled by a power of two s_j and the weight's
    column divided by it (exact in fp32), so every column uses fp16's full precision: a
    drafter's fc.weight carries the aux gain folded in (columns down to ~2^-11 of the others),
    which plain fp16 would push into its subnormal range."""

    COPY_BYTES = 2

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Fp16Linear:
        new = _sharing(cls, lin)
        w = lin.weight.detach().float()
        peak = w.abs().amax(0)
        scale = torch.where(peak > 0, torch.exp2(torch.round(torch.log2(peak))), torch.ones_like(peak))
        new.register_buffer("col_scale", scale, persistent=False)
        new.packed = torch.ops.quantized.linear_prepack_fp16(
            w / scale, None if lin.bias is None else lin.bias.detach().float())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x * self.col_scale).reshape(-1, self.in_features).contiguous()
        return torch.ops.quantized.linear_dynamic_fp16(rows, self.packed).reshape(*x.shape[:-1], self.out_features)


def prepack(model: nn.Module, budget_bytes: int | None = None, weights: str = "fp32") -> int:
    """Replace every `nn.Linear` of `model` (in place) by a `PackedLinear` (`weights="fp32"`,
    when `supported`) or an `Fp16Linear` (`"fp16"`, drafters only, when `fp16_supported`) if
    the packed copies fit in `budget_bytes`; returns how many were packed (0 = model
    unchanged)."""
    kinds = {"fp32": PackedLinear, "fp16": Fp16Linear}
    if weights not in kinds:
        raise ValueError(f"weights={weights!r}: fp32 or fp16")
    kind = kinds[weights]
    p = next(model.parameters())
    ok = supported(p.dtype, p.device) if weights == "fp32" else p.dtype == torch.float32 and fp16_supported(p.device)
    if not ok:
        return 0
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32]
    need = sum(c.weight.numel() * kind.COPY_BYTES for _, _, c in found)  # one packed copy each
    if budget_bytes is not None and need > budget_bytes:
        log.warning("not prepacking linear weights: the packed copies need %.1f GB, over the %.1f GB allowed",
                    need / 1e9, budget_bytes / 1e9)
        return 0
    for parent, name, child in found:
        setattr(parent, name, kind.from_linear(child))
    return len(found)
