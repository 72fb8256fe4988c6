"""Training-time test (EAGLE-3, DESIGN 6) as pure tensor code: the TTT attention, the
per-step shifts, the target table, the loss and the acceptance metrics.

Indexing (one sequence of length T; `x` tokens, `a` aux features, `l` final-norm states):

    step 0:  state fc(a[t]), input token x[t+1], position id t
    step i:  state next_input(out of step i-1 at t), input token x[t+1+i], position id t+i
    target of step i at index t: softmax of the target's logits at position p = t+1+i
             (lm_head(l[p]), which predicts x[p+1]) restricted to the draft vocabulary;
    index t counts at step i iff p+1 <= T-1 and loss_mask[p+1] == 1 (= loss_mask[t+2+i]);
    for the loss it must also have its target argmax (full vocabulary) inside the draft vocabulary.

Attention at step i (query t): the step-0 keys at positions <= t (causal) plus, for each
step j = 1..i, only step j's key at position t (the drafter's own earlier guesses for the
same slot). `TTTAttention` computes exactly that with one softmax per query and memory
linear in the number of steps, instead of the dense (K*T)^2 mask SpecForge builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.core.drafter import Eagle3Drafter
from eyas.core.speculative import accept_length

STEP_WEIGHT = 0.8  # loss weight of step i is 0.8**i (EAGLE-3, SpecForge; speculators 0.9 defaults to 1.0)


# ---------------------------------------------------------------- attention


class TTTAttention:
    """Stateful `attend(q, k, v)` for `Eagle3Drafter.layer`: call it once per TTT step, in order.

    Keeps the per-step keys/values; step 0 is plain causal attention (SDPA), step i > 0
    concatenates the causal step-0 scores with i diagonal scores (q_t . k^j_t) and takes
    one softmax over both, GQA by grouping query heads (no repeated k/v copies).
    Set `rows` before a step i > 0 whose q/k/v hold only some positions, as (1, heads, M, hd):
    their flat indices into step 0's B*T (each step's positions within the earlier step's).
    """

    def __init__(self) -> None:
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []
        self.rows: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.ks:
            self.ks.append(k)
            self.vs.append(v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        rows = self.rows
        if rows is not None:  # the left-out positions get zero keys: only their own slot reads them
            B, _, T, _ = self.ks[0].shape
            q, k, v = (_spread(x, rows, B, T) for x in (q, k, v))
        self.ks.append(k)
        self.vs.append(v)
        o = _ttt_step(q, self.ks, self.vs)
        if rows is None:
            return o
        B, nh, T, hd = o.shape
        return o.transpose(1, 2).reshape(B * T, nh, hd)[rows].transpose(0, 1)[None]


def _spread(x: torch.Tensor, rows: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """(1, heads, M, hd) at flat positions `rows` -> (B, heads, T, hd), zeros elsewhere."""
    _, nh, _, hd = x.shape
    full = x.new_zeros(B * T, nh, hd).index_copy(0, rows, x[0].transpose(0, 1))
    return full.view(B, T, nh, hd).transpose(1, 2).contiguous()


def _ttt_step(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    B, nh, T, hd = q.shape
    nkv = ks[0].shape[1]
    qg = q.view(B, nkv, nh // nkv, T, hd)  # (B, nkv, g, T, hd)
    scale = 1.0 / math.sqrt(hd)
    s0 = torch.matmul(qg, ks[0].unsqueeze(2).transpose(-1, -2)) * scale  # (B, nkv, g, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    sd = torch.stack([(qg * kj.unsqueeze(2)).sum(-1) for kj in ks[1:]], dim=-1) * scale  # (B, nkv, g, T, i)
    p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
    o = torch.matmul(p[..., :T], vs[0].unsqueeze(2))  # (B, nkv, g, T, hd)
    for j, vj in enumerate(vs[1:]):
        o = o + p[..., T + j, None] * vj.unsqueeze(2)
    return o.reshape(B, nh, T, hd)


def dense_ttt_reference(qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The naive form (for tests): all K*T keys, one dense (K*T)^2 boolean mask."""
    K, (_, nh, T, hd), nkv = len(qs), qs[0].shape, ks[0].shape[1]
    rep = nh // nkv
    q = torch.cat(qs, dim=2)  # (B, nh, K*T, hd)
    k = torch.cat(ks, dim=2).repeat_interleave(rep, dim=1)
    v = torch.cat(vs, dim=2).repeat_interleave(rep, dim=1)
    step = torch.arange(K).repeat_interleave(T)  # step of each row/col
    pos = torch.arange(T).repeat(K)
    qi, kj = step[:, None], step[None, :]
    qt, ks_ = pos[:, None], pos[None, :]
    mask = ((kj == 0) & (ks_ <= qt)) | ((kj >= 1) & (kj <= qi) & (ks_ == qt))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return list(o.split(T, dim=2))


