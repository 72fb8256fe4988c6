"""The EAGLE-3 drafter: one Llama-style decoder layer over [embedding ; fused target state].

Pure model code (DESIGN section 5). Parameter names are the serving engines' own
(`fc`, `midlayer.*`, `norm`, `lm_head`, buffers `d2t`/`t2d`), so export copies tensors
instead of renaming them. The embedding is the target's, frozen, and not saved.

Attention is pluggable: `Eagle3Drafter.layer` computes q/k/v and hands them to an
`attend(q, k, v) -> o` callable, so training (TTT diagonal keys, core/ttt.py) and decoding
(KV cache + tree mask, core/speculative.py) share every weight and every norm.

    e   = input_layernorm(embed_tokens(x[t+1]))
    h   = fc(cat(a_low, a_mid, a_high))              # first step only
    z   = cat([e, hidden_norm(h)])                    # 2H, embeddings first
    h   = h + o_proj(attn(q, k, v from z))            # residual = hidden_norm(h) if norm_before_residual
    h   = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                         # over the N draft tokens
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# rope_parameters keys the drafter keeps from its target: transformers' llama3, linear, dynamic,
# yarn and longrope parameters (anything else, e.g. a partial rotary factor, is not Llama-style)
ROPE_KEYS = ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate", "short_factor", "long_factor")


@dataclass
class DrafterConfig:
    """Everything needed to build a drafter; stored as `config.json` of an eyas checkpoint."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int]  # HF output_hidden_states index (DESIGN 3)
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    # Flags used by peers' checkpoints (speculators Eagle3SpeculatorConfig), honoured here.
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h
    norm_before_fc: bool = False  # one RMSNorm over cat(aux) before fc (`input_norm`)
    fc_norm: bool = False  # one RMSNorm per aux state before fc (`fc_norm.{i}`)
    norm_output: bool = False  # feed norm(h) instead of h to the next step

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int, aux_layer_ids: list[int], **overrides) -> "DrafterConfig":
        """A drafter sized like the target (hidden, heads, MLP, RoPE) for `tcfg` (a transformers config)."""
        heads = tcfg.num_attention_heads
        rope = getattr(tcfg, "rope_parameters", None) or {
            "rope_type": "default", "rope_theta": float(getattr(tcfg, "rope_theta", 10000.0))}
        if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers'
            rope = rope["full_attention"]
        rope = {k: v for k, v in dict(rope).items() if k in ROPE_KEYS}
        kw = dict(
            hidden_size=tcfg.hidden_size,
            target_hidden_size=tcfg.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads(tcfg),
            head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
            intermediate_size=mlp_width(tcfg),
            vocab_size=tcfg.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 4096)),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown drafter config keys {sorted(unknown)}")
        return cls(**d)


def kv_heads(tcfg) -> int:
    """The target's key/value head count under its own name (Falcon: `num_kv_heads`); the
    attention head count where the config names none (no grouped-query attention)."""
    return int(getattr(tcfg, "num_key_value_heads", None) or getattr(tcfg, "num_kv_heads", None)
               or tcfg.num_attention_heads)


