"""core/ttt.py: TTT attention vs a dense-mask reference, shifts, target table, loss vs a
naive per-position reference, and the acceptance metrics."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.core import batching
from eyas.core import ttt
from eyas.core.drafter import DrafterConfig, Eagle3Drafter


def _qkv(K, B=2, nh=4, nkv=2, T=6, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, T, hd, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return [mk(nh) for _ in range(K)], [mk(nkv) for _ in range(K)], [mk(nkv) for _ in range(K)]


@pytest.mark.parametrize("K", [1, 2, 4])
def test_ttt_attention_equals_dense_mask_values_and_grads(K):
    qs, ks, vs = _qkv(K)
    att = ttt.TTTAttention()
    got = [att(q, k, v) for q, k, v in zip(qs, ks, vs)]
    ref = ttt.dense_ttt_reference(qs, ks, vs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    w = [torch.randn_like(o) for o in got]
    g1 = torch.autograd.grad(sum((o * x).sum() for o, x in zip(got, w)), qs + ks + vs)
    g2 = torch.autograd.grad(sum((o * x).sum() for o, x in zip(ref, w)), qs + ks + vs)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dense_reference_mask_semantics():
    # step 2, query t=3 sees step-0 keys 0..3 and the keys of steps 1 and 2 at t=3 only.
    T = 5
    q = [torch.zeros(1, 1, T, 2) for _ in range(3)]
    v = [torch.zeros(1, 1, T, 2) for _ in range(3)]
    k = [torch.zeros(1, 1, T, 2) for _ in range(3)]
    v[1][0, 0, 3] = torch.tensor([9.0, 0.0])  # only visible at t=3
    v[1][0, 0, 4] = torch.tensor([0.0, 100.0])  # never visible from t=3
    out = ttt.dense_ttt_reference(q, k, v)[2][0, 0, 3]
    torch.testing.assert_close(out, torch.tensor([9.0 / 6, 0.0]))  # uniform over 4 + 2 keys


def test_shifts_and_positions():
    x = torch.arange(10).view(1, 10)
    ids, pos = ttt.step_inputs(x, 0)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]] and pos[0, 0] == 0
    ids, pos = ttt.step_inputs(x, 2)
    assert ids[0, :7].tolist() == [3, 4, 5, 6, 7, 8, 9] and ids[0, 7:].tolist() == [0, 0, 0]
    assert pos[0].tolist() == list(range(2, 12))


def test_target_table_rows_and_masks():
    B, T, H, V = 1, 8, 4, 6
    torch.manual_seed(0)
    last = torch.randn(B, T, H)
    lm = torch.randn(V, H)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1]])
    tids = torch.tensor([0, 2, 3, 5])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    tab = ttt.target_table(last, mask, lm, tids, t2d, chunk=2)
    # supervised target positions p: mask[p+1] == 1 -> p in {1, 2, 4, 5, 6}
    assert (tab.index[0] >= 0).nonzero().flatten().tolist() == [1, 2, 4, 5, 6]
    full = last[0] @ lm.T
    for p in [1, 2, 4, 5, 6]:
        r = int(tab.index[0, p])
        assert int(tab.argmax[r]) == int(full[p].argmax())
        torch.testing.assert_close(tab.probs[r], torch.softmax(full[p, tids], -1))
        assert bool(tab.in_vocab[r]) == bool(t2d[full[p].argmax()])
    # step i at index t uses position t+1+i and counts iff mask[t+2+i] == 1
    for i in range(3):
        rows = tab.step_rows(i)[0]
        for t in range(T):
            ok = t + 2 + i < T and mask[0, t + 2 + i] == 1
            assert (int(rows[t]) >= 0) == ok
            if ok:
                assert int(rows[t]) == int(tab.index[0, t + 1 + i])


def test_target_table_with_known_argmax():
    torch.manual_seed(1)
    last, lm = torch.randn(2, 7, 4), torch.randn(9, 4)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    tids = torch.tensor([1, 4, 6, 8])
    t2d = torch.zeros(9, dtype=torch.bool)
    t2d[tids] = True
    tab = ttt.target_table(last, mask, lm, tids, t2d, chunk=3)
    assert tab.rows_per_sample() == [4, 4]
    again = ttt.target_table(last, mask, lm, tids, t2d, chunk=3, argmax=tab.argmax.to(torch.int32))
    assert torch.equal(again.probs, tab.probs) and torch.equal(again.argmax, tab.argmax)
    assert torch.equal(again.in_vocab, tab.in_vocab)
    # a stale argmax for a different batch is refused, not silently misaligned
    with pytest.raises(ValueError, match="supervised positions"):
        ttt.target_table(last, mask, lm, tids, t2d, argmax=tab.argmax[:-1])
    # the head split once by a trainer gives the same table; draft rows alone cannot give the argmax
    split = ttt.target_table(last, mask, lm, tids, t2d, chunk=3, rows=ttt.head_rows(lm, tids))
    assert torch.equal(split.probs, tab.probs) and torch.equal(split.argmax, tab.argmax)
    draft_only = ttt.head_rows(lm, tids, rest=False)
    again = ttt.target_table(last, mask, lm, tids, t2d, chunk=3, argmax=tab.argmax, rows=draft_only)
    assert torch.equal(again.probs, tab.probs)
    with pytest.raises(ValueError, match="rest=True"):
        ttt.target_table(last, mask, lm, tids, t2d, rows=draft_only)
    with pytest.raises(ValueError, match="draft rows"):  # split for another vocabulary
        ttt.target_table(last, mask, lm, tids, t2d, rows=ttt.head_rows(lm, tids[:-1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [7, 40])
def test_target_table_argmax_with_ties_equals_full_vocabulary_argmax(dtype, N):
    """Entries in {-1, 0, 1}: every product is a small integer, exact in bf16, so maxima tie often
    within the draft rows, within the others and across the two; a full-vocabulary argmax
    (first maximum = lowest id) is the reference. N = V: no other rows."""
    V, H = 40, 6
    g = torch.Generator().manual_seed(3)
    last = torch.randint(-1, 2, (3, 50, H), generator=g).to(dtype)
    lm = torch.randint(-1, 2, (V, H), generator=g).to(dtype)
    mask = torch.ones(3, 50)
    tids = torch.sort(torch.randperm(V, generator=g)[:N]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    full = last.float()[:, :-1].reshape(-1, H) @ lm.float().T  # every position but the last is supervised
    want = full.argmax(-1)
    ties = ((full == full.amax(-1, keepdim=True)).sum(-1) > 1).sum()
    assert ties > 50  # the case under test is common here
    for chunk in (1, 7, 256):
        tab = ttt.target_table(last, mask, lm, tids, t2d, chunk=chunk)
        assert torch.equal(tab.argmax, want)
        assert torch.equal(tab.in_vocab, t2d[want])
    if N < V:
        assert 0 < int(tab.in_vocab.sum()) < want.numel()  # both kinds of winner occur


def tiny_drafter(V=32, N=20, H=16, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, intermediate_size=32, vocab_size=V, draft_vocab_size=N,
                        aux_layer_ids=[1, 2, 3])
    d = Eagle3Drafter(cfg).double()
    for p in d.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    d.load_target_embedding(torch.randn(V, H, dtype=torch.float64))
    ids = torch.sort(torch.randperm(V)[:N]).values
    d.d2t.copy_(ids - torch.arange(N))
    d.t2d.zero_()
    d.t2d[ids] = True
    return d, ids


class _DenseStepAttend:
    """Per-step dense attention over all keys so far with an explicit (T, (i+1)T) mask."""

    def __init__(self):
        self.ks, self.vs = [], []

    def __call__(self, q, k, v):
        self.ks.append(k)
        self.vs.append(v)
        i, T = len(self.ks) - 1, q.shape[2]
        rep = q.shape[1] // k.shape[1]
        K_ = torch.cat(self.ks, 2).repeat_interleave(rep, 1)
        V_ = torch.cat(self.vs, 2).repeat_interleave(rep, 1)
        allowed = torch.zeros(T, (i + 1) * T, dtype=torch.bool)
        for t in range(T):
            allowed[t, : t + 1] = True
            for j in range(1, i + 1):
                allowed[t, j * T + t] = True
        s = (q @ K_.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ V_


def naive_loss(d, aux, x, last, mask, lm_head, K, align_topk=0):
    """Position by position: the issue's definition written as loops. `align_topk`: a slot
    counts at step i only if the data's token x[t+2+j] was in the top-k at every step j < i;
    each step's sum is still divided by all its loss positions."""
    h = d.fuse(aux)
    att = _DenseStepAttend()
    B, T = x.shape
    total = 0.0
    outs = []
    for i in range(K):
        ids = torch.zeros_like(x)
        ids[:, : T - 1 - i] = x[:, 1 + i:]
        pos = torch.arange(T).expand(B, T) + i
        out = d.layer(h, ids, pos, att)
        outs.append(d.logits(out))
        h = out
    tids = torch.arange(d.d2t.numel()) + d.d2t
    def supervised(b, t, i):
        return t + 2 + i < T and mask[b, t + 2 + i] == 1

    def reachable(b, t, i):
        return all(supervised(b, t, j) and int(x[b, t + 2 + j]) in tids[outs[j][b, t].topk(align_topk).indices].tolist()
                   for j in range(i))

    for i in range(K):
        ces, n = [], 0
        for b in range(B):
            for t in range(T):
                p = t + 1 + i
                if not supervised(b, t, i):
                    continue
                full = last[b, p] @ lm_head.T
                if not bool(d.t2d[full.argmax()]):
                    continue
                n += 1
                if align_topk and not reachable(b, t, i):
                    continue
                tgt = torch.softmax(full[tids], -1)
                ces.append(-(tgt * torch.log_softmax(outs[i][b, t], -1)).sum())
        if ces:
            total = total + 0.8 ** i * torch.stack(ces).sum() / n
    return total


