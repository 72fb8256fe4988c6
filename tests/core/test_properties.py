"""Property-based tests (issue 8.5): vocabulary maps, TTT attention masks, tree masks and the
acceptance rules, each against a naive reference on random small inputs."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.core import speculative as spec
from eyas.core import ttt
from eyas.core import vocab as cv

FEW = settings(max_examples=20, deadline=None)


@st.composite
def counts_and_n(draw):
    V = draw(st.integers(1, 40))
    counts = draw(st.lists(st.integers(0, 5), min_size=V, max_size=V))  # small values: many ties and zeros
    return torch.tensor(counts, dtype=torch.long), draw(st.integers(1, V))


@FEW
@given(counts_and_n())
def test_vocab_maps_invariants_and_rule(cn):
    counts, n = cn
    d2t, t2d = cv.build_from_counts(counts, n)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and d2t.numel() == n
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(n) + d2t)  # DESIGN 4 invariant
    cv.check_maps(d2t, t2d, counts.numel())
    # reference: most frequent first, ties (and unused-id padding) by lower id, then ascending
    ref = sorted(sorted(range(counts.numel()), key=lambda i: (-int(counts[i]), i))[:n])
    assert (torch.arange(n) + d2t).tolist() == ref
    d2t2, t2d2 = cv.build_from_counts(counts.clone(), n)  # deterministic
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)


@FEW
@given(st.integers(2, 30), st.data())
def test_vocab_padding_uses_lowest_unused(V, data):
    used = sorted(set(data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=V))))
    n = data.draw(st.integers(len(used), V))
    counts = torch.zeros(V, dtype=torch.long)
    counts[used] = 3
    ids = (torch.arange(n) + cv.build_from_counts(counts, n)[0]).tolist()
    unused = [i for i in range(V) if i not in used]
    assert ids == sorted(used + unused[: n - len(used)])


@FEW
@given(st.integers(1, 2), st.sampled_from([(2, 1), (2, 2), (4, 2)]), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 10_000))
def test_ttt_attention_matches_dense_reference(B, heads, T, K, seed):
    nh, nkv = heads
    hd = 4
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(B, nh, T, hd, generator=g, dtype=torch.float32) for _ in range(K)]
    ks = [torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float32) for _ in range(K)]
    vs = [torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float32) for _ in range(K)]
    attend = ttt.TTTAttention()
    got = [attend(q, k, v) for q, k, v in zip(qs, ks, vs)]
    ref = ttt.dense_ttt_reference(qs, ks, vs)
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"TTT step {i}")


@st.composite
def trees(draw):
    T = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, T)]
    tokens = draw(st.lists(st.integers(0, 7), min_size=T, max_size=T))
    depth = [0] * T
    for i in range(1, T):
        depth[i] = depth[parents[i]] + 1
    return spec.Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth))


@FEW
@given(trees(), st.integers(0, 5))
def test_tree_mask_is_prefix_plus_ancestors(tree, prefix):
    m = spec.tree_mask(tree, prefix, torch.float32)[0, 0]  # (T, prefix + T)
    T = len(tree)
    assert m.shape == (T, prefix + T)
    allowed = m == 0
    assert allowed[:, :prefix].all()
    for i in range(T):
        anc, j = set(), i
        while j >= 0:
            anc.add(j)
            j = int(tree.parents[j])
        assert {j for j in range(T) if allowed[i, prefix + j]} == anc


@FEW
@given(st.integers(0, 6), st.integers(0, 10_000))
def test_greedy_accepts_the_matching_prefix(n, seed):
    g = torch.Generator().manual_seed(seed)
    V = 5
    logits = torch.randn(n + 1, V, generator=g)
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(n, generator=g) < 0.7, best[:n], (best[:n] + 1) % V)
    path, bonus = spec.accept_greedy(spec.chain_tree(3, drafts), logits)
    k = 0
    while k < n and int(drafts[k]) == int(best[k]):
        k += 1
    assert path == list(range(k + 1)) and bonus == int(best[k])


@FEW
@given(st.integers(2, 8), st.integers(0, 10_000))
def test_speculative_residual_is_a_valid_distribution(V, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    resid = (p - q).clamp_min(0)
    if resid.sum() <= 1e-6:
        return  # p == q: acceptance is certain, no residual
    resid = resid / resid.sum()
    assert (resid >= 0).all() and abs(float(resid.sum()) - 1) < 1e-5
    # exact output law of one-draft speculative sampling equals p (Leviathan et al. 2023)
    accept = torch.minimum(torch.ones(V), p / q)
    law = q * accept + (1 - float((q * accept).sum())) * resid
    torch.testing.assert_close(law, p, atol=1e-5, rtol=0)
    # the rule itself: a candidate p gives zero mass is always rejected, and the token drawn
    # comes from the residual's support
    c = int(torch.argmin(p))
    p0 = p.clone()
    p0[c] = 0
    p0 /= p0.sum()
    qc = torch.zeros(V)
    qc[c] = 1.0
    for _ in range(5):
        idx, tok = spec.recursive_reject(p0, [c], [qc], g)
        assert idx is None and tok != c and float(p0[tok]) > 0
