"""What a checkpoint directory holds, and what each serving engine makes of it, for the doctor.

`RawCheckpoint` is the directory as written (config.json, tensors, eyas.json), for the checks
that look at the file itself. What an engine would load from it is not decided here: it is
`eyas.formats.engines` (`detect_layout`, `engine_reading`), the same tables the exporters
write with, so the doctor and `eyas export` can never disagree about a checkpoint. When that
strict reading fails for an engine, the failure is returned with its message (the doctor
reports it as an error); there is no second, lenient reading to fall back on.

`intended_aux_ids` is the doctor's own question (which layers the author trained on, from
eyas.json or the layout's native field), asked to compare with what each engine captures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.formats import engines
from eyas.formats.checkpoint import read_json, read_weights, weights_label
from eyas.formats.engines import EngineReading

__all__ = ["EngineReading", "RawCheckpoint", "read_raw", "detect_layout", "engine_views", "intended_aux_ids",
           "REQUIRED"]

# The weights every EAGLE-3 drafter holds, in eyas names (the engine tables' layer keys).
REQUIRED = tuple(f"midlayer.{k}" for k in engines.LAYER_KEYS) + ("fc.weight", "norm.weight", "lm_head.weight")


@dataclass
class RawCheckpoint:
    path: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    meta: dict  # eyas.json, {} when absent
    weights_file: Path

    @property
    def training(self) -> dict:
        """What eyas recorded when it trained the drafter: an export's eyas.json keeps it under
        `trained` (stages/export.py), a checkpoint's eyas.json is it ({} for other tools' drafters)."""
        return self.meta["trained"] if isinstance(self.meta.get("trained"), dict) else self.meta

    def canonical(self) -> dict[str, torch.Tensor]:
        """Tensors under eyas names whichever decoder prefix the file uses (`model.` stripped)."""
        return engines.to_eyas_names(self.tensors)


def read_raw(ckpt: Path) -> RawCheckpoint:
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise EyasError(f"{ckpt}: not a directory; pass a drafter checkpoint directory")
    tensors, files = read_weights(ckpt)
    cfg_file = ckpt / "config.json"
    config = read_json(cfg_file) if cfg_file.is_file() else {}
    meta_file = ckpt / "eyas.json"
    meta = read_json(meta_file) if meta_file.is_file() else {}
    return RawCheckpoint(ckpt, config, tensors, meta, weights_label(files))


def detect_layout(raw: RawCheckpoint) -> tuple[str, str]:
    """(layout, '') as `eyas.formats.engines.detect_layout` decides it, or ('unknown', its message)."""
    try:
        return engines.detect_layout(raw.path), ""
    except EyasError as e:
        return "unknown", str(e)


def engine_views(raw: RawCheckpoint, engine_names: list[str]) -> tuple[dict[str, EngineReading], dict[str, str]]:
    """Per engine, `eyas.formats.engines.engine_reading` of the directory, read without the target
    (`aux_layer_ids_hf is None`: the config gives that engine no ids, it captures the target's
    default). Returns (readings, {engine: message} for engines whose reading failed)."""
    views, failed = {}, {}
    for e in engine_names:
        try:
            views[e] = engines.engine_reading(raw.path, e)
        except EyasError as err:
            failed[e] = str(err)
    return views, failed


def intended_aux_ids(raw: RawCheckpoint, layout: str) -> tuple[list[int] | None, str]:
    """The HF-index aux ids the checkpoint's author meant, and where that was read: eyas.json's
    record, else the layout's own engine's reading of config.json (its spec's convention)."""
    m = raw.meta
    for key in ("aux_layer_ids_hf", "aux_layer_ids"):
        if isinstance(m.get(key), list):
            return [int(i) for i in m[key]], f"eyas.json {key}"
    if layout == engines.EYAS:
        ids = raw.config.get("aux_layer_ids")
        return ([int(i) for i in ids], "config.json aux_layer_ids") if isinstance(ids, list) else (None, "")
    if layout not in engines.ENGINES:
        return None, ""
    read = engines.spec(layout).aux.read(raw.config)
    return (read.hf, f"config.json {read.source} ({layout}'s convention)") if read.hf else (None, "")