def _batch(V=32, H=16, B=2, T=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, 3 * H, generator=g, dtype=torch.float64)
    x = torch.randint(0, V, (B, T), generator=g)
    last = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    lm = torch.randn(V, H, generator=g, dtype=torch.float64)
    return aux, x, last, mask, lm


@pytest.mark.parametrize("prompt", [0, 6])  # 6: a prompt and trailing padding that no step computes
def test_loss_matches_naive_reference_and_grads(prompt):
    d, ids = tiny_drafter()
    aux, x, last, mask, lm = _batch(T=9 + prompt)
    mask[:, :prompt] = 0
    mask[1, 9 + prompt - prompt // 2:] = 0
    K = 3
    tab = ttt.target_table(last, mask, lm, ids, d.t2d, chunk=5)
    if prompt:
        need = ttt.needed_positions(tab, K)
        assert not need[0][:, : prompt - 2 - K].any() and not need[0][1, -prompt // 2 - 2:].any()
        assert need[1].sum() < need[0].sum()
    loss, stats = ttt.ttt_forward(d, aux, x, tab, K)
    ref = naive_loss(d, aux, x, last, mask, lm, K)
    fp32 = dict(rtol=1e-5, atol=1e-6)  # the drafter runs in fp64 here, the loss in fp32 (DESIGN 6)
    torch.testing.assert_close(loss, ref.to(loss.dtype), **fp32)
    params = [p for p in d.parameters() if p.requires_grad]
    g1 = torch.autograd.grad(loss, params)
    g2 = torch.autograd.grad(ref, params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b.to(a.dtype), **fp32)
    assert stats.valid.tolist()[0] >= stats.valid.tolist()[-1]


def test_steps_left_with_no_position_run_empty():
    """One supervised token at index 2: step 0 computes index 0 only and steps 1-2 nothing, yet
    every module still runs (under FSDP each forward gathers its weights on every rank)."""
    d, ids = tiny_drafter()
    aux, x, last, mask, lm = _batch(B=1)
    mask[:] = 0
    mask[0, 2] = 1
    tab = ttt.target_table(last, mask, lm, ids, d.t2d)
    assert [int(n.sum()) for n in ttt.needed_positions(tab, 3)] == [1, 0, 0]
    loss, stats = ttt.ttt_forward(d, aux, x, tab, 3)
    torch.testing.assert_close(loss, naive_loss(d, aux, x, last, mask, lm, 3).to(loss.dtype), rtol=1e-5, atol=1e-6)
    assert stats.valid.tolist() == [1, 0, 0]
    loss.backward()


@pytest.mark.parametrize("k", [2, 10])  # 10 of 20 draft tokens: steps 1-3 keep 6, 4, 3 of 10, 8, 6 slots
def test_align_topk_matches_naive_reference(k):
    d, ids = tiny_drafter()
    aux, _, last, mask, lm = _batch(T=12)
    mask[:] = 1
    x = ids[torch.randint(0, ids.numel(), (2, 12), generator=torch.Generator().manual_seed(2))]  # draftable data
    K = 4
    tab = ttt.target_table(last, mask, lm, ids, d.t2d, chunk=5)
    loss, stats = ttt.ttt_forward(d, aux, x, tab, K, align_topk=k)
    ref = naive_loss(d, aux, x, last, mask, lm, K, align_topk=k)
    torch.testing.assert_close(loss, ref.to(loss.dtype))
    full, full_stats = ttt.ttt_forward(d, aux, x, tab, K)
    assert stats.loss_n[0] == full_stats.loss_n[0] and stats.loss_n[-1] < full_stats.loss_n[-1]  # later steps masked
    assert torch.equal(stats.correct, full_stats.correct)  # metrics unchanged


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [3, 256])
def test_head_soft_cross_entropy_equals_log_softmax_form(dtype, chunk):
    """The chunked head + loss (lse * sum p - p.z, gradient kept from forward, input gradient in
    row chunks) against the plain `-(p[rows] * log_softmax((x @ w.T).float())).sum(-1)`: values,
    gradients of x and w, argmax and top-k, with rows gathered out of order, repeated, a tie at
    the maximum and a row of zero weight."""
    g = torch.Generator().manual_seed(3)
    M, N, H = 10, 12, 6
    probs = torch.softmax(torch.randn(7, N, generator=g) * 2, -1)
    rows = torch.tensor([6, 0, 3, 3, 1, 5, 2, 4, 0, 6])
    x0 = torch.randn(M, H, generator=g).to(dtype)
    w0 = torch.randn(N, H, generator=g).to(dtype)
    w0[7] = w0[2]  # a tie at row 4's maximum: the first index wins, as argmax
    x0[4] = w0[2] * 2
    wt = torch.rand(M, generator=g)
    wt[5] = 0
    xa, wa = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ce, top, best = ttt.head_soft_cross_entropy(xa, wa, probs, rows, chunk=chunk, topk=3)
    (ce * wt).sum().backward()
    xb, wb = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    z = (xb @ wb.T).float()
    ref = -(probs[rows] * torch.log_softmax(z, -1)).sum(-1)
    (ref * wt).sum().backward()
    assert ce.dtype == torch.float32 and xa.grad.dtype == wa.grad.dtype == dtype
    # the loss runs in fp32 whatever the inputs' dtype, so float64 agrees to fp32 precision
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1.3e-6, "atol": 1e-5}
    torch.testing.assert_close(ce, ref, **tol)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    torch.testing.assert_close(wa.grad, wb.grad, **tol)
    assert torch.equal(top, z.argmax(-1)) and top[4] == 2
    assert torch.equal(best, z.topk(3, -1).indices)
    with torch.no_grad():  # evaluation: no gradient factor kept
        ce2, top2, _ = ttt.head_soft_cross_entropy(x0, w0, probs, rows, chunk=chunk)
    assert torch.equal(ce2, ce.detach()) and torch.equal(top2, top)
    empty, etop, _ = ttt.head_soft_cross_entropy(x0[:0], w0, probs, rows[:0], chunk=chunk)
    assert empty.shape == etop.shape == (0,)


