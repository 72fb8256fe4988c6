"""Strict import: a drafter directory of any layout into eyas terms (DrafterConfig, tensors under
eyas names, what was read from where). Missing keys, shapes against config.json, bad vocabulary
maps and what eyas cannot compute raise EyasError naming the file and the fix."""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.core import vocab as core_vocab
from eyas.core.drafter import ACTIVATIONS, DrafterConfig, default_aux_layers
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io
from eyas.formats.engines import configs
from eyas.formats.engines.reading import (detect_layout, eyas_name, expected_shapes, num_layers, read_dir,
                                          target_config)
from eyas.formats.engines.spec import EYAS, EYAS_PREFIXES, LAYOUTS, spec

# Keys a peer stores beside the drafter that eyas does not need (the verifier's own head and norm).
BENIGN = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def native_config(raw: dict, layout: str, layers: int | None, where: str) -> tuple[DrafterConfig, str]:
    """The DrafterConfig a directory of `layout` means when served by its own engine, and where
    its aux ids came from. Peer flags are honoured wherever they are written."""
    if layout == EYAS:
        return ckpt_io.read_config(Path(where).parent), "eyas config (HF index)"
    s = spec(layout)
    if configs.is_speculators(raw) and not raw.get("transformer_layer_config"):
        raise EyasError(f"{where}: speculators config without transformer_layer_config; re-save it with "
                        "speculators or pass --from with the right layout")
    c = configs.speculators_as_is(raw)[0] if configs.is_speculators(raw) else raw
    read = s.aux.read(c)
    if read.hf is not None:
        ids, src = read.hf, read.source + (f" (+{s.aux.fields[0].offset}, {layout})" if s.aux.fields[0].offset
                                           and read.source == s.aux.fields[0].path else "")
    elif layers:
        ids, src = default_aux_layers(layers), f"engine default [2, L//2, L-3] of the target (L={layers})"
    else:
        raise EyasError(f"{where}: no aux layer ids recorded ({' or '.join(f.path for f in s.aux.fields)}); "
                        "pass --target so the engines' default [2, L//2, L-3] can be resolved")
    f = configs.flat_fields(c, where)
    flags = {k: bool(raw.get(k, c.get(k, False))) for k in configs.FLAGS}
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise EyasError(f"{where}: norm_before_fc and fc_norm are both true; they are exclusive, fix config.json")
    cfg = DrafterConfig(target_hidden_size=int(c.get("target_hidden_size") or f["hidden_size"]), aux_layer_ids=ids,
                        draft_vocab_size=int(c.get("draft_vocab_size") or f["vocab_size"]), **f, **flags)
    return cfg, src


def _shape_hint(key: str, cfg: DrafterConfig) -> str:
    if key in ("lm_head.weight", "d2t"):
        return f"draft_vocab_size={cfg.draft_vocab_size}, hidden_size={cfg.hidden_size}"
    if key == "fc.weight":
        return (f"{len(cfg.aux_layer_ids)} aux layers x target_hidden_size={cfg.target_hidden_size}, "
                f"hidden_size={cfg.hidden_size}")
    if key == "t2d":
        return f"vocab_size={cfg.vocab_size}"
    return (f"hidden_size={cfg.hidden_size}, heads={cfg.num_attention_heads}/{cfg.num_key_value_heads}, "
            f"head_dim={cfg.head_dim}, intermediate_size={cfg.intermediate_size}")


def _check_tensors(state: dict, shapes: dict, cfg: DrafterConfig, layout: str, wfile: Path) -> None:
    extra = sorted(k for k in state if k not in shapes and k not in BENIGN)
    if extra:
        raise EyasError(f"{wfile}: unexpected keys {extra[:6]} for a one-layer EAGLE-3 drafter in {layout} layout "
                        "(a second decoder layer or an unknown norm?); pass --from with the right layout or "
                        "remove them")
    missing = sorted(k for k in shapes if k not in state)
    if missing:
        raise EyasError(f"{wfile}: missing required keys {missing[:6]}; the checkpoint is incomplete "
                        f"(a {layout} drafter must hold {', '.join(sorted(shapes)[:4])}, ...); re-export it")
    for k, want in shapes.items():
        if tuple(state[k].shape) != want:
            raise EyasError(f"{wfile}: {k} has shape {tuple(state[k].shape)} but config.json implies {want} "
                            f"({_shape_hint(k, cfg)}); fix config.json or the weights so they agree")


def import_checkpoint(ckpt_dir: Path, layout: str | None = None,
                      target: Path | None = None) -> tuple[DrafterConfig, dict[str, torch.Tensor], dict]:
    """Read a drafter of any layout into eyas terms, strictly: every required key present, every
    shape agreeing with config.json, vocab maps valid (EyasError naming the key and the fix)."""
    ckpt = Path(ckpt_dir)
    layout = layout or detect_layout(ckpt)
    if layout not in LAYOUTS:
        raise EyasError(f"--from {layout!r}: unknown layout; choose one of {', '.join(LAYOUTS)}")
    raw, file_state, wfile = read_dir(ckpt)
    cfg, aux_src = native_config(raw, layout, num_layers(target_config(target)), str(ckpt / "config.json"))
    if cfg.hidden_act not in ACTIVATIONS:
        raise EyasError(f"{ckpt / 'config.json'}: hidden_act={cfg.hidden_act!r}, but the EAGLE-3 layer eyas, vLLM "
                        f"and SGLang build computes {'/'.join(ACTIVATIONS)} only (vLLM and SGLang refuse another); "
                        "a drafter trained with it cannot be served: retrain it with SiLU")
    prefixes = EYAS_PREFIXES if layout == EYAS else spec(layout).layer_prefixes
    state = {eyas_name(k, prefixes): t for k, t in file_state.items()}
    shapes = expected_shapes(cfg)
    if "d2t" not in state and "t2d" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        # speculators stores no maps when the draft vocabulary is the whole vocabulary
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    _check_tensors(state, shapes, cfg, layout, wfile)
    state["d2t"], state["lm_head.weight"], moved = core_vocab.sort_map(state["d2t"], state["t2d"],
                                                                        state["lm_head.weight"])
    try:
        core_vocab.check_maps(state["d2t"].long(), state["t2d"].bool())
    except EyasError as e:
        raise EyasError(f"{wfile}: d2t/t2d invalid ({e}); d2t must hold offsets (target = i + d2t[i]); "
                        f"`eyas doctor {ckpt} --target T` tells which map the head was trained with") from e
    out = {k: state[k] for k in shapes}
    out["d2t"], out["t2d"] = out["d2t"].long(), out["t2d"].bool()
    meta = {"layout": layout, "source": str(ckpt), "weights_file": wfile.name, "aux_layer_ids_source": aux_src,
            "has_embed_tokens": "embed_tokens.weight" in state}
    if moved:
        meta["note"] = (f"d2t listed its {cfg.draft_vocab_size} target ids out of ascending order (engines serve that "
                        "as is); eyas sorted them and moved the lm_head rows with them: the same drafter")
    if layout == EYAS and (ckpt / "eyas.json").is_file():
        meta["eyas"] = ckpt_io.read_json(ckpt / "eyas.json")
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if verifier:
        meta["verifier"] = verifier
    return cfg, out, meta
