"""Speculative decoding as pure tensor functions: drafting (chain and EAGLE-2 dynamic
trees), the tree attention mask, the acceptance rules (greedy and lossless sampling), and
KV-cache compaction. No model loading, no I/O; `eyas.runtime` wires models into these.

Indexing (batch size 1). The committed context is x[0..n-1] (in the target's KV cache) plus
one *pending* token x[n] (sampled, not yet seen by the target). A verification step feeds the
target a tree whose root is x[n] at position n and whose node at depth d sits at position n+d.

The drafter's KV cache holds one step-0 entry per committed index t: state from the target's
aux features at t and the embedding of x[t+1], position t (DESIGN 5, core/ttt.py). The entry
at n-1 predicts x[n+1], i.e. the depth-1 candidates. Expanding a depth-d node runs the drafter
at position n-1+d on (next_input(parent's output), embedding of the node's token); those
entries attend to the committed entries plus their own ancestors' entries, exactly the
training-time-test pattern, and are discarded after verification.

The drafter seen by this module is the small `DraftModel` protocol below, so stub drafters
(always right, always wrong) are a dozen lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

NEG = float("-inf")


class DraftModel(Protocol):
    """What drafting needs from a drafter. Logits are over the draft vocabulary;
    `target_ids[i]` is the target id of draft id i."""

    target_ids: torch.Tensor  # (N,) long
    vocab_size: int  # the target's vocabulary V (sampling builds q over it)

    def reset(self, capacity: int) -> None:
        """Start a new sequence with room for `capacity` entries."""

    def truncate(self, n: int) -> None:
        """Drop every cache entry at index >= n (the tree entries of the last step)."""

    def extend(self, feats: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append committed step-0 entries for indices start..start+T-1 from target features
        (T, F) and next tokens (T,); return (logits (N,), next-step state (S,)) of the last."""

    def step(self, states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             allow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run m tree entries (states (m, S), tokens (m,), positions (m,)) appended after the
        existing tree entries; `allow` (m, R+m) bool says which tree entries (earlier R and
        these m) each may attend to (committed entries are always visible).
        Return (logits (m, N), next-step states (m, S))."""


# ---------------------------------------------------------------- trees


@dataclass
class Tree:
    """A draft tree in verification order (parents before children). Node 0 is the root,
    the pending token. `parents[0] == -1`; `depth[i]` = distance from the root."""

    tokens: torch.Tensor  # (T,) long, target ids
    parents: torch.Tensor  # (T,) long
    depth: torch.Tensor  # (T,) long

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return bool((self.parents[1:] == torch.arange(len(self) - 1)).all())


def chain_tree(root: int, drafts: torch.Tensor) -> Tree:
    """The chain root -> drafts[0] -> drafts[1] ... as a tree."""
    T = drafts.shape[0] + 1
    tokens = torch.cat([torch.tensor([root], dtype=torch.long), drafts.long().cpu()])
    return Tree(tokens, torch.arange(-1, T - 1), torch.arange(T))


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """(T, T) bool: [i, j] true iff j is i or an ancestor of i. Parents precede children."""
    par = parents.tolist()
    rows: list[list[int]] = []
    for i, p in enumerate(par):  # T is a few dozen at most: plain Python beats T small tensor ops
        rows.append((rows[p] if p >= 0 else []) + [i])
    allow = torch.zeros(len(par), len(par), dtype=torch.bool)
    for i, r in enumerate(rows):
        allow[i, r] = True
    return allow


def tree_mask(tree: Tree, prefix: int, dtype: torch.dtype, device=None, window: int | None = None) -> torch.Tensor:
    """Additive 4D attention mask (1, 1, T, prefix+T) for verifying `tree` after a cache of
    `prefix` tokens: every node sees the whole prefix, itself and its ancestors. With a
    sliding `window` (transformers' convention: a query at position q sees keys at positions
    above q - window), a node at position prefix + depth sees only that part of the prefix."""
    T = len(tree)
    allow = torch.ones(T, prefix + T, dtype=torch.bool)
    if window is not None:
        q = prefix + tree.depth.cpu()  # (T,) node positions; cache index = position
        allow[:, :prefix] = torch.arange(prefix)[None, :] > (q[:, None] - window)
    allow[:, prefix:] = ancestor_matrix(tree.parents)
    mask = torch.zeros(T, prefix + T, dtype=dtype)
    mask.masked_fill_(~allow, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def draft_chain(model: DraftModel, root_logits: torch.Tensor, root_state: torch.Tensor, n: int, k: int,
                pick: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
                cutoff: float = 0.0) -> tuple[torch.Tensor, list]:
    """Up to k drafts in a chain. `pick(logits (N,)) -> (draft id, q or None)`: argmax for
    greedy, a sample plus its distribution for speculative sampling. With `cutoff` > 0 the
    chain stops before draft i when (product of the drafter's probabilities of drafts < i) x
    (its top probability at i) is below it (softmax at temperature 1; for greedy drafts, the
    path probability of draft i): such a draft is rarely accepted and costs a drafter step
    and a verified token. The rule is decided before draft i is drawn, so a sampled draft is
    still distributed as q and sampling stays lossless (a rule that looked at the drawn
    draft itself would not be). Returns target ids (<= k,) and the per-draft q (target
    vocabulary) or Nones."""
    ids, qs = [], []
    logits, state = root_logits, root_state
    allow = torch.ones(1, 1, dtype=torch.bool)
    path_p = 1.0
    for i in range(k):
        probs = torch.softmax(logits.float(), -1) if cutoff > 0 else None
        if probs is not None and path_p * float(probs.max()) < cutoff:
            break
        d, q = pick(logits)
        if probs is not None:
            path_p *= float(probs[d])
        ids.append(d)
        qs.append(q)
        if i == k - 1:
            break
        tok = model.target_ids[d].view(1)
        logits, state = model.step(state.view(1, -1), tok, torch.tensor([n + i], device=tok.device), allow)
        logits, state = logits[0], state[0]
        allow = torch.ones(1, i + 2, dtype=torch.bool)
    if not ids:
        return model.target_ids[:0], qs
    return model.target_ids[torch.stack(ids)], qs


def draft_tree(model: DraftModel, root_token: int, root_logits: torch.Tensor, root_state: torch.Tensor,
               n: int, topk: int, depth: int, budget: int, cutoff: float = 0.0) -> Tree:
    """EAGLE-2 dynamic tree (Li et al. 2024, sec. 4): expand the top-k children of each of the
    top-k frontier nodes per level (scored by cumulative draft log-probability), keep every
    expansion as a candidate, then re-rank all candidates and keep the best `budget - 1`
    (plus the root). A parent always scores at least its child, so the kept set is closed
    under ancestors (ties go to the shallower node). With `cutoff` > 0, candidates whose path
    probability is below it are dropped (the tree may be smaller than the budget) and no
    level is expanded once every frontier node is below it."""
    floor = math.log(cutoff) if cutoff > 0 else NEG
    dev = root_logits.device
    logp = torch.log_softmax(root_logits.float(), -1)
    score, ids = logp.topk(min(topk, logp.shape[-1]))  # (k,)
    front_tok, front_score = model.target_ids[ids], score  # the frontier's tokens and scores
    cand_tok = [front_tok]
    cand_score, cand_parent, cand_depth = [score], [torch.full_like(ids, -1)], [torch.ones_like(ids)]
    front = torch.arange(ids.shape[0], device=dev)  # candidate indices of the frontier
    front_state = root_state.expand(ids.shape[0], -1)
    front_rows = None  # (k, R) ancestor rows of the frontier in the drafter's tree region
    offset = ids.shape[0]
    R = 0
    for d in range(1, depth):
        if cutoff > 0 and float(front_score.max()) < floor:  # no host sync per level when off
            break
        m = front.shape[0]
        allow = torch.zeros(m, R + m, dtype=torch.bool, device=dev)
        if front_rows is not None:
            allow[:, :R] = front_rows
        allow[:, R:].fill_diagonal_(True)
        pos = torch.full((m,), n - 1 + d, dtype=torch.long, device=dev)
        logits, states = model.step(front_state, front_tok, pos, allow)
        logp = torch.log_softmax(logits.float(), -1)  # (m, N)
        s, i = logp.topk(min(topk, logp.shape[-1]), dim=-1)  # (m, k)
        s = (s + front_score[:, None]).reshape(-1)
        kk = i.shape[1]
        tok = model.target_ids[i.reshape(-1)]
        cand_tok.append(tok)
        cand_score.append(s)
        cand_parent.append(front.repeat_interleave(kk))
        cand_depth.append(torch.full((m * kk,), d + 1, dtype=torch.long, device=dev))
        front_score, best = s.topk(min(topk, m * kk))  # next frontier, local to this level
        parent = best // kk
        front_rows, front_state, front_tok = allow[parent], states[parent], tok[best]
        front = offset + best
        offset += m * kk
        R += m
    return _select(root_token, torch.cat(cand_tok), torch.cat(cand_score), torch.cat(cand_parent),
                   torch.cat(cand_depth), budget, floor)


def _select(root: int, tok, score, parent, depth, budget: int, floor: float = NEG) -> Tree:
    """Keep the best budget-1 candidates scoring at least `floor`, order them by (depth, score)
    and renumber parents. Candidates arrive in depth order, so stable sorts break score ties
    towards the shallower node (an ancestor always precedes its descendants)."""
    tok, score, parent, depth = tok.cpu(), score.cpu(), parent.cpu(), depth.cpu()
    n = min(budget - 1, int((score >= floor).sum()))
    best = torch.sort(score, descending=True, stable=True).indices[:n]
    keep = best[torch.sort(depth[best], stable=True).indices]  # by depth, then score
    new_index = torch.full((tok.shape[0] + 1,), -1, dtype=torch.long)  # last slot: the root (-1)
    new_index[-1] = 0
    new_index[keep] = torch.arange(1, n + 1)
    parents = new_index[parent[keep]]
    assert bool((parents >= 0).all()), "selected tree is not ancestor-closed"
    tokens = torch.cat([torch.tensor([root]), tok[keep]]).long()
    return Tree(tokens, torch.cat([torch.tensor([-1]), parents]), torch.cat([torch.tensor([0]), depth[keep]]).long())


def lookup_continuation(context: list[int], n_tokens: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup (Saxena 2023, as transformers' `prompt_lookup_num_tokens`): the up to
    `n_tokens` tokens that followed the latest earlier occurrence of the context's last n-gram,
    trying n = max_ngram down to 1; [] when the last token never occurred before."""
    last = len(context) - 1
    for n in range(min(max_ngram, last), 0, -1):
        tail = context[-n:]
        for end in range(last - 1, n - 2, -1):  # end: index of an earlier occurrence's last token
            if context[end] == tail[-1] and context[end - n + 1:end + 1] == tail:
                return context[end + 1:end + 1 + n_tokens]
    return []


def graft(tree: Tree, chain: list[int]) -> Tree:
    """`tree` with `chain` (tokens after the root) added as a path from the root: the part the
    tree already holds is shared, the rest hangs below the last shared node as new nodes after
    the existing ones (parents still precede children)."""
    kids, tokens = children_table(tree), tree.tokens.tolist()
    node, j = 0, 0
    while j < len(chain):
        nxt = next((c for c in kids[node] if tokens[c] == chain[j]), None)
        if nxt is None:
            break
        node, j = nxt, j + 1
    rest = chain[j:]
    if not rest:
        return tree
    T, r = len(tree), len(rest)
    parents = torch.cat([torch.tensor([node]), torch.arange(T, T + r - 1)])
    depth = int(tree.depth[node]) + 1 + torch.arange(r)
    return Tree(torch.cat([tree.tokens, torch.tensor(rest, dtype=torch.long)]),
                torch.cat([tree.parents, parents]), torch.cat([tree.depth, depth]))


# ---------------------------------------------------------------- acceptance


def children_table(tree: Tree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(tree))]
    for i in range(1, len(tree)):
        kids[int(tree.parents[i])].append(i)
    return kids


def accept_greedy(tree: Tree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification: from the root, follow the child whose token is the target's
    argmax at the current node; stop where none is. Returns (accepted path of node indices,
    starting with the root; the target's own next token after the path)."""
    # fp32: a faster argmax on a CPU than bf16's, same ids (docs/cpu-performance.md, "Measurements ...")
    best = target_logits.float().argmax(-1).tolist()  # (T,)
    tokens = tree.tokens.tolist()
    kids = children_table(tree)
    path = [0]
    while True:
        nxt = next((c for c in kids[path[-1]] if tokens[c] == best[path[-1]]), None)
        if nxt is None:
            return path, best[path[-1]]
        path.append(nxt)


def recursive_reject(p: torch.Tensor, cands: list[int], qs: list[torch.Tensor | None],
                     gen: torch.Generator | None) -> tuple[int | None, int | None]:
    """Multi-draft speculative sampling at one node (SpecInfer, Miao et al. 2024, alg. 2;
    Leviathan et al. 2023 for one draft). Candidate c_i was drawn from q_i; accept it with
    probability min(1, p(c_i) / q_i(c_i)); on rejection p <- norm(max(p - q_i, 0)) and try the
    next. A candidate chosen deterministically (top-k tree) has q_i = one-hot(c_i): accepted
    with probability p(c_i), and rejection just removes c_i from p. The token that comes out
    (accepted candidate, or a draw from the final residual) is distributed exactly as p.
    Returns (index of the accepted candidate, None) or (None, token drawn from the residual)."""
    p = p.float().clone()
    for i, (c, q) in enumerate(zip(cands, qs)):
        qc = 1.0 if q is None else float(q[c])
        u = float(torch.rand((), generator=gen))
        if qc > 0 and u * qc < float(p[c]):
            return i, None
        if q is None:
            p[c] = 0.0
        else:
            p = (p - q.float()).clamp_min_(0.0)
        total = p.sum()
        if total <= 0:  # p == q up to rounding: acceptance was certain; fall back to p's mode
            return i, None
        p /= total
    return None, int(torch.multinomial(p, 1, generator=gen))


def accept_sampling(tree: Tree, target_probs: torch.Tensor, qs: dict[int, torch.Tensor] | None,
                    gen: torch.Generator | None) -> tuple[list[int], int]:
    """Lossless verification of a tree (or chain) by recursive rejection sampling, node by node
    from the root. `target_probs` (T, V): the target's sampling distribution at each node.
    `qs[i]`: the distribution node i was sampled from (chain sampling); absent = deterministic."""
    kids = children_table(tree)
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        cands = kids[node]
        idx, tok = recursive_reject(target_probs[node], [tokens[c] for c in cands],
                                    [None if qs is None else qs.get(c) for c in cands], gen)
        if idx is None:
            return path, tok
        path.append(cands[idx])


# ---------------------------------------------------------------- distributions


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution decoding samples from: softmax(logits / T), restricted to the top-p
    nucleus (smallest set of most likely tokens with mass >= top_p) and renormalised."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    drop = cum - sorted_p >= top_p  # tokens entirely beyond the nucleus
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def draft_distribution(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab: int,
                       temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The drafter's distribution over the target vocabulary (zero outside the draft vocab)."""
    q = sampling_probs(draft_logits, temperature, top_p)
    return torch.zeros(vocab, dtype=q.dtype, device=q.device).index_add_(0, target_ids, q)


# ---------------------------------------------------------------- KV compaction


def rows_in_place(rows: torch.Tensor) -> bool:
    """True when the kept rows are 0..k-1 already (a chain's accepted path): nothing to move."""
    return bool((rows == torch.arange(rows.numel(), device=rows.device)).all())


def compact_rows(buf: torch.Tensor, start: int, rows: torch.Tensor, in_place: bool | None = None) -> None:
    """Move rows start+rows[j] to start+j along dim -2 (the accepted path after `start`).
    `in_place`: `rows_in_place(rows)` when the caller already knows it (one test per step, not per layer)."""
    if in_place is None:
        in_place = rows_in_place(rows)
    if rows.numel() and not in_place:
        src = buf.index_select(-2, rows.to(buf.device) + start)
        buf[..., start:start + rows.numel(), :] = src


def accept_length(cond: list[float], depth: int | None = None) -> float:
    """Expected tokens per verification of a chain of drafts, bonus token included:
    1 + sum_k prod_{i<=k} cond_i, with cond_i the conditional acceptance of draft i given drafts
    < i accepted (so the product is the share of steps whose first k+1 drafts are all accepted).
    `depth` keeps the first `depth` drafts (a shorter chain)."""
    al, prod = 1.0, 1.0
    for c in cond[:depth]:
        prod *= c
        al += prod
    return al
