"""Draft-vocabulary maps as pure tensor code (DESIGN 4): building `d2t`/`t2d` from token
counts, checking their invariants, comparing two maps, and carrying `lm_head` rows from
one draft vocabulary to another.

Conventions: the draft vocabulary is a sorted list of target ids `ids` (length N);
`d2t[i] = ids[i] - i` (offsets, so `target_id = i + d2t[i]`, as SGLang, vLLM and
speculators read it) and `t2d` is a bool mask over the V target ids.
No I/O here; `eyas.formats.vocab` reads and writes these tensors.
"""

from __future__ import annotations

import torch

from eyas.errors import EyasError


class VocabMapError(EyasError):
    """A d2t/t2d pair that breaks DESIGN 4's invariants (exit 2; message names the fix)."""


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id at supervised positions: LongTensor [V] (one bincount)."""
    ids = input_ids.reshape(-1).long()
    keep = loss_mask.reshape(-1).bool()
    ids = ids[keep]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise EyasError(f"token id {int(ids.max())} lies outside the target vocabulary of {vocab_size}; "
                        "the prepared data was made with another tokenizer: prepare it again for this target")
    return torch.bincount(ids, minlength=vocab_size)


def select_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The N most frequent ids, ties by lower id, padded with the lowest unused ids; sorted.

    A stable descending sort keeps equal counts in ascending id order, and unused ids
    (count 0) come last in ascending order, so the first N entries are exactly the
    top-N with DESIGN 4's tie-break and padding rule.
    """
    V = counts.numel()
    if not 0 < n <= V:
        raise EyasError(f"draft vocabulary size {n} must lie in 1..{V} (the target vocabulary size)")
    order = torch.sort(counts.long(), descending=True, stable=True).indices  # (V,)
    return torch.sort(order[:n]).values


def d2t_from_ids(sorted_ids: torch.Tensor) -> torch.Tensor:
    """Offsets: `d2t[i] = ids[i] - i` (int64)."""
    ids = sorted_ids.long()
    return ids - torch.arange(ids.numel(), dtype=torch.long)


def t2d_from_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool mask [V]: true where the target id is in the draft vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids.long()] = True
    return t2d


