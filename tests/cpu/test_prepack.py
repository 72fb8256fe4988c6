"""core/prepack: oneDNN-packed linear layers compute what nn.Linear computes, and change
nothing else about the model (state dict, tied weights, dtypes other than fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from eyas import targets
from eyas.cpu import prepack

pytestmark = pytest.mark.skipif(not prepack.supported(torch.float32, "cpu"),
                                reason="this PyTorch build has no oneDNN linear packing")


def test_packed_model_matches_plain_and_keeps_its_state(tiny_target):
    model, _ = targets.load(tiny_target)
    packed = copy.deepcopy(model)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack.prepack(packed) == n_linear > 0
    assert not any(type(m) is nn.Linear for m in packed.modules())
    ids = torch.randint(3, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, got = model(ids).logits, packed(ids).logits  # (2, 17, V): 2-D and 3-D inputs both
        one = packed(ids[:1, :1]).logits  # a single row, as in plain decoding
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(one[0, 0], want[0, 0], rtol=1e-4, atol=1e-5)
    # the state dict is the model's own: same keys, same tensors, no packed copies in it
    sd, sd0 = packed.state_dict(), model.state_dict()
    assert sd.keys() == sd0.keys()
    assert all(torch.equal(sd[k], sd0[k]) for k in sd)
    if model.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.get_input_embeddings().weight


def test_packed_linear_with_bias_and_leading_dims():
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)
    x = torch.randn(3, 5, 24)
    pl = prepack.PackedLinear.from_linear(lin)
    assert pl.weight is lin.weight and pl.bias is lin.bias
    with torch.no_grad():
        torch.testing.assert_close(pl(x), lin(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pl(x[:, 1]), lin(x[:, 1]), rtol=1e-5, atol=1e-6)  # non-contiguous rows


def test_packing_stays_within_the_memory_budget(tiny_target):
    model, _ = targets.load(tiny_target)
    need = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is nn.Linear)
    assert prepack.prepack(model, budget_bytes=need - 1) == 0  # over budget: left as it is
    assert not any(isinstance(m, prepack.PackedLinear) for m in model.modules())
    assert targets.prepack_for_decoding(model) > 0  # the stages' budget: half the memory available now


def test_only_fp32_cpu_models_are_packed():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(torch.bfloat16)
    assert prepack.prepack(m) == 0
    assert type(m[0]) is nn.Linear
    assert not prepack.supported(torch.float32, "cuda")


@pytest.mark.skipif(not prepack.fp16_supported("cpu"), reason="no fbgemm fp16 linear in this build")
def test_fp16_linear_keeps_precision_in_quiet_columns():
    """A drafter's fc.weight holds the aux gain folded in: some columns 2^-11 or less of the others,
    fed by inputs as much larger. Per-column power-of-two scaling keeps fp16's relative precision
    there; plain fp16 weights would fall into its subnormal range (checked below)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    quiet = torch.arange(64) % 2 == 0
    with torch.no_grad():
        lin.weight[:, quiet] *= 2.0 ** -15
    x = torch.randn(5, 3, 64)
    x[..., quiet] *= 2.0 ** 15
    f16 = prepack.Fp16Linear.from_linear(lin)
    assert f16.weight is lin.weight and f16.bias is lin.bias and f16.state_dict().keys() == lin.state_dict().keys()
    with torch.no_grad():
        want = lin(x)
        torch.testing.assert_close(f16(x), want, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(f16(x[:, 1]), want[:, 1], rtol=2e-3, atol=2e-3)  # non-contiguous rows
        naive = x @ lin.weight.half().float().T + lin.bias  # fp16 weights without the column scaling
    assert (naive - want).abs().max() > 10 * (f16(x) - want).abs().max()


@pytest.mark.skipif(not prepack.fp16_supported("cpu"), reason="no fbgemm fp16 linear in this build")
def test_fp16_packing_of_a_drafter_counts_its_linears():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert prepack.prepack(m, weights="fp16") == 2 and isinstance(m[2], prepack.Fp16Linear)
    assert prepack.prepack(nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16), weights="fp16") == 0
