"""Batched decoding for regeneration (`runtime.batched.decode_batch`): what transformers'
greedy generate() writes for each prompt alone, rows leaving the batch as they stop."""

from __future__ import annotations

import pytest
import torch
from conftest import KINDS

from eyas.cpu import prepack

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", KINDS + ("gpt_oss", "deepseek_v3"))
def test_decode_batch_equals_generate_one_by_one(tiny_targets, other_target, kind):
    """The batched regeneration decoder (left padding, rows leaving the batch as they stop,
    `gqa_attention` on CPU) writes what transformers' own greedy generate() writes for each
    prompt alone (fp32). GPT-OSS: attention sinks on its attention modules (its decoding must
    not go through `gqa_attention`, which has none); DeepSeek-V3: value heads narrower than
    query/key heads."""
    from eyas import targets
    from eyas.runtime.batched import decode_batch

    model, _ = targets.load(tiny_targets[kind] if kind in tiny_targets else other_target(kind))
    attn = model.config._attn_implementation
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 9, 12, 3, 21, 8, 14)]
    ref = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    # stop tokens taken from the reference answers, so rows stop at different steps
    stops = sorted({ref[0][2], ref[3][5], ref[6][8]})
    want = []
    for r in ref:
        cut = next((i for i, t in enumerate(r) if t in stops), None)
        want.append(r if cut is None else r[: cut + 1])
    assert len({len(w) for w in want}) > 2  # the batch really shrinks along the way
    head_inputs = []  # the LM head must see a contiguous (B, 1, H): a strided view made torch.matmul
    hook = model.get_output_embeddings().register_forward_pre_hook(  # copy the head B times
        lambda m, args: head_inputs.append(args[0].is_contiguous()))
    assert decode_batch(model, prompts, 12, stops) == want
    hook.remove()
    assert head_inputs and all(head_inputs)
    ticks: list[int] = []  # progress: the answer tokens each step wrote, rows that stopped not counted
    assert decode_batch(model, prompts, 12, [], tick=ticks.append) == ref
    assert ticks == [len(prompts)] * 12
    ticks.clear()
    assert decode_batch(model, prompts, 12, stops, tick=ticks.append) == want
    assert sum(ticks) == sum(map(len, want)) and ticks[0] == len(prompts) > ticks[-1]
    assert model.config._attn_implementation == attn  # restored
    if prepack.prepack(model):  # `data prepare --regenerate` prepacks fp32 CPU weights: same answers
        assert decode_batch(model, prompts, 12, stops) == want