def build_from_counts(counts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [N] int64 offsets, t2d [V] bool) for the top-N ids of `counts`."""
    ids = select_ids(counts, n)
    return d2t_from_ids(ids), t2d_from_ids(ids, counts.numel())


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """`arange(N) + d2t`: the target id of each draft id."""
    return torch.arange(d2t.numel(), dtype=torch.long) + d2t.long()


def strictly_increasing(x: torch.Tensor) -> bool:
    return bool((x[1:] > x[:-1]).all()) if x.numel() > 1 else True


def in_vocab(ids: torch.Tensor, vocab_size: int | None) -> bool:
    """All ids non-negative and, when the vocabulary size is known, below it."""
    return bool((ids >= 0).all()) and (vocab_size is None or bool((ids < vocab_size).all()))


def looks_absolute(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int | None) -> bool:
    """Whether `d2t` holds absolute target ids instead of offsets (a known export bug): t2d marks
    d2t's own values, or d2t reads as a sorted id list while `arange(N) + d2t` leaves the vocabulary.
    (For a strictly increasing d2t the target ids are increasing too, so only range can fail.)"""
    d = d2t.long()
    tgt = target_ids(d)
    if t2d is not None and marks_own_values(t2d, d, tgt):
        return True
    return d.numel() > 1 and strictly_increasing(d) and in_vocab(d, vocab_size) and not in_vocab(tgt, vocab_size)


def t2d_agrees(t2d: torch.Tensor, tgt: torch.Tensor) -> bool:
    """`nonzero(t2d) == tgt` (tgt sorted ascending): t2d marks exactly the draft vocabulary."""
    held = torch.nonzero(t2d.bool()).flatten()
    return held.numel() == tgt.numel() and torch.equal(held, tgt)


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor, target_size: int | None = None) -> None:
    """Raise VocabMapError unless (d2t, t2d) satisfy `nonzero(t2d) == arange(N) + d2t`.

    Names the likely cause: absolute ids stored in `d2t` (a known export bug), duplicates,
    ids outside the target vocabulary, a t2d that disagrees, or the wrong target size.
    """
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise VocabMapError(f"d2t and t2d must be 1-D; got shapes {tuple(d2t.shape)} and {tuple(t2d.shape)}")
    if d2t.dtype.is_floating_point:
        raise VocabMapError(f"d2t has dtype {d2t.dtype}; it must hold int64 offsets")
    V, N = t2d.numel(), d2t.numel()
    if target_size is not None and V != target_size:
        raise VocabMapError(f"t2d covers {V} target ids but the target vocabulary has {target_size}; "
                            "build the draft vocabulary for this target (eyas vocab build)")
    if N == 0 or N > V:
        raise VocabMapError(f"draft vocabulary size {N} must lie in 1..{V}")
    tgt = target_ids(d2t)
    if looks_absolute(d2t, t2d, V):
        raise VocabMapError("d2t holds absolute target ids, not offsets (target_id = i + d2t[i]); "
                            "fix: store d2t = ids - arange(N)")
    if not in_vocab(tgt, V):
        raise VocabMapError(f"d2t maps draft ids to target ids outside 0..{V - 1} "
                            f"(min {int(tgt.min())}, max {int(tgt.max())}); rebuild the vocabulary")
    if not strictly_increasing(tgt):
        raise VocabMapError("d2t maps two draft ids to the same target id or is not sorted ascending; "
                            "rebuild the vocabulary (eyas vocab build)")
    if t2d.dtype != torch.bool:
        raise VocabMapError(f"t2d has dtype {t2d.dtype}; it must be bool [V]")
    if not t2d_agrees(t2d, tgt):
        held = int(t2d.sum())
        raise VocabMapError(f"t2d is inconsistent with d2t: t2d marks {held} ids, d2t maps {N}, "
                            "and nonzero(t2d) != arange(N) + d2t; rebuild t2d from d2t")


def marks_own_values(t2d: torch.Tensor, d: torch.Tensor, tgt: torch.Tensor) -> bool:
    """t2d marks exactly d2t's own values, not `arange(N) + d2t`: absolute ids stored in d2t."""
    if t2d.dtype != torch.bool or d.numel() < 2:
        return False
    held = torch.nonzero(t2d).flatten()
    return (held.numel() == d.numel() and torch.equal(held, torch.sort(d.long()).values)
            and not torch.equal(held, torch.sort(tgt).values))


