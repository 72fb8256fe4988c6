"""The CPU attention overrides (`cpu.attention`) against transformers' eager attention."""

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sdpa", [False, True])
def test_gqa_attention_equals_eager(dtype, sdpa, monkeypatch):
    """The grouped-query attention used for batched decoding equals transformers' eager
    attention (which copies each KV head to its query heads) computed in fp64, with a padding
    mask, on keys and values that are views of a longer buffer as the decoding cache hands
    them over (broadcast matmul; bf16 on an AMX CPU: SDPA's grouped kernel, to bf16 rounding).
    Both kernels run here whatever this CPU has."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import eager_attention_forward

    from eyas.cpu import attention
    from eyas.cpu.attention import gqa_attention

    monkeypatch.setattr(attention, "LOW_PRECISION_SDPA", sdpa)

    g = torch.Generator().manual_seed(0)
    B, H, kvh, T, S, D = 3, 6, 2, 2, 11, 8
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, kvh, S + 5, D, generator=g)[:, :, :S] for _ in range(2))
    mask = torch.zeros(B, 1, T, S + 5)  # longer than the cache: only its first S columns count
    mask[0, :, :, :4] = torch.finfo(torch.float32).min  # left padding of row 0
    mod = SimpleNamespace(num_key_value_groups=H // kvh, training=False)
    want, _ = eager_attention_forward(mod, q.double(), k.double(), v.double(), mask[..., :S].double(), scaling=0.3)
    got, _ = gqa_attention(mod, q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype), scaling=0.3)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.double(), want, atol=1e-6 if dtype == torch.float32 else 2e-2)
