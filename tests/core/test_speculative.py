"""Speculative decoding: tree masks, KV compaction, acceptance rules, greedy token identity
with HF generate() (stub and real drafters, chain and tree), lossless sampling (chi-square),
and the engine emulation's fc-bypass collapse."""

from __future__ import annotations

import copy

import pytest
import torch

from eyas import runtime, targets
from eyas.cpu import prepack
from eyas.core import speculative as spec
from eyas.core.drafter import DrafterConfig, Eagle3Drafter


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- stub drafters


class StubDrafter:
    """A `DraftModel` that proposes ref[p+2] at drafter position p (right) or a wrong token."""

    def __init__(self, ref: list[int], vocab: int, mode: str = "right", seed: int = 0):
        self.ref, self.V, self.mode = ref, vocab, mode
        self.target_ids = torch.arange(vocab)
        self.vocab_size = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def reset(self, capacity: int) -> None:
        pass

    def truncate(self, n: int) -> None:
        pass

    def _logits(self, positions: torch.Tensor) -> torch.Tensor:
        if self.mode == "random":
            return torch.randn(positions.shape[0], self.V, generator=self.gen) * 3
        out = torch.randn(positions.shape[0], self.V, generator=self.gen)
        for r, p in enumerate(positions.tolist()):
            want = self.ref[p + 2] if p + 2 < len(self.ref) else 0
            tok = want if self.mode == "right" else (want + 1) % self.V
            out[r, tok] = 50.0
        return out

    def extend(self, feats, tokens, start):
        return self._logits(torch.tensor([start + tokens.shape[0] - 1]))[0], torch.zeros(1)

    def step(self, states, tokens, positions, allow):
        return self._logits(positions), torch.zeros(positions.shape[0], 1)



@pytest.fixture(scope="module")
def tiny(tiny_target):
    model, tok = targets.load(tiny_target)
    return model, tok


def _hf_greedy(model, prompt: torch.Tensor, n: int, eos: int) -> list[int]:
    out = model.generate(prompt[None], max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, prompt.shape[0]:].tolist()


def _prompt(seed: int, n: int = 12, V: int = 200) -> torch.Tensor:
    return torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(seed))


def _settings(method, **kw) -> runtime.DecodeSettings:
    base = dict(method=method, k=4, tree=(3, 4, 12), max_new_tokens=40, eos_ids=(2,))
    base.update(kw)
    return runtime.DecodeSettings(**base)


# ---------------------------------------------------------------- pure pieces


def test_tree_mask_ancestors_and_prefix():
    tree = spec.Tree(torch.tensor([5, 7, 9, 11, 13]), torch.tensor([-1, 0, 0, 1, 3]), torch.tensor([0, 1, 1, 2, 3]))
    m = spec.tree_mask(tree, prefix=3, dtype=torch.float32)
    assert m.shape == (1, 1, 5, 8)
    allow = m[0, 0] == 0
    assert allow[:, :3].all()
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]).bool()
    assert torch.equal(allow[:, 3:], expect)
    assert not tree.is_chain and spec.chain_tree(1, torch.tensor([2, 3])).is_chain


