"""The decoding runtime: wires a target model, a drafter and their KV caches into the pure
functions of `eyas.core.speculative`, times every forward, and emulates how a serving
engine (SGLang, vLLM) would run a given checkpoint (`--engine`).

Methods: `plain` (target alone, KV cache, one token per forward), `chain` (k drafts),
`tree` (EAGLE-2 dynamic tree). Greedy (temperature 0) output of chain/tree is the target's
own greedy output; with temperature > 0 they sample losslessly (core/speculative.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eyas import targets
from eyas.core import speculative as spec
from eyas.core.drafter import Eagle3Drafter
from eyas.errors import EyasError

log = logging.getLogger(__name__)

METHODS = ("plain", "chain", "tree")
ENGINES = ("eyas", "sglang", "vllm")


# ---------------------------------------------------------------- timing


class Timer:
    """Accumulates seconds spent in target and drafter forwards (synchronising CUDA)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = {"target": 0.0, "drafter": 0.0}

    @contextlib.contextmanager
    def __call__(self, which: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[which] += time.perf_counter() - t0

    def reset(self) -> None:
        self.seconds = {"target": 0.0, "drafter": 0.0}


# ---------------------------------------------------------------- target KV cache


class KVPool:
    """The keys and values of every layer in one buffer (2L, B, h, capacity, d), so that moving
    the accepted path into place is one gather and one copy per step instead of two per layer.
    A layer whose shape differs from the first one's keeps buffers of its own."""

    def __init__(self, n_layers: int, capacity: int):
        self.n_layers, self.capacity = n_layers, capacity
        self.buf: torch.Tensor | None = None

    def views(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """(keys, values) buffers of layer i inside the pool, or None when it does not fit."""
        B, h, _, d = key_states.shape
        if self.buf is None:
            self.buf = key_states.new_empty(2 * self.n_layers, B, h, self.capacity, d)
        if tuple(value_states.shape) != tuple(key_states.shape) or self.buf.shape[1:3] != (B, h) \
                or self.buf.shape[-1] != d or self.buf.dtype != key_states.dtype:
            return None
        return self.buf[2 * i], self.buf[2 * i + 1]

    def compact(self, start: int, rows: torch.Tensor, in_place: bool) -> None:
        if self.buf is not None:
            spec.compact_rows(self.buf, start, rows, in_place)


class PreallocLayer(DynamicLayer):
    """A DynamicLayer that writes into one preallocated buffer instead of `torch.cat` per
    step (no O(context) copy per token), and can be compacted in place. With a `KVPool`
    its buffers are views into the pool, which then compacts every layer at once."""

    def __init__(self, capacity: int, pool: KVPool | None = None, index: int = 0):
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.pool, self.index, self.pooled = pool, index, False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, h, _, d = key_states.shape
        views = self.pool.views(self.index, key_states, value_states) if self.pool is not None else None
        self.pooled = views is not None
        if views is not None:
            self.kbuf, self.vbuf = views
        else:
            self.kbuf = key_states.new_empty(B, h, self.capacity, d)
            self.vbuf = value_states.new_empty(B, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True
        self._view()

    def _view(self) -> None:
        self.keys = self.kbuf[..., : self.length, :]
        self.values = self.vbuf[..., : self.length, :]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, T = self.length, key_states.shape[-2]
        if n + T > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({n}+{T})")
        self.kbuf[..., n:n + T, :] = key_states
        self.vbuf[..., n:n + T, :] = value_states
        self.length = n + T
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove)) if tokens_to_remove < 0 else min(
            self.length, tokens_to_remove)
        if self.is_initialized:
            self._view()

    def keep_sequences(self, batch_rows: torch.Tensor) -> None:
        """Keep only these batch rows (sequences), in this order."""
        if self.pooled:
            raise RuntimeError("keep_sequences on a pooled KV layer")
        if self.is_initialized:
            self.kbuf, self.vbuf = self.kbuf[batch_rows], self.vbuf[batch_rows]
            self._view()

    def compact(self, start: int, rows: torch.Tensor, in_place: bool | None = None) -> None:
        """Keep rows start+rows (in order) at start.., drop everything after them (a pooled
        layer's rows are moved by `KVPool.compact`)."""
        if self.is_initialized and not self.pooled:
            spec.compact_rows(self.kbuf, start, rows, in_place)
            spec.compact_rows(self.vbuf, start, rows, in_place)
        self.length = start + rows.numel()
        if self.is_initialized:
            self._view()


# ---------------------------------------------------------------- target attention

GROUPED_SDPA = "eyas_sdpa_grouped"


def sdpa_grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, except that grouped KV heads reach SDPA as they are
    (`enable_gqa`) under a mask too. On a CPU transformers copies each KV head to all of its
    query heads whenever a mask is present, i.e. the whole KV cache per layer in every
    verification forward (SmolLM2: 3 KV heads -> 9). SDPA's own grouping computes the same
    values bit for bit (test_speculative.py) without the copy. Without a mask, with one KV head
    per query head, or with anything else sdpa handles (position bias, paged cache), transformers'
    own function runs."""
    if (attention_mask is None or query.shape[1] == key.shape[1] or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _grouped_config(model):
    """The config whose `_attn_implementation` the decoder layers read, when switching it to
    `sdpa_grouped` applies (CPU, sdpa, grouped KV heads); else None. On CUDA a mask with
    `enable_gqa` can send SDPA to its math kernel, so there transformers' choice stands."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    attn = getattr(targets.find_decoder_stack(model).layers[0], "self_attn", None)
    cfg = getattr(attn, "config", None)
    if (next(model.parameters()).device.type != "cpu" or cfg is None
            or getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(attn, "num_key_value_groups", 1) <= 1):
        return None
    AttentionInterface.register(GROUPED_SDPA, sdpa_grouped)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)
    return cfg


@contextlib.contextmanager
def grouped_attention(cfg):
    """Run the target's forwards inside with `sdpa_grouped` (cfg from `_grouped_config`; None:
    unchanged). Only inside: the same model also runs Hugging Face's own baselines."""
    if cfg is None:
        yield
        return
    prev, cfg._attn_implementation = cfg._attn_implementation, GROUPED_SDPA
    try:
        yield
    finally:
        cfg._attn_implementation = prev


class TargetRunner:
    """The target with a preallocated KV cache; each forward optionally returns the features
    the drafter consumes (aux states, or the final-norm state when aux capture is off)."""

    def __init__(self, model, aux_ids: list[int] | None, timer: Timer, use_aux: bool = True):
        self.model, self.timer = model, timer
        self.aux_ids = list(aux_ids or []) if use_aux else []
        self.use_aux = use_aux
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.n_layers = len(targets.find_decoder_stack(model).layers)
        self.cache: Cache | None = None
        cfg = targets.text_config(model.config)
        kinds = set(getattr(cfg, "layer_types", None) or [])
        # a window applies unless the layer types leave it unused (Qwen2 without use_sliding_window)
        uses_window = not kinds or "sliding_attention" in kinds
        self.window = (getattr(cfg, "sliding_window", None) or None) if uses_window else None
        # transformers takes one 4D mask as is for every layer; targets mixing sliding and full
        # layers (Gemma 2/3) take a mask per layer type instead
        self.mask_kinds = kinds if self.window and len(kinds) > 1 else None
        self.grouped = _grouped_config(model)

    def reset(self, capacity: int) -> None:
        self.pool = KVPool(self.n_layers, capacity)
        self.cache = Cache(layers=[PreallocLayer(capacity, self.pool, i) for i in range(self.n_layers)])

    @property
    def length(self) -> int:
        return self.cache.layers[0].length

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                features: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens/positions (T,) -> logits (T, V) and features (T, F) (or None)."""
        kw = dict(input_ids=tokens.view(1, -1).to(self.device), position_ids=positions.view(1, -1).to(self.device),
                  past_key_values=self.cache, use_cache=True)
        if mask is not None:
            kw["attention_mask"] = mask
        with self.timer("target"), grouped_attention(self.grouped):
            if not features:
                return self.model(**kw).logits[0], None
            with targets.capture_aux(self.model, self.aux_ids) as cap:
                logits = self.model(**kw).logits[0]
                feats = cap.aux()[0] if self.aux_ids else cap.last[0]
        return logits, feats

    def tree_mask(self, tree: spec.Tree, n: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention mask verifying `tree` after n cached tokens, sliding windows included."""
        if self.window is None:
            return spec.tree_mask(tree, n, self.dtype, self.device)
        windowed = spec.tree_mask(tree, n, self.dtype, self.device, window=self.window)
        if self.mask_kinds is None:
            return windowed
        full = spec.tree_mask(tree, n, self.dtype, self.device)
        return {k: windowed if k == "sliding_attention" else full for k in self.mask_kinds}

    def compact(self, start: int, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        in_place = spec.rows_in_place(rows)
        self.pool.compact(start, rows, in_place)
        for layer in self.cache.layers:
            layer.compact(start, rows, in_place)


# ---------------------------------------------------------------- drafter with its own KV cache


class DrafterRunner:
    """An `Eagle3Drafter` behind the `DraftModel` protocol, with a preallocated KV cache
    (committed step-0 entries, then the current tree's entries).

    `fuse`: "strict" (eyas: features must be n_aux*H wide, else error) or "engine" (SGLang /
    vLLM: `if hidden.shape[-1] != embeds.shape[-1]: hidden = fc(hidden)`, so an H-wide final
    state silently skips fc — the failure eyas exists to catch)."""

    def __init__(self, drafter: Eagle3Drafter, timer: Timer, fuse: str = "strict",
                 target_ids: torch.Tensor | None = None):
        self.d, self.timer, self.fuse = drafter, timer, fuse
        self.vocab_size = drafter.cfg.vocab_size  # the target's vocabulary
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        ids = torch.arange(drafter.cfg.draft_vocab_size, device=self.device) + drafter.d2t
        self.target_ids = ids if target_ids is None else target_ids.to(self.device)
        self.fc_calls = 0
        cfg = drafter.cfg
        self.nkv, self.hd = cfg.num_key_value_heads, cfg.head_dim
        self.committed = 0
        self.length = 0
        self.rope = None  # (cos, sin) tables by position, grown by reset()

    def reset(self, capacity: int) -> None:
        self.k = torch.empty(1, self.nkv, capacity, self.hd, dtype=self.dtype, device=self.device)
        self.v = torch.empty_like(self.k)
        self.committed = self.length = 0
        if self.rope is None or self.rope[0].shape[0] < capacity:
            self.rope = self.d.rope_table(capacity, self.dtype)

    def truncate(self, n: int) -> None:
        self.committed = min(self.committed, n)
        self.length = n

    def _attend(self, mask: torch.Tensor):
        def attend(q, k, v):
            T = k.shape[2]
            n = self.length
            self.k[:, :, n:n + T] = k
            self.v[:, :, n:n + T] = v
            self.length = n + T
            return F.scaled_dot_product_attention(q, self.k[:, :, :n + T], self.v[:, :, :n + T],
                                                  attn_mask=mask, enable_gqa=True)
        return attend

    def _features(self, feats: torch.Tensor) -> torch.Tensor:
        feats = feats.to(self.device, self.dtype)
        if self.fuse == "engine" and feats.shape[-1] == self.d.embed_tokens.weight.shape[-1]:
            return feats  # the engines' test is false: fc is skipped
        self.fc_calls += 1
        return self.d.fuse(feats)

    def extend(self, feats: torch.Tensor, tokens: torch.Tensor, start: int, every: bool = False):
        """Commit T positions (features of tokens start-1.., and `tokens`) and return the head's
        (logits, state) at the last one, or at all T with `every`."""
        assert start == self.length == self.committed, (start, self.length, self.committed)
        T = tokens.shape[0]
        mask = torch.ones(T, start + T, dtype=torch.bool, device=self.device).tril_(start)
        pos = torch.arange(start, start + T, device=self.device)
        with self.timer("drafter"):
            h = self._features(feats)[None]  # (1, T, H)
            h = self.d.layer(h, tokens.view(1, -1).to(self.device), pos[None], self._attend(mask), self.rope)
            logits, state = self.d.head(h[0] if every else h[:, -1])
            out = (logits, state) if every else (logits[0], state[0])
        self.committed = self.length
        return out

    def step(self, states, tokens, positions, allow):
        m = tokens.shape[0]
        mask = torch.cat([torch.ones(m, self.committed, dtype=torch.bool, device=self.device),
                          allow.to(self.device)], dim=1)
        assert mask.shape[1] == self.length + m
        with self.timer("drafter"):
            h = self.d.layer(states[:, None], tokens.view(m, 1).to(self.device), positions.view(m, 1).to(self.device),
                             self._attend_tree(mask), self.rope)
            return self.d.head(h[:, 0])

    def _attend_tree(self, mask: torch.Tensor):
        """Tree entries come as a batch of m rows with T=1; attend as one query block of m."""
        inner = self._attend(mask)

        def attend(q, k, v):  # (m, nh, 1, hd) -> one sequence of m queries
            o = inner(q.transpose(0, 2), k.transpose(0, 2), v.transpose(0, 2))  # (1, nh, m, hd)
            return o.transpose(0, 2)
        return attend


# ---------------------------------------------------------------- decoding


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
        return int(logits.float().argmax())  # fp32 argmax: 4x faster than bf16 on CPU, same ids
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


# ---------------------------------------------------------------- loading drafters, engine emulation


@dataclass
class LoadedDrafter:
    drafter: Eagle3Drafter
    aux_ids: list[int]
    use_aux: bool
    fuse: str
    target_ids: torch.Tensor
    engine: str
    notes: list[str]
    missing: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def load_drafter(ckpt: Path, target_model, engine: str = "eyas", dtype: torch.dtype = torch.float32,
                 seed: int = 0, target_dir: Path | None = None) -> LoadedDrafter:
    """The drafter as eyas runs it (`engine="eyas"`), or as SGLang / vLLM would load and feed it."""
    from eyas.formats.checkpoint import load_checkpoint

    emb = target_model.get_input_embeddings().weight
    dev = emb.device
    if not Path(ckpt).is_dir():
        raise EyasError(f"drafter {ckpt} is not a checkpoint directory; pass the directory that holds "
                        "config.json and model.safetensors (e.g. RUN/final)")
    if engine == "eyas":
        d, _ = load_checkpoint(Path(ckpt))
        _check_compat(d, target_model, ckpt)  # before the embedding: a wrong target names itself
        d.load_target_embedding(emb.float())
        d = d.to(dev, dtype).eval()
        ids = torch.arange(d.cfg.draft_vocab_size, device=dev) + d.d2t
        return LoadedDrafter(d, list(d.cfg.aux_layer_ids), True, "strict", ids, engine, [])
    if engine not in ENGINES:
        raise EyasError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    try:
        from eyas.formats.engines import engine_reading
    except ImportError as e:
        raise EyasError(f"--engine {engine}: engine emulation needs eyas.formats.engines ({e})") from e
    reading = engine_reading(Path(ckpt), engine, target_dir)
    if getattr(reading, "errors", None):
        raise EyasError(f"--engine {engine}: the engine would refuse to start with {ckpt}: "
                        + "; ".join(reading.errors))
    return drafter_from_reading(reading, target_model, dtype, seed)


def drafter_from_reading(reading, target_model, dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedDrafter:
    """Build what an engine would run from an `EngineReading`: keys it finds are loaded, the
    missing ones keep a (seeded) random init, d2t is read as that engine reads it, aux
    states are captured at the engine's layer ids or not at all."""
    emb = target_model.get_input_embeddings().weight
    cfg, (V, H) = reading.config, emb.shape
    for what, mine, theirs in (("vocab_size", cfg.vocab_size, V), ("target_hidden_size", cfg.target_hidden_size, H)):
        if mine != theirs:  # the engine would not load it beside this target either
            raise EyasError(f"--engine {reading.engine}: the drafter's {what} is {mine}, the target's {theirs}; "
                            "pass the drafter trained for this target")
    n_aux, fc_in = len(reading.aux_layer_ids_hf or []), len(cfg.aux_layer_ids) * cfg.target_hidden_size
    if reading.use_aux and n_aux * H != fc_in:  # the engine's first draft step would fail on fc
        raise EyasError(f"--engine {reading.engine}: it captures {n_aux} aux layers x {H}, fc takes {fc_in}; "
                        "pass the drafter trained for this target")
    torch.manual_seed(seed)
    d = Eagle3Drafter(reading.config)
    own = d.state_dict()
    state = {k: v for k, v in reading.state.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    misfit = sorted(k for k in reading.state if k in own and k not in state)
    d.load_state_dict(state, strict=False)
    d.load_target_embedding(emb.float())
    d = d.to(emb.device, dtype).eval()
    N, V = reading.config.draft_vocab_size, emb.shape[0]
    raw = d.d2t
    ids = raw if not reading.d2t_as_offsets else torch.arange(N, device=raw.device) + raw
    ids = ids.clamp(0, V - 1)  # an engine would index out of range here; keep the emulation running
    use_aux = bool(reading.use_aux)
    aux = list(reading.aux_layer_ids_hf or []) if use_aux else []
    notes = list(reading.notes)
    if misfit:
        notes.append(f"keys whose shape does not fit the engine's config stay random: {misfit[:6]}")
    if not use_aux:
        notes.append(f"{reading.engine} captures no aux states: the drafter gets the {emb.shape[1]}-wide final "
                     "state, `hidden.shape[-1] != embeds.shape[-1]` is false and fc is skipped")
    return LoadedDrafter(d, aux, use_aux, "engine", ids, reading.engine, notes,
                         list(reading.missing), list(reading.skipped))


def _check_compat(d: Eagle3Drafter, model, ckpt) -> None:
    tcfg = targets.text_config(model.config)
    V, H = model.get_input_embeddings().weight.shape
    if d.cfg.vocab_size != V:
        raise EyasError(f"drafter {ckpt}: vocab_size {d.cfg.vocab_size} != target's {V}; "
                        "pass the drafter trained for this target")
    if d.cfg.target_hidden_size != H:
        raise EyasError(f"drafter {ckpt}: target_hidden_size {d.cfg.target_hidden_size} != target's {H}; "
                        "pass the drafter trained for this target")
    L = tcfg.num_hidden_layers
    bad = [i for i in d.cfg.aux_layer_ids if not 0 <= i <= L]
    if bad:
        raise EyasError(f"drafter {ckpt}: aux layer ids {bad} do not exist in a {L}-layer target")


def runners(model, loaded: LoadedDrafter | None, timer: Timer) -> tuple[TargetRunner, DrafterRunner | None]:
    """Target and drafter runners sharing one timer."""
    if loaded is None:
        return TargetRunner(model, [], timer, use_aux=True), None
    tr = TargetRunner(model, loaded.aux_ids, timer, use_aux=loaded.use_aux)
    dr = DrafterRunner(loaded.drafter, timer, fuse=loaded.fuse, target_ids=loaded.target_ids)
    dr.vocab_size = model.get_input_embeddings().weight.shape[0]  # an engine's config may say otherwise
    return tr, dr