def ascending_order(d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor | None:
    """The permutation `p` that sorts a map held in another order, or None.

    Engines only add the offsets (`target = i + d2t[i]`), so a d2t whose target ids are
    distinct and within 0..V-1 but not ascending serves exactly as well as the sorted one;
    eyas keeps DESIGN 4's ascending order, and `lm_head[p]` with `d2t_from_ids(ids[p])`
    drafts the same target tokens. None when the map is ascending already, is not integer,
    is not a permutation of distinct in-range ids, or `t2d` marks d2t's own values (absolute
    ids in another order): `check_maps` then names the fault.
    """
    if d2t.dim() != 1 or t2d.dim() != 1 or d2t.dtype.is_floating_point:
        return None
    tgt = target_ids(d2t)
    if strictly_increasing(tgt) or not bool(((tgt >= 0) & (tgt < t2d.numel())).all()):
        return None
    if torch.unique(tgt).numel() != tgt.numel() or marks_own_values(t2d, d2t, tgt):
        return None
    return torch.argsort(tgt)


def sort_map(d2t: torch.Tensor, t2d: torch.Tensor, rows: torch.Tensor | None = None):
    """(d2t, rows, moved): a map held in another order sorted ascending, with the lm_head rows
    moved along (see `ascending_order`); unchanged, and moved False, otherwise."""
    order = ascending_order(d2t, t2d)
    if order is None:
        return d2t, rows, False
    return d2t_from_ids(target_ids(d2t)[order]), None if rows is None else rows[order], True


def coverage(ids: torch.Tensor, counts: torch.Tensor) -> float:
    """Share of counted (supervised) tokens whose id is in `ids`."""
    total = int(counts.sum())
    return float(counts[ids.long()].sum()) / total if total else 0.0


def compare_maps(a_ids: torch.Tensor, b_ids: torch.Tensor, counts: torch.Tensor | None = None) -> dict:
    """Compare two draft vocabularies given as target ids per draft id.

    Returns sizes, `same_position` (draft id i maps to the same target id in both: rows of
    an lm_head trained for A are valid for B only there), `overlap` (target ids in both),
    `b_served_by_a` (share of B's draft ids that A holds somewhere, i.e. what a row
    permutation could carry over), `identical`, and coverages when `counts` is given.
    """
    a, b = a_ids.long().flatten(), b_ids.long().flatten()
    n = min(a.numel(), b.numel())
    same = int((a[:n] == b[:n]).sum())
    overlap = int(torch.isin(b, a).sum())
    out = {
        "size_a": a.numel(),
        "size_b": b.numel(),
        "same_position": same,
        "overlap": overlap,
        "b_served_by_a": overlap / b.numel() if b.numel() else 0.0,
        "identical": a.numel() == b.numel() and same == a.numel(),
        "permutation": a.numel() == b.numel() == overlap and same < a.numel(),
    }
    if counts is not None:
        out["coverage_a"] = coverage(a, counts)
        out["coverage_b"] = coverage(b, counts)
    return out


def remap_rows(old_weight: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor,
               fallback_rows: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Carry lm_head rows by target id from an old draft vocabulary to a new one.

    Row j of the result is the old row of target id `new_ids[j]` when the old vocabulary
    holds it, else `fallback_rows[j]` (e.g. the target's lm_head row), else zeros.
    Returns (new_weight [N_new, H], number of rows carried).
    """
    old, new = old_ids.long().flatten(), new_ids.long().flatten()
    assert old_weight.shape[0] == old.numel(), "one lm_head row per old draft id"
    size = int(max(old.max(), new.max())) + 1
    where = torch.full((size,), -1, dtype=torch.long)
    where[old] = torch.arange(old.numel())
    pos = where[new]  # (N_new,) row in the old head, -1 if absent
    carried = pos >= 0
    if fallback_rows is not None:
        assert fallback_rows.shape == (new.numel(), old_weight.shape[1]), "one fallback row per new id"
        out = fallback_rows.to(old_weight.dtype).clone()
    else:
        out = torch.zeros(new.numel(), old_weight.shape[1], dtype=old_weight.dtype)
    out[carried] = old_weight[pos[carried]]
    return out, int(carried.sum())


def head_match(head: torch.Tensor, target_head: torch.Tensor, readings: dict[str, torch.Tensor],
               rows: int = 512, seed: int = 0) -> dict:
    """Which draft->target map a drafter's lm_head was trained with, from the head itself.

    eyas starts the head from the target's rows of the draft ids (`head[i] = T[ids[i]]`, as
    speculators does) and peers that freeze it keep exact copies, so the nearest target row of
    head row i (by cosine) is `T[ids[i]]` for the map the head was trained with, and almost never
    for another (chance: about 1/V). On `rows` seeded sample rows:

        nearest[i] = argmax_j cos(head[i], T[j])          # (S,)
        agree[m]   = mean_i [nearest[i] == ids_m[i]]      # share of rows map m explains
        cos[m]     = mean_i cos(head[i], T[ids_m[i]])

    `readings`: name -> (N,) target ids per draft id (entries outside [0, V) count as misses).
    Returns {"rows", "agree": {m: float}, "cos": {m: float}, "nearest_cos": mean best cosine,
    "sample": the sampled draft ids, "nearest": their nearest target ids}.
    """
    n, V = head.shape[0], target_head.shape[0]
    if head.shape[1] != target_head.shape[1]:  # another width: the head cannot come from these rows
        return {"rows": 0, "agree": {m: 0.0 for m in readings}, "cos": {m: 0.0 for m in readings},
                "nearest_cos": 0.0, "sample": [], "nearest": []}
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n, generator=g)[:rows].sort().values
    h = torch.nn.functional.normalize(head[pick].float(), dim=1)  # (S, H)
    t = torch.nn.functional.normalize(target_head.float(), dim=1)  # (V, H)
    sims = h @ t.T  # (S, V)
    best, nearest = sims.max(dim=1)
    agree, cos = {}, {}
    for m, ids in readings.items():
        sel = ids.long().flatten()[pick]
        ok = (sel >= 0) & (sel < V)
        got = torch.zeros_like(best)
        got[ok] = sims[ok.nonzero().flatten(), sel[ok]]
        agree[m] = float(((nearest == sel) & ok).float().mean())
        cos[m] = float(got.mean())
    return {"rows": int(pick.numel()), "agree": agree, "cos": cos, "nearest_cos": float(best.mean()),
            "sample": pick.tolist(), "nearest": nearest.tolist()}
