"""Batch planning (`core.batching`)."""

import torch


def test_plan_batches_bounds_rows_and_padded_tokens():
    """Regeneration batches: by length, at most batch_size rows, rows x longest prompt within
    batch_size x row_tokens (a prompt longer than that alone), every prompt exactly once."""
    from eyas.core.batching import plan_generation_batches as plan_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 90, (300,), generator=g).tolist() + [300, 150, 2000, 700, 120]
    batches = plan_batches(lengths, batch_size=16, row_tokens=64)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths)
    for b in batches:
        assert len(b) <= 16
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 16 * 64
    assert [len(b) for b in batches][-2:] == [1, 1]  # 700 and 2000 tokens: alone
    short = [b for b in batches if max(lengths[i] for i in b) <= 64]
    assert len(short) >= 10 and all(len(b) == 16 for b in short[:-1])  # short prompts fill whole batches
    assert plan_batches([10, 30, 20], batch_size=2) == [[0, 2], [1]]