def test_compact_rows_gathers_path_in_order():
    buf = torch.arange(10.0).view(1, 1, 10, 1).repeat(1, 2, 1, 3)
    spec.compact_rows(buf, 4, torch.tensor([0, 2, 5]))
    assert buf[0, 0, 4:7, 0].tolist() == [4.0, 6.0, 9.0]
    assert buf[0, 1, :4, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_kv_pool_compacts_every_layer_and_refuses_misfits():
    pool = runtime.KVPool(2, 10)
    layers = [runtime.PreallocLayer(10, pool, i) for i in range(2)]
    for i, layer in enumerate(layers):
        k = torch.arange(10.0).view(1, 1, 10, 1).repeat(1, 2, 1, 3) + 100 * i
        layer.update(k, -k)
    odd = runtime.PreallocLayer(10, pool, 1)
    odd.update(torch.zeros(1, 2, 10, 3), torch.zeros(1, 2, 10, 5))  # values of another width: own buffers
    assert [la.pooled for la in layers] == [True, True] and not odd.pooled
    rows = torch.tensor([0, 2, 5])
    pool.compact(4, rows, spec.rows_in_place(rows))
    for i, layer in enumerate(layers):
        layer.compact(4, rows)
        assert layer.keys[0, 1, :, 0].tolist() == [100 * i + x for x in (0, 1, 2, 3, 4, 6, 9)]
        assert layer.values[0, 0, :, 2].tolist() == [-100 * i - x for x in (0, 1, 2, 3, 4, 6, 9)]


def test_target_tree_verify_and_compaction_match_sequential(tiny):
    """A tree forward with the 4D mask gives each node the logits of its own path, and after
    compacting the cache to one path the next forward equals a fresh forward of that path."""
    model, _ = tiny
    timer = runtime.Timer("cpu")
    tr = runtime.TargetRunner(model, [1, 2], timer)
    prompt = _prompt(1)
    n = prompt.shape[0]
    tr.reset(64)
    tr.forward(prompt, torch.arange(n))
    tree = spec.Tree(torch.tensor([5, 7, 9, 11, 13]), torch.tensor([-1, 0, 0, 2, 3]), torch.tensor([0, 1, 1, 2, 3]))
    logits, feats = tr.forward(tree.tokens, n + tree.depth, spec.tree_mask(tree, n, torch.float32))
    path = [0, 2, 3]
    seq = torch.cat([prompt, tree.tokens[path]])
    ref = model(seq[None]).logits[0, n:]
    assert torch.allclose(logits[path], ref, atol=1e-4)
    with targets.capture_aux(model, [1, 2]) as cap:
        model(seq[None])
    assert torch.allclose(feats[path], cap.aux()[0, n:], atol=1e-4)
    assert all(layer.pooled for layer in tr.cache.layers)  # one buffer: compaction moves every layer at once
    tr.compact(n, torch.tensor(path))
    assert tr.length == n + 3
    nxt, _ = tr.forward(torch.tensor([13]), torch.tensor([n + 3]))
    ref2 = model(torch.cat([seq, torch.tensor([13])])[None]).logits[0, -1]
    assert torch.allclose(nxt[0], ref2, atol=1e-4)


def test_accept_greedy_walks_matching_children():
    tree = spec.Tree(torch.tensor([0, 4, 5, 6, 7]), torch.tensor([-1, 0, 0, 2, 2]), torch.tensor([0, 1, 1, 2, 2]))
    logits = torch.zeros(5, 10)
    logits[0, 5] = logits[2, 7] = logits[4, 9] = 1.0
    assert spec.accept_greedy(tree, logits) == ([0, 2, 4], 9)


def _lookup_reference(ctx: list[int], n_tokens: int) -> list[int]:
    """Prompt lookup by start index: the latest i < len - n with ctx[i:i+n] == the last n tokens."""
    for n in (3, 2, 1):
        starts = [i for i in range(len(ctx) - n) if len(ctx) > n and ctx[i:i + n] == ctx[-n:]]
        if starts:
            return ctx[max(starts) + n:max(starts) + n + n_tokens]
    return []


def test_lookup_continuation_matches_a_search_by_start_index():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        ctx = torch.randint(0, 3 + trial % 6, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        assert spec.lookup_continuation(ctx, 4) == _lookup_reference(ctx, 4), ctx
    assert spec.lookup_continuation([5, 1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3) == [9, 2, 3]  # the 3-gram wins
    assert spec.lookup_continuation([4, 5, 6], 3) == []


def test_graft_shares_the_held_prefix_and_hangs_the_rest_below_it():
    tree = spec.Tree(torch.tensor([0, 4, 5, 6]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))
    g = spec.graft(tree, [4, 6, 8, 9])  # 4 -> 6 held; 8, 9 new below node 3
    assert g.tokens.tolist() == [0, 4, 5, 6, 8, 9]
    assert g.parents.tolist() == [-1, 0, 0, 1, 3, 4] and g.depth.tolist() == [0, 1, 1, 2, 3, 4]
    assert spec.graft(tree, [5]) is tree and spec.graft(tree, []) is tree
    g = spec.graft(tree, [7, 4])  # nothing shared: a new branch from the root
    assert g.parents.tolist()[4:] == [0, 4] and g.depth.tolist()[4:] == [1, 2]
    chain = spec.graft(spec.chain_tree(0, torch.tensor([4, 5])), [4, 5, 6])
    assert chain.is_chain and chain.tokens.tolist() == [0, 4, 5, 6]
    allow = spec.ancestor_matrix(g.parents)
    assert allow[5].tolist() == [True, False, False, False, True, True]


# ---------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("mode", ["right", "wrong", "random"])
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_greedy_identity_with_stubs(tiny, mode, method):
    model, tok = tiny
    V = model.config.vocab_size
    for seed in (0, 1):
        prompt = _prompt(seed)
        ref = _hf_greedy(model, prompt, 40, eos=2)
        stub = StubDrafter(prompt.tolist() + ref, V, mode, seed)
        tr, _ = runtime.runners(model, None, runtime.Timer("cpu"))
        res = runtime.generate(tr, stub, prompt, _settings(method))
        assert res.tokens == ref
        assert runtime.generate(tr, None, prompt, _settings("plain")).tokens == ref
        full = 4 if method == "chain" else 3  # chain k=4; tree depth 4 -> 3 accepted + ... see below
        if mode == "right" and len(ref) == 40:
            assert max(res.accepted) >= full
            assert sum(res.accepted) + res.steps >= len(ref)
        if mode == "wrong":
            assert set(res.accepted) == {0}


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_greedy_identity_with_a_lookup_branch(tiny, method):
    """A drafter that is always wrong plus a prompt-lookup branch: the output is the target's
    greedy one, and every accepted token came from the lookup branch (this random target
    repeats itself, so lookup finds some)."""
    model, _ = tiny
    V = model.config.vocab_size
    hits = 0
    for seed in (0, 1, 2):
        prompt = _prompt(seed)
        ref = _hf_greedy(model, prompt, 40, eos=2)
        stub = StubDrafter(prompt.tolist() + ref, V, "wrong", seed)
        tr, _ = runtime.runners(model, None, runtime.Timer("cpu"))
        res = runtime.generate(tr, stub, prompt, _settings(method, lookup=5))
        assert res.tokens == ref
        hits += sum(res.accepted)
    assert hits > 0


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_tree_greedy_identity_past_a_sliding_window(tiny_tokenizer, kind):
    """A prompt longer than the target's sliding window: tree verification passes an explicit
    mask, which must carry the window (Mistral: every layer; Gemma 2: its sliding layers only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": 16, "final_logit_softcapping": None, "attn_logit_softcapping": None} if kind == "gemma2" else {}
    cfg = AutoConfig.for_model(kind, vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, sliding_window=8, tie_word_embeddings=False,
                               bos_token_id=1, eos_token_id=2, pad_token_id=2, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    V = model.config.vocab_size
    for seed in (0, 1):
        prompt = _prompt(seed, n=30)
        ref = _hf_greedy(model, prompt, 30, eos=2)
        for mode in ("right", "random"):
            tr, _ = runtime.runners(model, None, runtime.Timer("cpu"))
            res = runtime.generate(tr, StubDrafter(prompt.tolist() + ref, V, mode, seed), prompt,
                                   _settings("tree", max_new_tokens=30))
            assert res.tokens == ref, (kind, seed, mode)


class ConfidentStub:
    """A `DraftModel` whose top draft always has probability 0.6 (token = position + 3)."""

    def __init__(self, V: int = 32):
        self.target_ids, self.vocab_size, self.steps = torch.arange(V), V, 0

    def logits(self, positions: torch.Tensor) -> torch.Tensor:
        p = torch.full((positions.shape[0], self.vocab_size), 0.4 / (self.vocab_size - 1))
        p[torch.arange(positions.shape[0]), (positions + 3) % self.vocab_size] = 0.6
        return p.log()

    def step(self, states, tokens, positions, allow):
        self.steps += 1
        return self.logits(positions), torch.zeros(positions.shape[0], 1)


def test_draft_cutoff_stops_chains_and_prunes_trees():
    """Path probabilities 0.6, 0.36, 0.216, 0.13: a cutoff of 0.2 keeps three chain drafts (the
    drafter ran three times: the third found the fourth draft below it); 0.7 keeps none. A tree
    keeps only nodes whose path probability clears the cutoff, and stops expanding once no
    frontier node does."""
    greedy = lambda lg: (lg.argmax(), None)  # noqa: E731
    for cutoff, want, steps in ((0.0, 5, 4), (0.2, 3, 3), (0.7, 0, 0)):
        m = ConfidentStub()
        drafts, qs = spec.draft_chain(m, m.logits(torch.tensor([9]))[0], torch.zeros(1), 10, 5, greedy, cutoff)
        assert drafts.tolist() == [12 + i for i in range(want)] and len(qs) == want and m.steps == steps
    m = ConfidentStub()
    tree = spec.draft_tree(m, 1, m.logits(torch.tensor([9]))[0], torch.zeros(1), 10, 2, 6, 12)
    assert len(tree) == 12 and m.steps == 5
    m = ConfidentStub()
    tree = spec.draft_tree(m, 1, m.logits(torch.tensor([9]))[0], torch.zeros(1), 10, 2, 6, 12, cutoff=0.2)
    # kept: 0.6 (depth 1), 0.36 (depth 2), 0.216 (depth 3) on the top path; second-best
    # children have path probability <= 0.6 * 0.4 / 31 and are all dropped
    assert tree.tokens.tolist() == [1, 12, 13, 14] and tree.depth.tolist() == [0, 1, 2, 3]
    assert m.steps == 3  # levels 2 and 3 expanded; level 4's frontier (0.13) is below 0.2


# ---------------------------------------------------------------- lossless sampling


def _markov_step(P, Q, x, method, gen, k=2, topk=2, depth=2, cutoff=0.0, lookup=False):
    """One speculative step on a Markov 'target' P[x] -> next-token probs, drafter Q[x]; with
    `lookup`, a deterministic branch x+1, x+2 (mod V) grafted on, as prompt lookup adds one."""
    V = P.shape[0]

    class M:  # drafter over the full vocabulary whose logits depend on the node's token only
        target_ids = torch.arange(V)

        def step(self, states, tokens, positions, allow):
            return Q[tokens].log(), torch.zeros(tokens.shape[0], 1)

    if method == "chain":
        def pick(lg):
            q = torch.softmax(lg, -1)
            return torch.multinomial(q, 1, generator=gen)[0], q
        drafts, qs = spec.draft_chain(M(), Q[x].log(), torch.zeros(1), 0, k, pick, cutoff)
        tree, qd = spec.chain_tree(x, drafts), {i + 1: q for i, q in enumerate(qs)}
    else:
        tree, qd = spec.draft_tree(M(), x, Q[x].log(), torch.zeros(1), 0, topk, depth, 5, cutoff), None
    if lookup:
        tree = spec.graft(tree, [(x + 1) % V, (x + 2) % V])
    path, bonus = spec.accept_sampling(tree, P[tree.tokens], qd, gen)
    return tree.tokens[path[1:]].tolist() + [bonus]


@pytest.mark.parametrize("cutoff,lookup", [(0.0, False), (0.3, False), (0.0, True)])
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_speculative_sampling_is_lossless(method, cutoff, lookup):
    """The first two emitted tokens follow the target's joint distribution (chi-square, 24 dof),
    also when a draft-probability cutoff shortens chains and prunes trees, and with a
    deterministic lookup branch grafted onto the sampled chain or the top-k tree."""
    V, trials = 5, 4000
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # a poor drafter
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V, V)
    x0 = 0
    for _ in range(trials):
        out = []
        x = x0
        while len(out) < 2:
            new = _markov_step(P, Q, x, method, gen, cutoff=cutoff, lookup=lookup)
            out += new
            x = out[-1]
        counts[out[0], out[1]] += 1
    expected = P[x0][:, None] * P * trials  # p(a) p(b | a)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 51.18, chi2  # chi-square critical value, 24 dof, p = 0.001


def test_recursive_reject_point_mass_marginal():
    """Deterministic candidates (q = one-hot): the output token is distributed as p."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    cands = [1, 3]
    for _ in range(4000):
        i, tok = spec.recursive_reject(p, cands, [None, None], gen)
        counts[cands[i] if i is not None else tok] += 1
    chi2 = float(((counts - 4000 * p) ** 2 / (4000 * p)).sum())
    assert chi2 < 16.27, chi2  # 3 dof, p = 0.001


# ---------------------------------------------------------------- a real (tiny) drafter


def train_tiny_drafter(model, steps: int = 150, seed: int = 0) -> Eagle3Drafter:
    """A step-0-trained drafter for a tiny target (full draft vocabulary). It memorises the
    greedy continuations of prompts `_prompt(100..111)` (a random target has nothing more to
    learn), so on those prompts acceptance is high, and breaking its inputs visibly collapses it."""
    from eyas.core.drafter import causal_attend

    torch.manual_seed(seed)
    tcfg = model.config
    aux_ids = targets.default_aux_layers(tcfg.num_hidden_layers)
    seqs = []
    for i in range(12):
        p = _prompt(100 + i)
        seqs.append(model.generate(p[None], max_new_tokens=40, do_sample=False, eos_token_id=None,
                                   pad_token_id=2)[0])
    x = torch.stack(seqs)  # (B, T)
    with torch.no_grad(), targets.capture_aux(model, aux_ids) as cap:
        want = model(x).logits.argmax(-1)  # (B, T): target's next token at each position
        aux = cap.aux()
    d = Eagle3Drafter(DrafterConfig.from_target(tcfg, tcfg.vocab_size, aux_ids))
    d.t2d.fill_(True)  # the identity map (d2t = 0), as a full-vocabulary checkpoint stores it
    d.load_target_embedding(model.get_input_embeddings().weight)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    T = x.shape[1]
    pos = torch.arange(T - 1).expand(x.shape[0], -1)
    for _ in range(steps):
        h = d.layer(d.fuse(aux[:, :-1]), x[:, 1:], pos, causal_attend)  # entry t: (a[t], x[t+1])
        loss = torch.nn.functional.cross_entropy(d.logits(h).flatten(0, 1), want[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.fixture(scope="module")
def trained(tiny):
    model, _ = tiny
    return train_tiny_drafter(model)


def _loaded(d: Eagle3Drafter) -> runtime.LoadedDrafter:
    ids = torch.arange(d.cfg.draft_vocab_size) + d.d2t
    return runtime.LoadedDrafter(d, list(d.cfg.aux_layer_ids), True, "strict", ids, "eyas", [])


@pytest.mark.parametrize("cutoff", [0.0, 0.3])
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_greedy_identity_with_real_drafters(tiny, trained, method, cutoff):
    """Random drafter with a small draft vocabulary (d2t offsets) and a trained one; with a
    draft cutoff as well (steps with fewer or no drafts)."""
    model, _ = tiny
    tcfg = model.config
    torch.manual_seed(3)
    ids = torch.randperm(tcfg.vocab_size)[:64].sort().values
    rand = Eagle3Drafter(DrafterConfig.from_target(tcfg, 64, [1, 2, 3]))
    rand.d2t.copy_(ids - torch.arange(64))
    rand.load_target_embedding(model.get_input_embeddings().weight)
    for d in (rand.eval(), trained):
        tr, dr = runtime.runners(model, _loaded(d), runtime.Timer("cpu"))
        for seed in (5, 100):  # 100: a prompt the drafter was trained on
            prompt = _prompt(seed)
            ref = _hf_greedy(model, prompt, 40, eos=2)
            res = runtime.generate(tr, dr, prompt, _settings(method, cutoff=cutoff))
            assert res.tokens == ref
    assert sum(res.accepted) / res.steps > 0.5  # the trained drafter is accepted


@pytest.mark.skipif(not prepack.supported(torch.float32, "cpu"), reason="no oneDNN linear packing in this build")
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_greedy_identity_with_prepacked_models(tiny, trained, method):
    """`eyas bench` prepacks target and drafter (cpu/prepack): the output is still the unpacked
    target's HF greedy output, and the drafter is accepted exactly as often as unpacked."""
    model, _ = tiny
    pm, pd = copy.deepcopy(model), copy.deepcopy(trained)
    assert prepack.prepack(pm) > 0 and prepack.prepack(pd) > 0
    plain = runtime.runners(model, _loaded(trained), runtime.Timer("cpu"))
    packed = runtime.runners(pm, _loaded(pd), runtime.Timer("cpu"))
    for seed in (5, 100):
        prompt = _prompt(seed)
        ref = _hf_greedy(model, prompt, 40, eos=2)
        want = runtime.generate(*plain, prompt, _settings(method))
        got = runtime.generate(*packed, prompt, _settings(method))
        assert got.tokens == want.tokens == ref
        assert got.accepted == want.accepted
    assert sum(got.accepted) / got.steps > 0.5  # seed 100 was trained on: the packed drafter is accepted


def test_wide_tree_expands_more_nodes_than_it_keeps(tiny, trained):
    """topk * depth (8 * 6 = 48 drafted nodes) far above the 12 the target verifies: the
    drafter's cache must hold every expanded node (regression: it was sized by the budget)."""
    model, _ = tiny
    tr, dr = runtime.runners(model, _loaded(trained), runtime.Timer("cpu"))
    prompt = _prompt(100)
    res = runtime.generate(tr, dr, prompt, _settings("tree", tree=(8, 6, 12)))
    assert res.tokens == _hf_greedy(model, prompt, 40, eos=2)


def _reading(d: Eagle3Drafter, use_aux: bool, engine: str = "sglang"):
    from types import SimpleNamespace

    return SimpleNamespace(engine=engine, config=d.cfg, state=d.trainable_state_dict(), missing=[], skipped=[],
                           aux_layer_ids_hf=list(d.cfg.aux_layer_ids), use_aux=use_aux, d2t_as_offsets=True,
                           notes=[])


def test_engine_emulation_aux_off_skips_fc_and_collapses(tiny, trained):
    model, _ = tiny
    prompts = [_prompt(s) for s in (100, 101, 102)]  # prompts the drafter memorised
    rates = {}
    for use_aux in (True, False):
        loaded = runtime.drafter_from_reading(_reading(trained, use_aux), model)
        assert loaded.use_aux is use_aux
        tr, dr = runtime.runners(model, loaded, runtime.Timer("cpu"))
        acc = []
        for p in prompts:
            res = runtime.generate(tr, dr, p, _settings("chain"))
            assert res.tokens == _hf_greedy(model, p, 40, eos=2)  # still lossless, only slower
            acc += res.accepted
        rates[use_aux] = sum(acc) / len(acc)
        assert (dr.fc_calls > 0) is use_aux  # fc never runs on the H-wide final state
    assert rates[True] > 0.5 and rates[False] < 0.5 * rates[True], rates


def test_first_draft_gap_matches_training_scoring_and_catches_a_serving_bug(tiny, trained):
    """`eyas bench`'s gap analysis: the teacher-forced guesses are training's own step-0 scoring
    (independent path: capture_aux + layer + logits on the whole sequence), the served first
    drafts agree with them step by step, and a runtime that feeds the drafter other features
    than training did is caught (agreement drops, served < teacher-forced at the same steps)."""
    from eyas.core.drafter import causal_attend
    from eyas.stages.bench import first_draft_gap

    model, _ = tiny
    s = _settings("chain")
    tr, dr = runtime.runners(model, _loaded(trained), runtime.Timer("cpu"))
    prompts = [{"ids": _prompt(i)} for i in (100, 101, 5, 6)]  # two memorised, two not
    results = {"chain": []}
    for p in prompts:
        r = runtime.generate(tr, dr, p["ids"], s)
        results["chain"].append({"tokens": r.tokens, "accepted": r.accepted, "first_drafts": r.first_drafts})
    seq = torch.cat([prompts[0]["ids"], torch.tensor(results["chain"][0]["tokens"])])
    with torch.no_grad(), targets.capture_aux(model, list(trained.cfg.aux_layer_ids)) as cap:
        model(seq[None])
        aux = cap.aux()
    h = trained.layer(trained.fuse(aux[:, :-2]), seq[None, 1:-1], torch.arange(seq.shape[0] - 2)[None], causal_attend)
    ref = trained.logits(h)[0].argmax(-1)
    assert torch.equal(runtime.teacher_forced(tr, dr, seq)[:, 0], ref)

    g = first_draft_gap(tr, dr, prompts, results, ["plain", "chain"], s, {"acc_0": 0.5})["chain"]
    assert g["agreement"] == 1.0 and g["served_first"] == g["tf_at_steps"]
    assert 0.2 < g["served_first"] < 1.0 and g["tf_all"] >= g["tf_at_steps"], g
    assert g["val_acc_0"] == 0.5 and g["out_of_vocab"] == 0.0 and g["proposed"] == 1.0

    # a prompt-lookup branch can be accepted where the drafter's own first draft was wrong, and a
    # draft cutoff can leave a right but unsure first draft unproposed: neither is a serving bug
    for kw in ({"lookup": 4}, {"cutoff": 0.6}):
        other = {"chain": [runtime.generate(tr, dr, p["ids"], _settings("chain", **kw)).__dict__ for p in prompts]}
        o = first_draft_gap(tr, dr, prompts, other, ["chain"], s, None)["chain"]
        assert o["agreement"] == 1.0, (kw, o)
        if "cutoff" in kw:
            assert 0.0 < o["proposed"] < 1.0, o

    extend = dr.extend  # a serving bug: the committed features come zeroed (training saw real ones)
    dr.extend = lambda feats, tokens, start, every=False: extend(feats if every else feats * 0, tokens, start, every)
    broken = {"chain": [runtime.generate(tr, dr, p["ids"], s).__dict__ for p in prompts]}
    b = first_draft_gap(tr, dr, prompts, broken, ["chain"], s, None)["chain"]
    assert b["agreement"] < 0.9 and b["served_first"] < b["tf_at_steps"] - 0.2, b


@pytest.mark.slow
def test_greedy_identity_on_builtin_target(builtin_target):
    """SmolLM2 fp32 with a random drafter (8k draft vocabulary) and with always-right and
    always-wrong stubs: chain and tree give HF's greedy tokens."""
    model, tok = targets.load(builtin_target)
    tcfg = model.config
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(tcfg, 8192, targets.default_aux_layers(tcfg.num_hidden_layers)))
    d.load_target_embedding(model.get_input_embeddings().weight)
    tr, dr = runtime.runners(model, _loaded(d.eval()), runtime.Timer("cpu"))
    text = tok.apply_chat_template([{"role": "user", "content": "List three primes."}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    ref = _hf_greedy(model, prompt, 24, eos=tok.eos_token_id)
    for mode in ("right", "wrong"):
        stub = StubDrafter(prompt.tolist() + ref, tcfg.vocab_size, mode)
        for method in ("chain", "tree"):
            s = _settings(method, max_new_tokens=24, eos_ids=(tok.eos_token_id,), tree=(3, 3, 8))
            with torch.inference_mode():
                res = runtime.generate(tr, stub, prompt, s)
            assert res.tokens == ref, (mode, method)
            assert set(res.accepted) == {0} if mode == "wrong" else max(res.accepted) >= 3, (mode, method)
    ref = ref[:10]
    packed = copy.deepcopy(model), copy.deepcopy(d)
    if prepack.prepack(packed[0]) and prepack.prepack(packed[1]):  # as `eyas bench` runs it on CPU
        runs = [(tr, dr), runtime.runners(packed[0], _loaded(packed[1]), runtime.Timer("cpu"))]
    else:
        runs = [(tr, dr)]
    for method in ("chain", "tree"):
        for cutoff in (0.0, 0.1):  # 0.1: `eyas bench`'s CPU default
            s = _settings(method, max_new_tokens=10, eos_ids=(tok.eos_token_id,), tree=(3, 3, 8), cutoff=cutoff)
            with torch.inference_mode():
                for r in runs:
                    assert runtime.generate(*r, prompt, s).tokens == ref


def test_engine_reading_of_checkpoints(tiny, trained, tiny_target, tmp_path):
    """Through formats.engines: SGLang reading an intact checkpoint runs it like eyas does;
    the same checkpoint with aux capture disabled (eagle_config.use_aux_hidden_state false)
    skips fc and collapses."""
    import json

    from eyas.formats.checkpoint import save_checkpoint

    model, _ = tiny
    good = tmp_path / "good"
    save_checkpoint(good, trained, {})
    off = tmp_path / "off"
    save_checkpoint(off, trained, {})
    cfg = json.loads((off / "config.json").read_text())
    ids = [i - 1 for i in trained.cfg.aux_layer_ids]  # SGLang's convention: HF index - 1
    cfg["eagle_config"] = {"use_aux_hidden_state": False, "eagle_aux_hidden_state_layer_ids": ids}
    (off / "config.json").write_text(json.dumps(cfg))
    prompts = [_prompt(s) for s in (100, 101)]
    rate = {}
    for name, ckpt, engine in (("eyas", good, "eyas"), ("sglang", good, "sglang"), ("off", off, "sglang")):
        loaded = runtime.load_drafter(ckpt, model, engine, target_dir=tiny_target)
        tr, dr = runtime.runners(model, loaded, runtime.Timer("cpu"))
        acc = [a for p in prompts for a in runtime.generate(tr, dr, p, _settings("chain")).accepted]
        rate[name] = sum(acc) / len(acc)
    assert rate["sglang"] == pytest.approx(rate["eyas"]), rate
    assert rate["off"] < 0.5 * rate["eyas"], rate


@pytest.mark.parametrize("cutoff", [0.0, 0.1])
@pytest.mark.parametrize("method", ["chain", "tree"])
def test_sampling_runs_end_to_end(tiny, trained, method, cutoff):
    model, _ = tiny
    tr, dr = runtime.runners(model, _loaded(trained), runtime.Timer("cpu"))
    s = _settings(method, temperature=0.7, top_p=0.9, eos_ids=(), seed=3, cutoff=cutoff)
    a = runtime.generate(tr, dr, _prompt(100), s)
    b = runtime.generate(tr, dr, _prompt(100), s)
    assert len(a.tokens) == 40 and a.tokens == b.tokens  # seeded: reproducible


def test_grouped_sdpa_is_bit_identical_and_scoped(tiny_target, monkeypatch):
    """The target's verification forwards run `cpu.attention.sdpa_grouped` (SDPA groups the KV heads
    itself instead of transformers copying them under a mask): logits and features bit for bit
    those of transformers' own sdpa, for a causal chain and an explicit tree mask; the model's
    attention setting is back to sdpa outside the runner's forwards (HF's baselines use it)."""
    import torch.nn.functional as F

    model, _ = targets.load(tiny_target)
    tr, _ = runtime.runners(model, None, runtime.Timer("cpu"))
    assert tr.grouped is not None and model.config._attn_implementation == "sdpa"
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording(*a, **kw):
        seen.append(bool(kw.get("enable_gqa")) and kw.get("attn_mask") is not None)
        return sdpa(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    prompt, drafts = _prompt(3, n=20), torch.tensor([5, 9, 11, 4])
    tree = spec.Tree(torch.tensor([7, 5, 9, 11, 4]), torch.tensor([-1, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 2, 2]))
    with torch.no_grad():
        for mask in (None, tr.tree_mask(tree, prompt.numel())):
            toks = tree.tokens if mask is not None else torch.cat([torch.tensor([7]), drafts])
            pos = prompt.numel() + (tree.depth if mask is not None else torch.arange(toks.numel()))
            outs = {}
            for name, cfg in (("hf", None), ("grouped", tr.grouped)):
                tr.grouped, seen[:] = cfg, []
                tr.reset(64)
                tr.forward(prompt, torch.arange(prompt.numel()), features=False)
                outs[name] = tr.forward(toks, pos, mask)
                assert any(seen) == (name == "grouped"), (name, mask is None)
            assert all(torch.equal(a, b) for a, b in zip(outs["hf"], outs["grouped"]))
            tr.grouped = cfg
    assert model.config._attn_implementation == "sdpa"


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Naive reference for temperature + top-p: add tokens by falling probability until their
    mass reaches top_p, zero the rest, renormalise."""
    p = torch.softmax(logits.double() / temperature, -1)
    out, mass = torch.zeros_like(p), 0.0
    for i in p.argsort(descending=True).tolist():
        out[i], mass = p[i], mass + float(p[i])
        if mass >= top_p:
            break
    return out / out.sum()


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * a ** 0.5) ** 3


def _sub_vocab(d: Eagle3Drafter, keep: float) -> Eagle3Drafter:
    """`d` (full draft vocabulary) restricted to a random `keep` share of the target's ids:
    the same weights, lm_head rows of the kept ids, d2t offsets that are mostly non-zero."""
    V = d.cfg.draft_vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(7))[:int(V * keep)].sort().values
    sub = Eagle3Drafter(DrafterConfig.from_dict({**d.cfg.to_dict(), "draft_vocab_size": ids.numel()}))
    sd = {k: v for k, v in d.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    sub.load_state_dict({**sd, "lm_head.weight": d.lm_head.weight[ids], "d2t": ids - torch.arange(ids.numel()),
                         "t2d": t2d})
    sub.embedding_loaded = True
    return sub.eval()


@pytest.mark.parametrize("method,lookup", [("chain", 0), ("tree", 0), ("tree", 3)])
def test_runtime_sampling_is_lossless(tiny, trained, method, lookup):
    """Through `runtime.generate` (temperature, top-p, draft ids mapped to target ids, the
    drafter fed the target's aux states): the first two sampled tokens follow the target's own
    joint distribution under the same temperature and top-p (chi-square, naive reference)."""
    model, _ = tiny
    T, top_p, trials = 1.5, 0.95, 1500  # a flatter target: 14 first tokens, 46 cells of >= 5 expected
    prompt = _prompt(100)
    with torch.no_grad():
        p1 = _nucleus(model(prompt[None]).logits[0, -1], T, top_p)
        firsts = p1.nonzero()[:, 0]
        rows = torch.cat([prompt.repeat(len(firsts), 1), firsts[:, None]], 1)
        p2 = torch.stack([_nucleus(lg, T, top_p) for lg in model(rows).logits[:, -1]])
    expected = torch.zeros(p1.shape[0], p1.shape[0], dtype=torch.float64)
    expected[firsts] = p1[firsts, None] * p2 * trials  # p(a) p(b | a)
    tr, dr = runtime.runners(model, _loaded(_sub_vocab(trained, keep=0.75)), runtime.Timer("cpu"))
    counts, accepted = torch.zeros_like(expected), 0
    with torch.inference_mode():
        for seed in range(trials):
            s = _settings(method, temperature=T, top_p=top_p, max_new_tokens=2, eos_ids=(), seed=seed, lookup=lookup)
            res = runtime.generate(tr, dr, prompt, s)
            counts[res.tokens[0], res.tokens[1]] += 1
            accepted += res.accepted[0]
    assert accepted > trials // 10, accepted  # drafts are accepted and rejected: both paths run
    big = expected >= 5
    assert counts[expected == 0].sum() == 0  # nothing outside the nucleus
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_critical(len(obs) - 1), (chi2, len(obs), accepted)