def mlp_width(tcfg) -> int:
    """The target's MLP width under its own name (Falcon: `ffn_hidden_size`; 4x hidden where
    the config names none, as GPT-2-style configs mean)."""
    return int(getattr(tcfg, "intermediate_size", None) or getattr(tcfg, "ffn_hidden_size", None)
               or 4 * tcfg.hidden_size)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 like the engines do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """q/k/v projections from the 2H input, GQA heads; the attention itself is supplied."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)

    def qkv(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = z.shape
        q = self.q_proj(z).view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(z).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(z).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hd)
        return rope(q, cos, sin), rope(k, cos, sin), v


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (Llama / HF)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


ACTIVATIONS = ("silu",)  # the `hidden_act` values MLP computes (SwiGLU); checkpoints with another are refused


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The EAGLE-3 decoder layer (SGLang `midlayer`, speculators `layers.0`)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)


class Eagle3Drafter(nn.Module):
    """One EAGLE-3 layer plus fusion and head. See the module docstring for the math."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H, n_aux = cfg.hidden_size, len(cfg.aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, H, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(n_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n_aux))
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # Per-channel gain on fc's input, training only (see `aux_gain_from_rms`); folded into
        # fc.weight by trainable_state_dict, so checkpoints and engines never see it.
        self.register_buffer("aux_gain", torch.ones(n_aux * cfg.target_hidden_size), persistent=False)
        self.gained = False  # aux_gain is not all ones (a flag: no device sync in fuse)
        self.embedding_loaded = False  # set by load_target_embedding; layer() refuses a random one
        inv_freq, self.attention_scaling = _rope_init(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # -------------------------------------------------------------- pieces

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """(B, T, n_aux*H_target) target features -> (B, T, H) drafter state (step 0 only)."""
        if aux.shape[-1] != self.fc.in_features:
            # The engines skip `fc` when the width equals H (seed failure 1); eyas refuses.
            raise ValueError(f"aux features are {aux.shape[-1]} wide, fc expects {self.fc.in_features} "
                             f"({len(self.cfg.aux_layer_ids)} aux layers x {self.cfg.target_hidden_size})")
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        if self.cfg.fc_norm:
            aux = torch.cat([n(a) for n, a in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        aux = aux.to(self.fc.weight.dtype)
        if self.gained:
            aux = aux * self.aux_gain.to(aux.dtype)
        return self.fc(aux)

    @torch.no_grad()
    def set_aux_gain(self, gain: torch.Tensor, keep_function: bool) -> None:
        """Train fc on `aux * gain` (powers of two). `keep_function`: divide fc.weight by the
        gain so the drafter computes what it did (exact: a power-of-two scale never rounds)."""
        gain = gain.to(self.aux_gain)
        if keep_function:
            self.fc.weight.div_(gain.to(self.fc.weight.dtype))
        self.aux_gain.copy_(gain)
        self.gained = not bool((gain == 1).all())

    def rope_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """(B, T) positions -> cos, sin of shape (B, T, head_dim)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def rope_table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (n, head_dim) of positions 0..n-1, for decoders that index instead of recomputing."""
        cos, sin = self.rope_cos_sin(torch.arange(n, device=self.inv_freq.device)[None], dtype)
        return cos[0], sin[0]

    def layer(self, h: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
              attend: Attend, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
              keep: torch.Tensor | None = None) -> torch.Tensor:
        """One drafter step: state h (B,T,H) + tokens x[t+1] (B,T) -> next pre-norm state (B,T,H).
        `rope`: (cos, sin) tables from `rope_table` to index by position_ids instead of recomputing.
        `keep`: flat indices into B*T of the only positions whose output is wanted; every position
        still gives its key and value, but o_proj and the MLP run on these alone, and the result
        is (len(keep), H) (training: positions that feed no loss)."""
        if not self.embedding_loaded:
            raise RuntimeError("drafter embedding is still random: call load_target_embedding(target weight)")
        m = self.midlayer
        e = self.embed_tokens(input_ids).to(h.dtype)  # (B, T, H)
        hn = m.hidden_norm(h)
        residual = hn if self.cfg.norm_before_residual else h
        z = torch.cat([m.input_layernorm(e), hn], dim=-1)  # (B, T, 2H), embeddings first
        if rope is None:
            cos, sin = self.rope_cos_sin(position_ids, h.dtype)
        else:
            cos, sin = rope[0][position_ids], rope[1][position_ids]
        q, k, v = m.self_attn.qkv(z, cos, sin)
        o = attend(q, k, v)  # (B, nh, T, hd)
        B, nh, T, hd = o.shape
        o = o.transpose(1, 2).reshape(B, T, nh * hd)  # T may be 0: a training step with no position left
        if keep is not None:
            o, residual = o.reshape(B * T, -1)[keep], residual.reshape(B * T, -1)[keep]
        h = residual + m.self_attn.o_proj(o)
        h = h + m.mlp(m.post_attention_layernorm(h))
        return h

    def next_input(self, h: torch.Tensor) -> torch.Tensor:
        """The state fed to the next step: pre-norm h (EAGLE-3), or norm(h) with `norm_output`."""
        return self.norm(h) if self.cfg.norm_output else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, N) logits over the draft vocabulary."""
        return self.lm_head(self.norm(h))

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits(h)` and `next_input(h)` together, with the final norm computed once."""
        hn = self.norm(h)
        return self.lm_head(hn), (hn if self.cfg.norm_output else h)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids with the offset convention `target = i + d2t[i]` (DESIGN 4)."""
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def load_target_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(weight.shape)} != drafter's "
                             f"{tuple(self.embed_tokens.weight.shape)}")
        self.embed_tokens.weight.copy_(weight)
        self.embedding_loaded = True

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint stores: all weights and d2t/t2d, without the target's embedding."""
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
        if self.gained:  # fc(aux * g) == (fc.weight * g)(aux): the layout every engine serves
            sd["fc.weight"] = sd["fc.weight"] * self.aux_gain.to(sd["fc.weight"])
        return sd


def aux_gain_from_rms(rms: torch.Tensor) -> torch.Tensor:
    """Per-channel gain bringing each aux channel to RMS ~1, rounded to a power of two.

    Raw aux states are badly scaled for fc: on SmolLM2 one channel of the middle and top aux
    layers has RMS ~1,700 while the median channel's is 5-14, so with a plain fc that channel
    dominates the first steps and Adam moves every column by the same amount whatever its
    input's scale. A fixed per-channel gain is linear, so it folds into fc.weight on save
    (no engine change), and powers of two make folding and unfolding exact. Channels quieter
    than 1/64 of the median get the median/64 gain (a dead channel is not amplified)."""
    rms = rms.double().clamp(min=float(rms.double().median()) / 64).clamp(min=1e-12)
    return torch.exp2(-torch.round(torch.log2(rms))).float()


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention with GQA (used for step 0 and as a reference)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _rope_init(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling for the drafter's RoPE, via transformers' own table
    so that llama3/yarn/linear scaling mean exactly what they mean in the target."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = dict(cfg.rope_parameters)
    lc = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters=rp)
    rope_type = rp.get("rope_type", "default")
    if rope_type == "default":
        base = float(rp.get("rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
        return inv, 1.0
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](lc, None)
    return inv, float(scaling)


def default_aux_layers(num_layers: int) -> list[int]:
    """The engines' default aux layers `[2, L//2, L-3]`, as HF `output_hidden_states` indices (the
    vLLM convention, DESIGN 3), for a target of `num_layers` decoder layers."""
    return [2, num_layers // 2, num_layers - 3]