def test_row_max_equals_max_with_first_index():
    """Block maxima give torch.max's values and first-index ties, across and within blocks."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 1024, generator=g)
    z[0, 5] = z[0, 900] = 9  # tie across blocks
    z[1, 300] = z[1, 301] = 9  # tie within a block
    z[2] = 0  # all equal
    z[3, 1023] = 9  # last column
    for x in (z, z.bfloat16(), z[:, :1000]):  # 1000 columns: not a whole number of blocks
        mx, at = ttt.row_max(x)
        ref = x.max(-1)
        assert torch.equal(mx, ref.values) and torch.equal(at, ref.indices)
    assert ttt.row_max(z)[1][:4].tolist() == [5, 300, 0, 1023]


def test_head_soft_cross_entropy_under_autocast():
    """Under bf16 autocast the head's product runs in bf16 (as F.linear would) and gradients
    come back in the inputs' fp32."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 8, generator=g, requires_grad=True)
    w = torch.randn(5, 8, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(9, 5, generator=g), -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, top, _ = ttt.head_soft_cross_entropy(x, w, probs, torch.arange(9))
        z = torch.nn.functional.linear(x, w)
    assert z.dtype == torch.bfloat16
    ref = -(probs * torch.log_softmax(z.float(), -1)).sum(-1)
    torch.testing.assert_close(ce, ref)
    assert torch.equal(top, z.float().argmax(-1))
    ce.sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32


def test_head_soft_cross_entropy_backward_runs_once():
    """fp32 backward scales the kept gradient in place: a second backward must fail, not reuse it."""
    x = torch.randn(4, 3, requires_grad=True)
    ce, _, _ = ttt.head_soft_cross_entropy(x, torch.randn(5, 3), torch.softmax(torch.randn(4, 5), -1), torch.arange(4))
    ce.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ce.sum().backward()


def test_trailing_padding_changes_nothing():
    """Training pads batch lengths up to a multiple of 64 (batching.shape_length): loss, step
    statistics and gradients must not depend on trailing padding (zeros, loss mask 0)."""
    d, ids = tiny_drafter()
    aux, x, last, mask, lm = _batch(T=9)
    mask[:, -1] = 1  # samples end on a supervised token (the end of the assistant turn)
    K = 3

    def run(pad: int):
        def p(t):
            return torch.cat([t, t.new_zeros((t.shape[0], pad) + t.shape[2:])], dim=1)
        tab = ttt.target_table(p(last), p(mask), lm, ids, d.t2d, chunk=5)
        loss, stats = ttt.ttt_forward(d, p(aux), p(x), tab, K)
        return loss, stats, torch.autograd.grad(loss, [q for q in d.parameters() if q.requires_grad])

    (l1, s1, g1), (l2, s2, g2) = run(0), run(55)
    torch.testing.assert_close(l1, l2)
    for f in ttt.StepStats.__dataclass_fields__:
        torch.testing.assert_close(getattr(s1, f), getattr(s2, f))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    assert batching.shape_length(1) == batching.shape_length(64) == 64 and batching.shape_length(65) == 128


def test_metrics_conditional_and_accept_length():
    s = ttt.StepStats(loss_sum=torch.tensor([1.0, 2.0]), loss_n=torch.tensor([2.0, 2.0]),
                      correct=torch.tensor([3.0, 1.0]), valid=torch.tensor([4.0, 4.0]),
                      chain_correct=torch.tensor([3.0, 1.0]), chain_n=torch.tensor([4.0, 2.0]))
    m = ttt.metrics(s)
    assert m["acc_0"] == 0.75 and m["acc_1"] == 0.25 and m["cacc_1"] == 0.5
    assert m["accept_len"] == pytest.approx(1 + 0.75 + 0.75 * 0.5)
    assert m["loss"] == pytest.approx(0.5 + 0.8 * 1.0)


@pytest.mark.parametrize("arch,extra", [("gemma2", {"final_logit_softcapping": 2.0}), ("cohere", {"logit_scale": 0.25}),
                                        ("granite", {"logits_scaling": 3.0})])
def test_target_distribution_is_the_targets_own(arch, extra):
    """Soft labels = softmax of the logits the target itself computes (transformers' forward as
    the reference), restricted to the draft vocabulary: soft-capping and logit scales included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas import targets

    cfg = AutoConfig.for_model(arch, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_id=1, **extra)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # logits large enough for the cap and scales to matter
        ids = torch.randint(0, 96, (1, 9))
        last = m.model(input_ids=ids).last_hidden_state
        ref = m(input_ids=ids).logits[0, :-1]
    tid = torch.arange(0, 96, 2)
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[tid] = True
    scale, cap = targets.logit_transform(cfg)
    tab = ttt.target_table(last, torch.ones(1, 9), m.lm_head.weight, tid, t2d, logit_scale=scale, softcap=cap)
    want = torch.softmax(ref[:, tid], -1)
    torch.testing.assert_close(tab.probs, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(tab.argmax, ref.argmax(-1))
    untransformed = ttt.target_table(last, torch.ones(1, 9), m.lm_head.weight, tid, t2d)
    assert (untransformed.probs - want).abs().max() > 1e-2  # the transform matters on this target
