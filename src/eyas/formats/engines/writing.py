"""Writing a drafter (eyas names) in an engine's layout, as that engine's spec says: weight
prefix, config style and aux-id convention, explicit flags, the embedding where it must be
shipped, safetensors or a .bin."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.core.drafter import DrafterConfig
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io
from eyas.formats.engines.importing import import_checkpoint
from eyas.formats.engines.spec import EYAS, LAYOUTS, EngineSpec, set_path, spec
from eyas.formats.target_weights import target_embedding

def engine_config(cfg: DrafterConfig, fmt: str, dtype: torch.dtype = torch.float32,
                  verifier: str | None = None, verifier_arch: list[str] | None = None) -> dict:
    """config.json for engine layout `fmt`."""
    s = spec(fmt)
    aux = s.aux.write(list(cfg.aux_layer_ids))
    if s.writes_use_aux:
        _merge(aux, set_path("eagle_config.use_aux_hidden_state", True))
    return s.write_config(cfg, dtype, s.architectures, aux, s.explicit_flags, verifier, list(verifier_arch or []))


def _merge(into: dict, more: dict) -> None:
    for k, v in more.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def needs_embedding(cfg: DrafterConfig, fmt: str) -> bool:
    """Whether layout `fmt` must carry embed_tokens.weight: always (speculators stores it, as it saves
    its own drafters), or only when the engine cannot share the target's (the hidden sizes differ)."""
    s = spec(fmt)
    return s.writes_embed == "always" or cfg.target_hidden_size != cfg.hidden_size


def _add_embedding(cfg: DrafterConfig, s: EngineSpec, tensors: dict, target: Path | None) -> tuple[str, list]:
    if target is None:
        why = (f"{s.name} reads the verifier's config and embedding from the target directory"
               if s.writes_embed == "always" else "the drafter's hidden size differs from the target's, so the "
               "engine cannot share the target's embedding")
        raise EyasError(f"--to {s.name} needs --target ({why}); pass the target directory or built-in name")
    emb, tdir = target_embedding(target)
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise EyasError(f"--target {target}: embedding {tuple(emb.shape)} but the drafter expects "
                        f"({cfg.vocab_size}, {cfg.hidden_size}); pass the drafter's own target")
    tensors["embed_tokens.weight"] = emb.to(tensors["fc.weight"].dtype).contiguous()
    return str(tdir), ckpt_io.read_json(tdir / "config.json").get("architectures") or []


def write_layout(cfg: DrafterConfig, state: dict[str, torch.Tensor], fmt: str, out: Path,
                 target: Path | None = None, meta: dict | None = None) -> list[str]:
    """Write a drafter (eyas names) into the existing empty directory `out` in layout `fmt`;
    `target`: the target's directory (resolved by the caller). Returns notes (what was added).
    Atomicity is the caller's (stages.common.atomic_dir)."""
    from safetensors.torch import save_file

    out, notes, meta = Path(out), [], dict(meta or {})
    if fmt not in LAYOUTS:
        raise EyasError(f"--to {fmt!r}: unknown format; choose one of {', '.join(LAYOUTS)}")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if fmt == EYAS:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": ckpt_io.FORMAT})
        body = {"format": ckpt_io.FORMAT, "version": ckpt_io.VERSION, **cfg.to_dict()}
        (out / "config.json").write_text(json.dumps(body, indent=2) + "\n")
        (out / "eyas.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        return notes
    s = spec(fmt)
    verifier, verifier_arch = None, []
    if needs_embedding(cfg, fmt):
        verifier, verifier_arch = _add_embedding(cfg, s, tensors, target)
        notes.append(f"embed_tokens.weight added from {verifier}")
    named = {(s.write_prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in tensors.items()}
    config = engine_config(cfg, fmt, tensors["fc.weight"].dtype, verifier, verifier_arch)
    if s.weights_format == "bin":
        torch.save(named, out / "pytorch_model.bin")
    else:
        save_file(named, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    meta.update({"exported_as": fmt, "drafter_config": cfg.to_dict(), "aux_layer_ids_hf": list(cfg.aux_layer_ids)})
    (out / "eyas.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return notes


def export_checkpoint(ckpt_dir_eyas: Path, fmt: str, out: Path, target: Path | None = None) -> list[str]:
    """Export an eyas checkpoint to `fmt` into the existing empty directory `out` (notes returned)."""
    cfg, state, meta = import_checkpoint(ckpt_dir_eyas, EYAS)
    return write_layout(cfg, state, fmt, out, target, {"source": str(ckpt_dir_eyas), **meta.get("eyas", {})})
