"""Batched decoding for regeneration (`decode_batch`): one preallocated KV cache, left padding,
finished rows leaving the batch; greedy unless a temperature is given. Token ids in, token ids
out: prompts, batching and the work file are `eyas.runtime.regenerate`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eyas.cpu.attention import plain_attention, register_decode_attention
from eyas.runtime.kv import PreallocLayer


@torch.inference_mode()
def decode_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                 temperature: float = 0.0, tick: Callable[[int], None] | None = None) -> list[list[int]]:
    """Continue each prompt until its first stop token (kept) or max_new_tokens: greedy, or
    sampled at `temperature` (torch's global RNG). Left-padded batch in one preallocated KV
    cache; finished sequences leave the batch once a quarter of it has finished, so short
    answers stop costing compute (transformers' `generate()` carries them to the end). Padding
    is id 0, masked out. `tick(n)` after each step: the n answer tokens it wrote (progress)."""
    prev = model.config._attn_implementation
    try:
        return _decode_batch(model, prompts, max_new_tokens, stop_ids, temperature, tick)
    finally:
        model.set_attn_implementation(prev)


def _decode_batch(model, prompts, max_new_tokens, stop_ids, temperature, tick) -> list[list[int]]:
    from transformers.cache_utils import Cache

    from eyas import targets

    dev = model.device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L + max_new_tokens, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, L - len(p):L] = 1
    pos = (mask[:, :L].cumsum(-1) - 1).clamp(min=0)
    n_layers = len(targets.find_decoder_stack(model).layers)
    cache = Cache(layers=[PreallocLayer(L + max_new_tokens) for _ in range(n_layers)])
    logits = model(input_ids=ids.to(dev), attention_mask=mask[:, :L].to(dev), position_ids=pos.to(dev),
                   past_key_values=cache, use_cache=True, logits_to_keep=_last(L)).logits[:, -1]
    if dev.type == "cpu" and plain_attention(model):  # one query per row from here on
        model.set_attn_implementation(register_decode_attention())
    nxt = pos[:, -1] + 1  # next position of each live row
    live = torch.arange(B)  # original index of each live row
    done = torch.zeros(B, dtype=torch.bool)
    stops = torch.tensor(stop_ids, dtype=torch.long)
    out: list[list[int]] = [[] for _ in range(B)]
    for step in range(max_new_tokens):
        if temperature > 0:
            tok = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1)[:, 0].cpu()
        else:
            tok = logits.float().argmax(-1).cpu()
        for r, t in zip(live.tolist(), tok.tolist()):
            out[r].append(t)
        if tick is not None:
            tick(int((~done).sum()))  # rows finished earlier ride along; their tokens are cut below
        done = done | torch.isin(tok, stops)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if int(done.sum()) * 4 >= live.numel():  # else finished rows ride along, cut below
            keep = (~done).nonzero()[:, 0]
            live, tok, nxt, mask, done = live[keep], tok[keep], nxt[keep], mask[keep], done[keep]
            for layer in cache.layers:
                layer.keep_sequences(keep.to(dev))
        mask[:, L + step] = 1
        logits = model(input_ids=tok[:, None].to(dev), attention_mask=mask[:, :L + step + 1].to(dev),
                       position_ids=nxt[:, None].to(dev), past_key_values=cache, use_cache=True).logits[:, -1]
        nxt = nxt + 1
    for row in out:
        cut = next((i for i, t in enumerate(row) if t in stop_ids), None)
        if cut is not None:
            del row[cut + 1:]
    return out


def _last(L: int) -> torch.Tensor:
    """`logits_to_keep` for the last position as an index tensor: the integer form slices the
    hidden states to a (B, 1, H) view that the LM head cannot fold into one matrix product, so
    torch.matmul expanded the head to (B, H, vocab) and copied it (docs/cpu-performance.md);
    indexing hands the head a contiguous (B, 1, H)."""
    return torch.tensor([L - 1])
