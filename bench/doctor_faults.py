"""The catalogue of broken drafter exports the doctor must catch, each built from a healthy one.

One `Fault` per fault class (keys, d2t/t2d forms, foreign vocabularies, missing heads, fc width,
aux capture, config against weights, non-finite and random weights, and the config fields a
drafter shares with its target). `build(fault, healthy, out)` copies a healthy export
(`eyas export --to vllm|speculators`) and applies one mutation to its config.json or its
tensors; the doctor and real vLLM are then run on the result and must agree
(doctor_agreement.py beside this file).

This is a measuring instrument, not part of eyas: its users are bench/doctor_vs_vllm.py (which
serves every class and records `Fault.vllm`) and tests/doctor/test_doctor_vllm.py (which checks
the doctor against the record), so it lives in bench/ and nothing in src/eyas imports it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.formats import checkpoint as ckpt_io

Mutation = Callable[[dict, dict], None]  # (config.json dict, tensors) -> None, in place


@dataclass(frozen=True)
class Fault:
    """One fault class: what it breaks, in which export layouts, and how."""

    name: str
    what: str  # one line for the table
    layouts: tuple[str, ...]
    mutate: Mutation
    needs_target: bool = False  # only `eyas doctor --target` can see it (it depends on the target's depth)
    meta: Callable[[dict], None] | None = None  # also edits eyas.json (what the author says was trained)
    # what vLLM 0.32.0 did with it when bench/doctor_vs_vllm.py served it: refuses | fails | collapses |
    # unaffected; "" for a class not served yet (the tests then have no record to check the doctor against)
    vllm: str = ""
    # tokens generated per request when served, where the default (48, on prompts of 50-90 tokens) cannot
    # show the fault: a position limit is only crossed by a longer context (judged against the healthy
    # export served at the same length)
    new_tokens: int | None = None


def _layer_cfg(c: dict) -> dict:
    """Where the Llama fields sit: speculators nests them under transformer_layer_config."""
    return c["transformer_layer_config"] if isinstance(c.get("transformer_layer_config"), dict) else c


def _rename(prefix_from: tuple[str, ...], prefix_to: str) -> Mutation:
    def m(c: dict, t: dict) -> None:
        for k in [k for k in t if k.startswith(prefix_from)]:
            t[prefix_to + k.split(".", 2 if k.startswith("layers.") else 1)[-1]] = t.pop(k)
    return m


def _drop(*keys: str) -> Mutation:
    def m(c: dict, t: dict) -> None:
        for k in keys:
            t.pop(k, None)
    return m


def _d2t_absolute(c: dict, t: dict) -> None:
    t["d2t"] = torch.arange(t["d2t"].numel()) + t["d2t"]  # the target ids themselves, not offsets


def _d2t_doubled(c: dict, t: dict) -> None:
    t["d2t"] = torch.arange(t["d2t"].numel())  # target = 2 * i: distinct, in range, and wrong


def _d2t_zeros(c: dict, t: dict) -> None:
    t["d2t"] = torch.zeros_like(t["d2t"])  # an unfilled buffer: draft id i read as target id i


def _foreign_ids(c: dict, t: dict) -> torch.Tensor:
    """Another valid draft vocabulary of the same size: N distinct target ids, ascending, drawn with
    a fixed seed from the whole target vocabulary (what a vocab built from other data gives the
    head: a valid map whose i-th id is not the one row i was trained for)."""
    n, V = int(t["d2t"].numel()), int(_layer_cfg(c)["vocab_size"])
    own = torch.arange(n) + t["d2t"].long()
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(V, generator=g)[:n].sort().values
    assert not torch.equal(ids, own)
    return ids


def _d2t_foreign(c: dict, t: dict) -> None:
    t["d2t"] = _foreign_ids(c, t) - torch.arange(t["d2t"].numel())  # t2d still marks the trained vocabulary


def _vocab_foreign(c: dict, t: dict) -> None:
    ids = _foreign_ids(c, t)
    t["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros_like(t["t2d"])
    t2d[ids] = True  # consistent with the new d2t; the lm_head rows stay those of the trained vocabulary
    t["t2d"] = t2d


def _t2d_other(c: dict, t: dict) -> None:
    n = int(t["d2t"].numel())
    t2d = torch.zeros_like(t["t2d"])
    t2d[:n] = True  # rebuilt alone for another vocabulary (the first N ids); d2t left as it was
    t["t2d"] = t2d


def _fc_narrow(c: dict, t: dict) -> None:
    t["fc.weight"] = t["fc.weight"][:, : 2 * t["fc.weight"].shape[0]].contiguous()  # (H, 2H): two aux states


def _aux_off(c: dict, t: dict) -> None:
    c["eagle_config"] = {"use_aux_hidden_state": False}


def _aux_ids(ids: list[int]) -> Mutation:
    def m(c: dict, t: dict) -> None:
        c["eagle_aux_hidden_state_layer_ids"] = list(ids)
    return m


def _meta_aux(ids: list[int]) -> Callable[[dict], None]:
    def m(meta: dict) -> None:
        meta["aux_layer_ids_hf"] = list(ids)
        if isinstance(meta.get("drafter_config"), dict):
            meta["drafter_config"]["aux_layer_ids"] = list(ids)
    return m


def _cfg(**fields) -> Mutation:
    def m(c: dict, t: dict) -> None:
        target = c if "draft_vocab_size" in fields else _layer_cfg(c)
        target.update(fields)
    return m


def _nan(c: dict, t: dict) -> None:
    key = next(k for k in t if k.endswith("mlp.down_proj.weight"))
    t[key] = t[key].clone()
    t[key][0, 0] = float("nan")


def _random_embed(c: dict, t: dict) -> None:
    g = torch.Generator().manual_seed(0)
    V, H = int(_layer_cfg(c)["vocab_size"]), int(_layer_cfg(c)["hidden_size"])
    t["embed_tokens.weight"] = torch.randn(V, H, generator=g) * 0.02  # an untrained, freshly initialised embedding


def _rope(theta: float, scaling: dict | None = None) -> Mutation:
    def m(c: dict, t: dict) -> None:
        lc = _layer_cfg(c)
        lc["rope_theta"] = theta
        lc["rope_scaling"] = dict(scaling) if scaling else None
        lc["rope_parameters"] = {"rope_theta": theta, "rope_type": "default", **(scaling or {})}
    return m


def _drop_cfg(key: str) -> Mutation:
    def m(c: dict, t: dict) -> None:
        c.pop(key, None)
    return m


VLLM, SPEC = ("vllm",), ("speculators",)
BOTH = ("vllm", "speculators")
FAULTS: tuple[Fault, ...] = (
    Fault("healthy", "the export as written", BOTH, lambda c, t: None, vllm="unaffected"),
    Fault("keys-layers0", "decoder layer stored as layers.0.* instead of midlayer.*", VLLM,
          _rename(("midlayer.",), "layers.0."), vllm="unaffected"),
    Fault("keys-midlayer", "decoder layer stored as midlayer.* in a speculators export", SPEC,
          _rename(("layers.0.",), "midlayer."), vllm="unaffected"),
    Fault("keys-unknown", "decoder layer stored under an unknown prefix (decoder.*)", VLLM,
          _rename(("midlayer.",), "decoder."), vllm="refuses"),
    # d2t broken while t2d still marks the trained vocabulary (d2t-absolute too). Served (both layouts alike,
    # healthy 3.66): the wrong-but-valid maps accept 1.00, the zero or missing d2t 1.92 (the first N ids
    # hold some of the trained ones), the consistent foreign vocabulary 1.00
    Fault("d2t-absolute", "d2t holds absolute target ids instead of offsets", BOTH, _d2t_absolute, vllm="fails"),
    Fault("d2t-doubled", "d2t = arange(N): valid, distinct, wrong target ids (target = 2i); t2d right", BOTH,
          _d2t_doubled, vllm="collapses"),
    Fault("d2t-zeros", "d2t all zeros (the first N target ids); t2d right", BOTH, _d2t_zeros, vllm="collapses"),
    Fault("d2t-dropped", "no d2t in the file; t2d right", BOTH, _drop("d2t"), vllm="collapses"),
    Fault("d2t-foreign", "d2t of another valid vocabulary of the same size; t2d right", BOTH, _d2t_foreign,
          vllm="collapses"),
    Fault("d2t-missing", "no d2t (and no t2d) in the file", BOTH, _drop("d2t", "t2d"), vllm="collapses"),
    Fault("vocab-foreign", "d2t and t2d of another valid, self-consistent vocabulary; lm_head rows unchanged",
          BOTH, _vocab_foreign, vllm="collapses"),
    Fault("t2d-inconsistent", "t2d rebuilt for another vocabulary; d2t unchanged", VLLM, _t2d_other, vllm="unaffected"),
    Fault("lm_head-missing", "no lm_head.weight", VLLM, _drop("lm_head.weight"), vllm="collapses"),
    Fault("norm-missing", "no norm.weight (final norm)", VLLM, _drop("norm.weight"), vllm="unaffected"),
    Fault("fc-width", "fc.weight is (H, 2H): fused from two aux states, config says three", VLLM, _fc_narrow,
          vllm="refuses"),
    Fault("aux-disabled", "eagle_config.use_aux_hidden_state = false", VLLM, _aux_off, vllm="collapses"),
    Fault("aux-out-of-range", "trained on aux ids [2, 15, 31] of a deeper target; served on 30 layers", VLLM,
          _aux_ids([2, 15, 31]), needs_target=True, meta=_meta_aux([2, 15, 31]), vllm="fails"),
    Fault("config-intermediate", "config intermediate_size 2048, weights 1536", VLLM,
          _cfg(intermediate_size=2048), vllm="refuses"),
    Fault("config-draft-vocab", "config draft_vocab_size 4096, lm_head has 2048 rows", VLLM,
          _cfg(draft_vocab_size=4096), vllm="refuses"),
    Fault("nan-weights", "one NaN in mlp.down_proj.weight", VLLM, _nan, vllm="collapses"),
    Fault("embed-random", "a random embed_tokens.weight shipped in the file", BOTH, _random_embed,
          needs_target=True, vllm="collapses"),
    Fault("max-positions", "max_position_embeddings 64 (target: 8192)", VLLM, _cfg(max_position_embeddings=64),
          vllm="collapses"),
    # Served: 3.66 at 48 tokens (as the healthy export: no context reaches 256), 1.21 over 512 tokens against
    # the healthy 1.54 at that length (collapse: below 1.27). vLLM raises the field for the rotary cache but
    # drafts k zeros, never accepted, once a sequence passes the drafter's max_model_len (min of the field and
    # the target's; docs/results/cpu-amx.md, bench/positions_vs_vllm.py)
    Fault("short-positions", "max_position_embeddings 256 (target: 8192); served 512 tokens past the prompt", BOTH,
          _cfg(max_position_embeddings=256), needs_target=True, vllm="collapses", new_tokens=512),
    Fault("rope-theta", "rope_theta 10000 (trained with the target's 100000)", VLLM, _rope(10000.0), vllm="unaffected"),
    Fault("rope-scaling", "linear RoPE scaling x4 added", VLLM,
          _rope(100000.0, {"rope_type": "linear", "factor": 4.0}), vllm="unaffected"),
    Fault("rms-eps", "rms_norm_eps 1e-6 (trained with 1e-5)", VLLM, _cfg(rms_norm_eps=1e-6), vllm="unaffected"),
    Fault("nbr-absent", "no norm_before_residual in a speculators config (vLLM then reads true)", SPEC,
          _drop_cfg("norm_before_residual"), vllm="unaffected"),
)


def by_name(name: str) -> Fault:
    for f in FAULTS:
        if f.name == name:
            return f
    raise KeyError(f"unknown fault {name!r}; choose one of {', '.join(f.name for f in FAULTS)}")


def build(fault: Fault, healthy: Path, out: Path) -> Path:
    """Copy the healthy export `healthy` to `out` and break it as `fault` says."""
    from safetensors.torch import save_file

    healthy, out = Path(healthy), Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(healthy, out)
    config = ckpt_io.read_json(out / "config.json")
    tensors, _ = ckpt_io.read_weights(out)
    tensors = dict(tensors)
    fault.mutate(config, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fault.meta is not None and (out / "eyas.json").is_file():
        meta = ckpt_io.read_json(out / "eyas.json")
        fault.meta(meta)
        (out / "eyas.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
