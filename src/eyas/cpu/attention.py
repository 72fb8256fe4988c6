"""Attention overrides for the target on a CPU, each registered with transformers'
`AttentionInterface` under its own name and checked against the plain path it replaces:

- `sdpa_grouped` (speculative verification, `runtime.runners.TargetRunner`): transformers' sdpa
  attention without its copy of every KV head per query head under a mask; bit-identical to it
  (tests/core/test_speculative.py).
- `gqa_attention` (batched regeneration, `regenerate`): a few queries per row over a long
  preallocated cache without eager attention's `repeat_kv`; same greedy answers as eager
  attention (tests/stages/test_data.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eyas.cpu.isa import cpu_has_amx

GROUPED_SDPA = "eyas_sdpa_grouped"


def sdpa_grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, except that grouped KV heads reach SDPA as they are
    (`enable_gqa`) under a mask too. On a CPU transformers copies each KV head to all of its
    query heads whenever a mask is present, i.e. the whole KV cache per layer in every
    verification forward (SmolLM2: 3 KV heads -> 9). SDPA's own grouping computes the same
    values bit for bit (test_speculative.py) without the copy. Without a mask, with one KV head
    per query head, or with anything else sdpa handles (position bias, paged cache), transformers'
    own function runs."""
    if (attention_mask is None or query.shape[1] == key.shape[1] or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def grouped_config(model, layer):
    """The config whose `_attn_implementation` the decoder layers read, when switching it to
    `sdpa_grouped` applies (CPU, sdpa, grouped KV heads); else None. `layer`: one of the model's
    decoder layers (`targets.find_decoder_stack(model).layers[0]`). On CUDA a mask with
    `enable_gqa` can send SDPA to its math kernel, so there transformers' choice stands."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    attn = getattr(layer, "self_attn", None)
    cfg = getattr(attn, "config", None)
    if (next(model.parameters()).device.type != "cpu" or cfg is None
            or getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(attn, "num_key_value_groups", 1) <= 1):
        return None
    AttentionInterface.register(GROUPED_SDPA, sdpa_grouped)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)
    return cfg


@contextlib.contextmanager
def grouped_attention(cfg):
    """Run the target's forwards inside with `sdpa_grouped` (cfg from `grouped_config`; None:
    unchanged). Only inside: the same model also runs Hugging Face's own baselines."""
    if cfg is None:
        yield
        return
    prev, cfg._attn_implementation = cfg._attn_implementation, GROUPED_SDPA
    try:
        yield
    finally:
        cfg._attn_implementation = prev



# ---------------------------------------------------------------- batched decoding

DECODE_ATTENTION = "eyas_gqa_decode"


# Whether bf16 / fp16 decoding attention goes through SDPA's grouped-query kernel: where the CPU
# has AMX. There SDPA beats the matmul below; without AMX (AVX512-BF16 alone) the matmul is faster,
# so it serves every dtype (per-layer timings: docs/cpu-performance.md).
LOW_PRECISION_SDPA = cpu_has_amx()


def gqa_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """Attention for a few queries per sequence over a long KV cache, on CPU, without
    transformers' eager `repeat_kv` copy (B x heads x S x d per layer and step). The cache's
    keys and values are views of a preallocated buffer (strided over the batch). In bf16 / fp16
    on a CPU with AMX, SDPA's grouped-query kernel reads them as they are (`LOW_PRECISION_SDPA`).
    Otherwise the grouped query heads share their KV head through a broadcast matmul (in fp32
    no slower than SDPA: docs/cpu-performance.md), softmax in fp32 as eager attention does."""
    if kwargs.get("s_aux") is not None or kwargs.get("softcap") is not None:  # `plain_attention` keeps them out
        raise NotImplementedError("gqa_attention has no attention sinks or logit soft-capping")
    S = key.shape[2]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :S]
    if query.dtype != torch.float32 and LOW_PRECISION_SDPA:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2), None
    B, H, T, D = query.shape
    kvh = key.shape[1]
    q = query.reshape(B, kvh, (H // kvh) * T, D)  # head h uses KV head h // (H // kvh)
    scores = (q @ key.transpose(-1, -2)).view(B, H, T, S) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = probs.view(B, kvh, (H // kvh) * T, S) @ value  # values may be narrower than keys (DeepSeek's MLA)
    return out.view(B, H, T, value.shape[-1]).transpose(1, 2), None


def register_decode_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(DECODE_ATTENTION, gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, eager_mask)
    return DECODE_ATTENTION


def plain_attention(model) -> bool:
    """Whether the target's attention is plain scaled dot product (no logit soft-capping or
    attention sinks, which `gqa_attention` does not implement). Sinks are looked for in the
    config and on the modules: gpt-oss keeps them as a parameter of each attention layer."""
    cfg = model.config.get_text_config()
    if any(getattr(cfg, k, None) for k in ("attn_logit_softcapping", "attention_sink", "sinks")):
        return False
    return not any(hasattr(m, "sinks") for m in model.modules())