# ---------------------------------------------------------------- shifts


def shift_left(x: torch.Tensor, n: int, pad: int = 0) -> torch.Tensor:
    """x[:, t+n] at index t (B, T), `pad` past the end."""
    out = torch.full_like(x, pad)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def step_inputs(input_ids: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input tokens x[t+1+i] and position ids t+i of step i, both (B, T)."""
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device).expand(B, T) + i
    return shift_left(input_ids, 1 + i), pos


# ---------------------------------------------------------------- target table


@dataclass
class TargetTable:
    """The target's next-token distributions at supervised positions, computed once per batch.

    Rows are the positions p with loss_mask[p+1] == 1 (all that any step needs).
    """

    index: torch.Tensor  # (B, T) long: row of position p, -1 when p is not supervised
    probs: torch.Tensor  # (M, N) softmax over the draft vocabulary (target_ids)
    argmax: torch.Tensor  # (M,) full-vocabulary argmax (target id)
    in_vocab: torch.Tensor  # (M,) bool: argmax lies in the draft vocabulary

    def step_rows(self, i: int) -> torch.Tensor:
        """(B, T) row of the target of step i at index t (position t+1+i), -1 if none."""
        return shift_left(self.index, 1 + i, pad=-1)

    def rows_per_sample(self) -> list[int]:
        """Rows of each batch sample, in row order (rows are numbered sample by sample)."""
        return (self.index >= 0).sum(1).tolist()

    def step_counts(self, steps: int) -> torch.Tensor:
        """(K,) number of loss positions (supervised and target argmax in vocab) per step."""
        out = []
        for i in range(steps):
            r = self.step_rows(i)
            r = r[r >= 0]
            out.append(self.in_vocab[r].sum())
        return torch.stack(out).to(torch.float32)


# rows per chunk of target_table: on a CPU a (256, V) chunk of the full-vocabulary product stays
# small enough to be reused rather than faulted in afresh (a 49k vocabulary: 25 MB in bf16)
TABLE_CHUNK = {"cpu": 256, "other": 1024}


@dataclass(frozen=True)
class HeadRows:
    """The target head's rows as target_table splits them: the draft rows (N, H), in target_ids'
    order, and the other rows (V - N, H) with their ids (ascending; empty unless asked for)."""
    draft: torch.Tensor
    rest: torch.Tensor
    rest_ids: torch.Tensor


@torch.no_grad()
def head_rows(lm_head: torch.Tensor, target_ids: torch.Tensor, rest: bool = True) -> HeadRows:
    """Split `lm_head` (V, H) for target_table. A trainer builds it once: on a CPU gathering the
    41k other rows of SmolLM2's head per batch slowed epoch-0 training steps (docs/cpu-performance.md)."""
    target_ids = target_ids.to(lm_head.device)
    if not rest:
        empty = torch.zeros(0, dtype=torch.long, device=lm_head.device)
        return HeadRows(lm_head[target_ids], lm_head[empty], empty)
    others = torch.ones(lm_head.shape[0], dtype=torch.bool, device=lm_head.device)
    others[target_ids] = False
    rest_ids = others.nonzero().flatten()
    return HeadRows(lm_head[target_ids], lm_head.index_select(0, rest_ids), rest_ids)


def predicts_supervised(loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool mask (..., T): position t predicts a supervised token t+1 (a loss and its argmax read it)."""
    sup = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    sup[..., :-1] = loss_mask[..., 1:].bool()
    return sup


@torch.no_grad()
def target_table(last: torch.Tensor, loss_mask: torch.Tensor, lm_head: torch.Tensor, target_ids: torch.Tensor,
                 t2d: torch.Tensor, chunk: int | None = None, argmax: torch.Tensor | None = None,
                 logit_scale: float = 1.0, softcap: float | None = None, rows: HeadRows | None = None) -> TargetTable:
    """Build the TargetTable from the final-norm states `last` (B, T, H) and the target's
    `lm_head` (V, H). The draft distributions come from the N draft rows of lm_head only; the
    full-vocabulary argmax needs the other V - N rows too, `chunk` positions at a time (a 49k
    vocabulary at T=2048 never materialises (B*T, V)), unless the caller passes it: `argmax`
    (M,), known from an earlier epoch (it depends on the data alone), skips that product.
    `logit_scale` and `softcap` are the target's own logit transform (`targets.logit_transform`:
    logits * scale, then softcap * tanh(logits / softcap)), so the draft distribution is the one
    the target samples from; both are increasing, so the argmax never needs them. `rows`: the
    head split once by `head_rows` (in the states' dtype), else split here for this call.

    The argmax is the draft rows' argmax unless the best of the other rows reaches it (ties go
    to the lower target id, as a full-vocabulary argmax does): the other rows only need their
    maximum (`amax`, no index, no fp32 copy), and their index only where they win."""
    B, T, _ = last.shape
    sup = predicts_supervised(loss_mask.to(last.device))
    index = torch.full((B, T), -1, dtype=torch.long, device=last.device)
    M = int(sup.sum())
    index[sup] = torch.arange(M, device=last.device)
    states = last[sup]  # (M, H)
    target_ids = target_ids.to(last.device)
    if rows is None:
        rows = head_rows(lm_head.to(states.dtype), target_ids, rest=argmax is None)
    w_draft, w_rest, rest_ids = rows.draft, rows.rest, rows.rest_ids  # (N, H), (V - N, H), ascending ids
    if w_draft.shape[0] != target_ids.numel() or w_draft.dtype != states.dtype:
        raise ValueError(f"rows: {w_draft.shape[0]} draft rows in {w_draft.dtype}, the table needs "
                         f"{target_ids.numel()} in {states.dtype} (head_rows of this head and vocabulary)")
    if argmax is None and rest_ids.numel() + target_ids.numel() != lm_head.shape[0]:
        raise ValueError("rows hold the draft rows only: the full-vocabulary argmax needs head_rows(rest=True)")
    chunk = chunk or TABLE_CHUNK["cpu" if last.device.type == "cpu" else "other"]
    probs, found = [], []
    for a in range(0, M, chunk):
        s = states[a:a + chunk]
        logits = (s @ w_draft.T).float()
        if argmax is None:
            found.append(_full_argmax(s, logits, w_rest, target_ids, rest_ids))
        if logit_scale != 1.0:
            logits = logits * logit_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        probs.append(torch.softmax(logits, dim=-1))
    N = target_ids.numel()
    probs_t = torch.cat(probs) if probs else torch.zeros(0, N, device=last.device)
    if argmax is None:
        argmax = torch.cat(found) if found else torch.zeros(0, dtype=torch.long, device=last.device)
    elif argmax.shape != (M,):
        raise ValueError(f"argmax has shape {tuple(argmax.shape)}, the batch has {M} supervised positions")
    argmax = argmax.to(device=last.device, dtype=torch.long)
    return TargetTable(index, probs_t, argmax, t2d[argmax])


def _full_argmax(s: torch.Tensor, draft_logits: torch.Tensor, w_rest: torch.Tensor, target_ids: torch.Tensor,
                 rest_ids: torch.Tensor) -> torch.Tensor:
    """Target id of the largest of the draft logits (rows' products with the draft rows, fp32)
    and the products of `s` with the other rows `w_rest`; ties go to the lower target id."""
    best, at = row_max(draft_logits)
    top = target_ids[at]  # target_ids ascending: the first maximum is the lowest id
    if rest_ids.numel() == 0:
        return top
    rest = s @ w_rest.T  # (c, V - N), in the states' dtype: exact in fp32, so no copy for the max
    rows = (rest.amax(-1).float() >= best).nonzero().flatten()
    if rows.numel():
        value, where = rest[rows].float().max(-1)
        rid = rest_ids[where]
        tie = value == best[rows]
        top[rows] = torch.where(tie, torch.minimum(top[rows], rid), rid)
    return top


@torch.no_grad()
def vocab_argmax(states: torch.Tensor, weight: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Full-vocabulary argmax (M,) long of `states` (M, H) @ `weight` (V, H).T, `chunk` rows at a
    time (never (M, V) at once), in the states' dtype; ties go to the lower id. What capture
    stores so that training never needs the V - N rows of the head (`target_table(argmax=)`)."""
    found = [row_max(states[a:a + chunk] @ weight.T)[1] for a in range(0, states.shape[0], chunk)]
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.long, device=states.device)


def row_max(z: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`z.max(-1)` of a 2-d `z` (values, first index of each row's maximum) through block
    maxima: on a CPU `amax` is vectorised and max-with-index is not (docs/cpu-performance.md).
    The first block holding the maximum, then its first index: argmax's ties."""
    R, N = z.shape
    if N % block or N < 2 * block:
        return z.max(-1)
    zb = z.view(R, N // block, block)
    mx, at = zb.amax(-1).max(-1)
    inner = zb[torch.arange(R, device=z.device), at].argmax(-1)
    return mx, at * block + inner


# ---------------------------------------------------------------- unrolled loss + metrics


@dataclass
class StepStats:
    """Counts for metrics (per step, summed over positions; add them across batches)."""

    loss_sum: torch.Tensor  # (K,) sum of soft CE over loss positions (detached)
    loss_n: torch.Tensor  # (K,) loss positions
    correct: torch.Tensor  # (K,) top-1 agreements at supervised positions
    valid: torch.Tensor  # (K,) supervised positions
    chain_correct: torch.Tensor  # (K,) right at step i and all earlier steps
    chain_n: torch.Tensor  # (K,) supervised at steps 0..i and right at all earlier steps


class HeadSoftCrossEntropy(torch.autograd.Function):
    """The draft head's product and the soft cross-entropy against target rows, with the argmax
    (and optionally the top-k), computed row chunk by row chunk.

    `ce[m] = -sum_n probs[rows[m], n] * log_softmax(x[m] @ w.T)[n]`, written as
    `lse(z) * sum(p) - p . z`, with gradient `(softmax(z) * sum(p) - p) * g`: the same function as
    the log_softmax form (DESIGN 6), the product in the inputs' dtype (as `F.linear` under
    autocast), the loss in fp32 (as `.float()` was). On a CPU the loss's passes over the (M, N)
    logits are memory-bound and cost as much as the head's matmuls, so each chunk of `chunk`
    rows makes its few passes while in cache, gathers its target rows itself (no (M, N) copy of
    them), and keeps the gradient's (M, N) factor (fp32). Backward scales that factor and takes
    the input's gradient chunk by chunk too: on a CPU (oneDNN, bf16) one (M, N) x (N, H) product
    with M in the hundreds runs at half the speed of the same rows in chunks of 256.
    Returns (ce (M,) fp32, argmax (M,) long, top-k indices (M, topk) long).
    """

    @staticmethod
    def forward(ctx, x, w, probs, rows, chunk, topk):
        M, N = x.shape[0], w.shape[0]
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ce = torch.empty(M, dtype=torch.float32, device=x.device)
        top = torch.empty(M, dtype=torch.long, device=x.device)
        best = torch.empty(M, topk, dtype=torch.long, device=x.device)
        dz = torch.empty(M, N, dtype=torch.float32, device=x.device) if want_grad else None
        for a in range(0, M, chunk):
            b = min(M, a + chunk)
            z = (x[a:b] @ w.T).to(torch.float32)
            if topk:
                best[a:b] = z.topk(topk, dim=-1).indices
            p = probs.index_select(0, rows[a:b])
            psum, dot = p.sum(-1), torch.linalg.vecdot(p, z)
            mx, top[a:b] = row_max(z)
            sumexp = z.sub_(mx[:, None]).exp_().sum(-1)
            ce[a:b] = (mx + sumexp.log()) * psum - dot
            if want_grad:
                torch.sub(z.mul_((psum / sumexp)[:, None]), p, out=dz[a:b])
        ctx.save_for_backward(x, w, dz)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(top, best)
        return ce, top, best

    @staticmethod
    def backward(ctx, g, _, __):
        x, w, dz = ctx.saved_tensors
        # in place when fp32: no fresh (M, N) buffer to fault in (a second backward through a
        # retained graph then fails autograd's saved-tensor version check)
        d = dz if x.dtype == torch.float32 else torch.empty(dz.shape, dtype=x.dtype, device=dz.device)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        for a in range(0, dz.shape[0], ctx.chunk):
            b = min(dz.shape[0], a + ctx.chunk)
            torch.mul(dz[a:b], g[a:b, None], out=d[a:b])
            if dx is not None:
                torch.mm(d[a:b], w, out=dx[a:b])
        dw = d.T @ x if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


# rows per chunk of HeadSoftCrossEntropy: on a CPU 256 x 8192 fp32 = 8 MB stays in cache; on a GPU
# the cache argument does not apply and each chunk costs kernel launches, so chunks are large there
LOSS_CHUNK = {"cpu": 256, "other": 8192}


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `t` runs in here: autocast's when it is on, else `t`'s own."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def head_soft_cross_entropy(x: torch.Tensor, w: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
                            chunk: int | None = None, topk: int = 0) -> tuple[torch.Tensor, ...]:
    """Normed drafter states x (M, H) through the head `w` (N, H) vs target rows `probs[rows]`
    -> (soft CE (M,), argmax (M,), top-k (M, topk)). Under autocast both are cast to its dtype
    (pass `w` already cast to cast it once for several calls)."""
    if chunk is None:
        chunk = LOSS_CHUNK["cpu" if x.device.type == "cpu" else "other"]
    dt = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        return HeadSoftCrossEntropy.apply(x.to(dt), w.to(dt), probs, rows, chunk, topk)


def needed_positions(table: TargetTable, steps: int) -> list[torch.Tensor]:
    """(B, T) bool per step: index t is computed at step i iff step i or a later one has a target
    there. A step's state at t feeds only t's later steps (attention reads step 0's keys at
    other positions, and only t's own diagonal keys), so nothing else changes the loss:
    prompt and padding positions skip o_proj and the MLP at step 0 and every later step."""
    need, acc = [], torch.zeros_like(table.index, dtype=torch.bool)
    for i in reversed(range(steps)):
        acc = acc | (table.step_rows(i) >= 0)
        need.append(acc)
    return need[::-1]


def ttt_forward(drafter, aux: torch.Tensor, input_ids: torch.Tensor, table: TargetTable, steps: int,
                denom: torch.Tensor | None = None, align_topk: int = 0) -> tuple[torch.Tensor, StepStats]:
    """Unroll `steps` TTT steps of `drafter` and return (loss, stats).

    loss = sum_i 0.8**i * (sum of soft CE at step i) / denom[i]; `denom` defaults to the
    batch's own loss-position counts (pass global counts under data parallelism).
    With `align_topk` k > 0, index t counts for the loss at step i only if at every earlier
    step j the drafter's top-k held the data's next token x[t+2+j] (the token step j+1 is
    fed): a drafter never reaches a slot whose path it would not have proposed, so training
    it there is wasted (GRIFFIN's misalignment mask). `denom` still counts every position.
    Metrics are unaffected.
    """
    denom = table.step_counts(steps) if denom is None else denom
    B, T = input_ids.shape
    dev = input_ids.device
    need = needed_positions(table, steps)
    h = drafter.fuse(aux)  # (B, T, H)
    attend = TTTAttention()
    normed, rows, valids = [], [], []
    for i in range(steps):
        ids, pos = step_inputs(input_ids, i)
        flat = need[i].flatten()
        keep = flat.nonzero().flatten()  # (M,) ascending: the positions this step computes
        if i == 0:
            out = drafter.layer(h, ids, pos, attend, keep=keep)  # (M, H)
        else:
            attend.rows = keep
            h = h[flat[prev]]  # the earlier step's states (at `prev`, a superset of keep) still needed
            out = drafter.layer(h[None], ids.flatten()[keep][None], pos.flatten()[keep][None], attend)[0]
        prev = keep
        r = table.step_rows(i)
        valid = r >= 0  # (B, T), within need[i]
        on = valid.flatten()[keep]  # (M,): keep's positions with a target, in valid's order
        normed.append(drafter.norm(out[on]))
        rows.append(r[valid])
        valids.append(valid)
        h = drafter.next_input(out)
    # every step's states through the head in one call: one weight-gradient product over all
    # steps' rows, not one per step (larger products run nearer the CPU's GEMM peak:
    # docs/cpu-performance.md)
    head = drafter.lm_head.weight.to(compute_dtype(normed[0]))
    n_top = min(align_topk, head.shape[0])
    ce_all, top_all, topk_all = head_soft_cross_entropy(torch.cat(normed), head, table.probs, torch.cat(rows),
                                                        topk=n_top)
    sizes = [len(r) for r in rows]
    chain = torch.ones(B, T, dtype=torch.bool, device=dev)
    aligned = torch.ones(B, T, dtype=torch.bool, device=dev)  # reachable by top-k drafting
    loss = ce_all.new_zeros(())
    stats = {k: [] for k in StepStats.__dataclass_fields__}
    for i, (ce, top1, topk, r, valid) in enumerate(zip(ce_all.split(sizes), top_all.split(sizes),
                                                        topk_all.split(sizes), rows, valids)):
        iv = table.in_vocab[r] & aligned[valid] if align_topk > 0 else table.in_vocab[r]
        ce_sum = ce[iv].sum()
        if n_top > 0 and i + 1 < steps:
            top = drafter.draft_to_target(topk)
            hit = torch.zeros(B, T, dtype=torch.bool, device=dev)
            hit[valid] = (top == shift_left(input_ids, 2 + i)[valid][:, None]).any(-1)
            aligned = aligned & hit
        loss = loss + (STEP_WEIGHT ** i) * ce_sum / denom[i].clamp(min=1)
        right = torch.zeros(B, T, dtype=torch.bool, device=dev)
        right[valid] = drafter.draft_to_target(top1) == table.argmax[r]
        chain = chain & valid
        stats["loss_sum"].append(ce_sum.detach())
        stats["loss_n"].append(iv.sum())
        stats["correct"].append(right.sum())
        stats["valid"].append(valid.sum())
        stats["chain_n"].append(chain.sum())
        chain = chain & right
        stats["chain_correct"].append(chain.sum())
    return loss, StepStats(**{k: torch.stack(v).double() for k, v in stats.items()})


def add_stats(a: StepStats | None, b: StepStats) -> StepStats:
    if a is None:
        return b
    return StepStats(**{k: getattr(a, k) + getattr(b, k) for k in StepStats.__dataclass_fields__})


def metrics(stats: StepStats) -> dict:
    """acc_i, conditional acc_i (given steps < i right), per-step loss, and the simulated
    acceptance length 1 + sum_k prod_{i<=k} cacc_i (conditional accuracies, so the product
    is the share of positions whose first k+1 drafts are all right)."""
    K = stats.valid.numel()
    acc = (stats.correct / stats.valid.clamp(min=1)).tolist()
    cacc = (stats.chain_correct / stats.chain_n.clamp(min=1)).tolist()
    step_loss = (stats.loss_sum / stats.loss_n.clamp(min=1)).tolist()
    out = {"loss": sum(STEP_WEIGHT ** i * step_loss[i] for i in range(K)), "accept_len": accept_length(cacc)}
    out.update({f"acc_{i}": acc[i] for i in range(K)})
    out.update({f"cacc_{i}": cacc[i] for i in range(K)})
    out.update({f"loss_{i}": step_loss[i] for i in range(K)})
    out["positions"] = int(stats.valid[0])
    return out


@dataclass
class Target:
    """What training needs of the target besides features: its LM head and logit transform
    (for the target distributions) and fingerprint."""

    lm_head: torch.Tensor  # (V, H)
    fingerprint: str
    logit_scale: float = 1.0  # targets.logit_transform
    softcap: float | None = None


class TTTModule(nn.Module):
    """The drafter plus the TTT unroll as one forward, so DDP/FSDP see a normal module."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, autocast: torch.dtype | None, align_topk: int = 0):
        super().__init__()
        self.drafter, self.steps, self.autocast, self.align_topk = drafter, steps, autocast, align_topk

    def forward(self, aux, input_ids, table: TargetTable, denom: torch.Tensor, scale: float = 1.0):
        with torch.autocast(aux.device.type, dtype=self.autocast or torch.float32,
                            enabled=self.autocast is not None):
            loss, stats = ttt_forward(self.drafter, aux, input_ids, table, self.steps, denom, self.align_topk)
        return loss * scale, stats
