"""config.json dicts of drafter layouts: the flat Llama-style fields every layout carries, read
into DrafterConfig sizes and written from them, and the two config styles (flat, as SGLang,
vLLM and the EAGLE code read it; speculators', nested under `transformer_layer_config`).

Pure dict work: no file is read or written here; the engine specs (spec.py) name which of
these functions each layout uses.
"""

from __future__ import annotations

import torch

from eyas.core.drafter import DrafterConfig
from eyas.errors import EyasError

SPECULATORS_VERSION = "0.9.0"  # the version whose loader was checked (spec.py)
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# What a speculators config carries at its top level beside transformer_layer_config.
SPECULATORS_TOP = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", *FLAGS)


def is_speculators(raw: dict) -> bool:
    return "speculators_config" in raw or "speculators_model_type" in raw


def eagle_config(c: dict) -> dict:
    """The `eagle_config` block of a config dict ({} when absent or not a dict)."""
    ec = c.get("eagle_config")
    return ec if isinstance(ec, dict) else {}


def flat_fields(c: dict, where: str) -> dict:
    """DrafterConfig sizes from a flat Llama-style config dict. Missing required fields raise,
    naming the key."""
    need = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if c.get(k) is None]
    if missing:
        raise EyasError(f"{where}: missing {missing}; the drafter config must give the layer sizes "
                        "(re-export it, or pass --from with the right layout)")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    rope = c.get("rope_parameters")
    if not rope:
        scaling = dict(c.get("rope_scaling") or {})
        rope = {"rope_type": scaling.pop("rope_type", scaling.pop("type", "default")),
                "rope_theta": float(c.get("rope_theta", 10000.0)), **scaling}
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate_size=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        hidden_act=str(c.get("hidden_act", "silu")),
    )


# ---------------------------------------------------------------- reading a speculators config


def speculators_as_vllm(raw: dict) -> tuple[dict, list[str]]:
    """The flat view vLLM builds from a speculators config (vllm/transformers_utils/configs/
    speculators/algos.py `update_eagle3`): norm_before_residual defaults to TRUE there."""
    base = dict(raw.get("transformer_layer_config") or {})
    base.update(draft_vocab_size=raw.get("draft_vocab_size"),
                norm_before_residual=raw.get("norm_before_residual", True),
                **{k: raw.get(k, False) for k in FLAGS[1:]})
    for k in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(k):
            base[k] = raw[k]
    notes = [] if "norm_before_residual" in raw else \
        ["vLLM reads a speculators config without norm_before_residual as TRUE"]
    return base, notes


def speculators_as_is(raw: dict) -> tuple[dict, list[str]]:
    """speculators' own reading: the layer fields nested, the rest top level."""
    base = dict(raw.get("transformer_layer_config") or {})
    base.update({k: raw[k] for k in SPECULATORS_TOP if k in raw})
    return base, []


# ---------------------------------------------------------------- writing


def _rope_legacy(cfg: DrafterConfig) -> dict:
    """rope_theta / rope_scaling for engines on transformers 4.x beside transformers 5's rope_parameters."""
    rp = dict(cfg.rope_parameters)
    theta = float(rp.pop("rope_theta", 10000.0))
    scaling = rp if rp.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": dict(cfg.rope_parameters)}


def llama_fields(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """The flat Llama config of the drafter's one decoder layer."""
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "dtype": str(dtype).replace("torch.", ""), **_rope_legacy(cfg),
    }


def write_flat(cfg: DrafterConfig, dtype: torch.dtype, architectures: tuple[str, ...], aux: dict,
               explicit: tuple[str, ...], verifier: str | None, verifier_arch: list[str]) -> dict:
    """SGLang / vLLM / EAGLE config.json: the Llama fields, the aux ids fragment `aux` (already in
    the engine's convention), flags top-level when set (any reader then sees what the drafter
    computes) and `explicit` flags always (never left to an engine default)."""
    out = {"architectures": list(architectures), **llama_fields(cfg, dtype), "draft_vocab_size": cfg.draft_vocab_size}
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    out.update({k: True for k in FLAGS if getattr(cfg, k)})
    out.update({k: getattr(cfg, k) for k in explicit})
    out.update(aux)
    return out


def write_speculators(cfg: DrafterConfig, dtype: torch.dtype, architectures: tuple[str, ...], aux: dict,
                      explicit: tuple[str, ...], verifier: str | None, verifier_arch: list[str]) -> dict:
    """speculators 0.9 `Eagle3Speculator` config.json (verifier path: the target directory)."""
    return {
        "architectures": list(architectures), "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama_fields(cfg, dtype)},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
        **aux, **{k: getattr(cfg, k) for k in FLAGS}, "embed_requires_grad": False, "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_arch or [])},
        },
    }
