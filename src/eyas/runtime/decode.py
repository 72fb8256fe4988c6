"""The decode loop: plain, chain and tree decoding as short functions over the runners, on top of
the pure acceptance rules in `core.speculative`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.core import speculative as spec
from eyas.errors import EyasError
from eyas.runtime.runners import DrafterRunner, TargetRunner, Timer

METHODS = ("plain", "chain", "tree")


@dataclass
class DecodeSettings:
    method: str = "chain"
    k: int = 5
    tree: tuple[int, int, int] = (8, 5, 32)  # topk, depth, total tokens (root included)
    cutoff: float = 0.0  # drop drafts whose drafter path probability is below this (0: never)
    lookup: int = 0  # add up to this many prompt-lookup tokens to each draft as one more branch (0: off)
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    eos_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass
class DecodeResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verification step
    # per step, the drafter's own first draft (target id; -1 when the cutoff proposed none), before
    # any prompt-lookup branch: what `eyas bench` compares with the teacher-forced guess
    first_drafts: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    target_s: float = 0.0
    drafter_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.accepted)


def _finish(tokens: list[int], s: DecodeSettings) -> list[int]:
    out = tokens[: s.max_new_tokens]
    for i, t in enumerate(out):
        if t in s.eos_ids:
            return out[: i + 1]
    return out


def _done(tokens: list[int], s: DecodeSettings) -> bool:
    most = max(s.k, s.tree[2]) + s.lookup + 1  # the most tokens one verification step adds
    return len(tokens) >= s.max_new_tokens or any(t in s.eos_ids for t in tokens[-most:])


def _pick_target(logits: torch.Tensor, s: DecodeSettings, gen) -> int:
    if s.temperature <= 0:
        # fp32: a faster argmax on a CPU than bf16's, same ids (docs/cpu-performance.md, "Measurements ...")
        return int(logits.float().argmax())
    return int(torch.multinomial(spec.sampling_probs(logits.cpu(), s.temperature, s.top_p), 1, generator=gen))


@torch.inference_mode()
def generate_plain(tr: TargetRunner, prompt: torch.Tensor, s: DecodeSettings) -> DecodeResult:
    """The target alone, one token per forward, KV cache: the baseline every method is timed against."""
    gen = torch.Generator().manual_seed(s.seed)
    tr.timer.reset()
    t0 = time.perf_counter()
    n = prompt.shape[0]
    tr.reset(n + s.max_new_tokens + 1)
    logits, _ = tr.forward(prompt, torch.arange(n), features=False)
    out = [_pick_target(logits[-1], s, gen)]
    pos = torch.empty(1, dtype=torch.long)
    tok = torch.empty(1, dtype=torch.long)
    while not _done(out, s):
        tok[0], pos[0] = out[-1], n + len(out) - 1
        logits, _ = tr.forward(tok, pos, features=False)
        out.append(_pick_target(logits[-1], s, gen))
    return DecodeResult(_finish(out, s), wall_s=time.perf_counter() - t0, **_split(tr.timer))


def _split(timer: Timer) -> dict:
    return {"target_s": timer.seconds["target"], "drafter_s": timer.seconds["drafter"]}


@torch.inference_mode()
def generate_speculative(tr: TargetRunner, dr, prompt: torch.Tensor, s: DecodeSettings) -> DecodeResult:
    """Speculative decoding with `dr` (any `DraftModel`): prefill, then draft / verify /
    accept / compact until max_new_tokens or EOS."""
    gen = torch.Generator().manual_seed(s.seed)
    tr.timer.reset()
    t0 = time.perf_counter()
    n = prompt.shape[0]
    budget = (s.k + 1 if s.method == "chain" else s.tree[2]) + s.lookup  # tokens the target verifies per step
    # the drafter caches every expanded frontier node, not just the kept ones: topk per level
    drafted = budget if s.method == "chain" else 1 + s.tree[0] * s.tree[1]
    tr.reset(n + s.max_new_tokens + budget + 2)
    dr.reset(n + s.max_new_tokens + drafted + 2)
    logits, feats = tr.forward(prompt, torch.arange(n))
    x = _pick_target(logits[-1], s, gen)
    out, accepted, firsts = [x], [], []
    context = prompt.tolist() + out  # what prompt lookup searches
    root_logits, root_state = dr.extend(feats, torch.cat([prompt[1:], torch.tensor([x])]), 0)
    while not _done(out, s):
        tree, qs = _draft(dr, x, root_logits, root_state, n, s, gen)
        firsts.append(int(tree.tokens[1]) if tree.tokens.shape[0] > 1 else -1)
        if s.lookup:  # a deterministic branch: greedy and recursive rejection both take it as is
            tree = spec.graft(tree, spec.lookup_continuation(context, s.lookup))
        mask = None if tree.is_chain else tr.tree_mask(tree, n)
        logits, feats = tr.forward(tree.tokens, n + tree.depth, mask)
        if s.temperature <= 0:
            path, x = spec.accept_greedy(tree, logits)
        else:
            probs = spec.sampling_probs(logits.cpu(), s.temperature, s.top_p)
            path, x = spec.accept_sampling(tree, probs, qs, gen)
        rows = torch.tensor(path)
        tr.compact(n, rows)
        new = tree.tokens[rows[1:]].tolist() + [x]
        out += new
        context += new
        accepted.append(len(path) - 1)
        dr.truncate(n)
        if not _done(out, s):
            root_logits, root_state = dr.extend(feats[rows.to(feats.device)], torch.tensor(new), n)
        n += len(path)
    return DecodeResult(_finish(out, s), accepted, firsts, wall_s=time.perf_counter() - t0, **_split(tr.timer))


@torch.inference_mode()
def teacher_forced(tr: TargetRunner, dr: DrafterRunner, seq: torch.Tensor, topk: int = 1) -> torch.Tensor:
    """The drafter's first-step guesses over a finished sequence with the target's own features,
    as training scores them: row i (features of token i, token i+1) guesses seq[i+2].
    -> (N-2, topk) target ids, best first. The first draft of a verification step that starts
    with n tokens in the cache is row n-1, so served and teacher-forced guesses line up."""
    n = seq.shape[0] - 2
    tr.reset(n)
    _, feats = tr.forward(seq[:n], torch.arange(n))
    dr.reset(n)
    logits, _ = dr.extend(feats, seq[1:n + 1], 0, every=True)
    return dr.target_ids[logits.float().topk(topk, dim=-1).indices].cpu()


def _draft(dr, root: int, root_logits, root_state, n: int, s: DecodeSettings, gen):
    """One drafting phase -> (tree, {node: q} for sampled chain drafts or None)."""
    if s.method == "tree":
        topk, depth, budget = s.tree
        return spec.draft_tree(dr, root, root_logits, root_state, n, topk, depth, budget, s.cutoff), None
    if s.temperature <= 0:
        drafts, _ = spec.draft_chain(dr, root_logits, root_state, n, s.k, lambda lg: (lg.float().argmax(), None),
                                     s.cutoff)
        return spec.chain_tree(root, drafts), None
    V = dr.vocab_size

    def pick(lg):
        qd = spec.sampling_probs(lg.cpu(), s.temperature, s.top_p)
        d = torch.multinomial(qd, 1, generator=gen)[0]
        q = torch.zeros(V).index_add_(0, dr.target_ids.cpu(), qd)
        return d.to(lg.device), q

    drafts, qs = spec.draft_chain(dr, root_logits, root_state, n, s.k, pick, s.cutoff)
    return spec.chain_tree(root, drafts), {i + 1: q for i, q in enumerate(qs)}


def generate(tr: TargetRunner, dr, prompt: torch.Tensor, s: DecodeSettings) -> DecodeResult:
    if s.method == "plain":
        return generate_plain(tr, prompt, s)
    if s.method not in METHODS:
        raise EyasError(f"unknown decoding method {s.method!r}; use one of {', '.join(METHODS)}")
    return generate_speculative(tr, dr, prompt, s)
