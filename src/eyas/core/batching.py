"""Planning padded batches of variable-length samples (pure index arithmetic, no I/O).

- training: batches under a token budget in a seeded order (`plan_train_batches`), every batch
  length rounded up (`shape_length`) so the kernels see few distinct shapes;
- regeneration: rows of similar prompt length under a row and padded-token budget
  (`plan_generation_batches`);
- capture: samples cut in order into shards of a byte budget (`plan_shards`), each shard's
  samples into length-sorted forward batches of a padded-token budget (`plan_capture_batches`).
"""

from __future__ import annotations

import torch

# Padded batch lengths are rounded up to a multiple of this: a few dozen distinct batch
# shapes instead of hundreds, so the CPU kernels and glibc's heap reuse what earlier steps
# set up: less wall time and peak memory for more padding (docs/cpu-performance.md).
SHAPE_MULTIPLE = 64


def shape_length(n: int) -> int:
    return -(-n // SHAPE_MULTIPLE) * SHAPE_MULTIPLE


def pad(seqs: list[torch.Tensor], T: int, value=0) -> torch.Tensor:
    out = seqs[0].new_full((len(seqs), T) + tuple(seqs[0].shape[1:]), value)
    for b, s in enumerate(seqs):
        out[b, : s.shape[0]] = s
    return out


LENGTH_WINDOW = 256  # samples sorted by length together when planning training batches


def plan_train_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, world: int = 1,
                 shuffle: bool = True) -> list[list[int]]:
    """Group sample indices into padded batches of at most `batch_tokens` (B * max length),
    in an order fixed by (seed, epoch); every batch holds at least `world` samples so each
    rank gets one (a leftover smaller group joins the previous batch). With `shuffle`, samples
    come in random order, sorted by length within windows of LENGTH_WINDOW (batches of similar
    lengths waste little on padding), and the batches are then shuffled."""
    n = len(lengths)
    order = list(range(n))
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100003 + epoch)
        order = torch.randperm(n, generator=g).tolist()
        order = [i for w in range(0, n, LENGTH_WINDOW) for i in sorted(order[w:w + LENGTH_WINDOW],
                                                                       key=lambda i: lengths[i])]
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if len(cur) >= world and (len(cur) + 1) * m > batch_tokens:
            batches.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        if len(cur) < world and batches:
            batches[-1].extend(cur)
        elif len(cur) >= world:
            batches.append(cur)
    if shuffle:
        batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
    return batches


ROW_TOKENS = 256  # a batch of B rows holds at most B x 256 prompt tokens, padding included


def plan_generation_batches(lengths: list[int], batch_size: int, row_tokens: int = ROW_TOKENS) -> list[list[int]]:
    """Indices of `lengths` in order of length, cut into batches of at most `batch_size` rows
    whose rows x longest prompt stays within batch_size x row_tokens (a longer prompt alone),
    so the long tail of a prompt set does not pay a full batch's padding and prefill for its
    longest prompt (measured: docs/cpu-performance.md)."""
    cap = batch_size * row_tokens
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and len(batches[-1]) < batch_size and (len(batches[-1]) + 1) * lengths[i] <= cap:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def plan_shards(lengths: list[int], bpt: int, shard_bytes: int) -> list[list[int]]:
    """Cut sample indices, in order, into shards of at most `shard_bytes` (>= 1 sample each)."""
    shards: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, n in enumerate(lengths):
        if cur and size + n * bpt > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n * bpt
    if cur:
        shards.append(cur)
    return shards


def plan_capture_batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches whose padded size (count x longest) stays within the budget."""
    order = sorted(indices, key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches
