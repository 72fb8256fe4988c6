"""The target and the drafter as the decode loop drives them: forwards over a KV cache that
return what the other side needs (the target's aux states for the drafter; the drafter's
draft logits and pre-norm states), each timed."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from eyas import targets
from eyas.core import speculative as spec
from eyas.core.drafter import Eagle3Drafter
from eyas.cpu.attention import grouped_attention, grouped_config
from eyas.runtime.kv import KVPool, PreallocLayer
from eyas.runtime.loading import LoadedDrafter

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
        self.grouped = grouped_config(model, targets.find_decoder_stack(model).layers[0])

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


def runners(model, loaded: LoadedDrafter | None, timer: Timer) -> tuple[TargetRunner, DrafterRunner | None]:
    """Target and drafter runners sharing one timer."""
    if loaded is None:
        return TargetRunner(model, [], timer, use_aux=True), None
    tr = TargetRunner(model, loaded.aux_ids, timer, use_aux=loaded.use_aux)
    dr = DrafterRunner(loaded.drafter, timer, fuse=loaded.fuse, target_ids=loaded.target_ids)
    dr.vocab_size = model.get_input_embeddings().weight.shape[0]  # an engine's config may say otherwise
    return tr, dr
