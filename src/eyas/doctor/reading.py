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

    def canonical(self) -> dict[str, torch.Tensor]:
        """Tensors under eyas names whichever decoder prefix the file uses (`model.` stripped)."""
        out = {}
        for k, v in self.tensors.items():
            k2 = k[6:] if k.startswith("model.") else k
            if k2.startswith("layers.0."):
                k2 = "midlayer." + k2[len("layers.0."):]
            out.setdefault(k2, v)
        return out


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
    """The HF-index aux ids the checkpoint's author meant, and where that was read."""
    m = raw.meta
    for key in ("aux_layer_ids_hf", "aux_layer_ids"):
        if isinstance(m.get(key), list):
            return [int(i) for i in m[key]], f"eyas.json {key}"
    c = raw.config
    if layout == "eyas" and isinstance(c.get("aux_layer_ids"), list):
        return [int(i) for i in c["aux_layer_ids"]], "config.json aux_layer_ids"
    if isinstance(c.get("eagle_aux_hidden_state_layer_ids"), list):
        return [int(i) for i in c["eagle_aux_hidden_state_layer_ids"]], "config.json eagle_aux_hidden_state_layer_ids"
    ec = c.get("eagle_config") if isinstance(c.get("eagle_config"), dict) else {}
    if isinstance(ec.get("eagle_aux_hidden_state_layer_ids"), list):
        return [int(i) + 1 for i in ec["eagle_aux_hidden_state_layer_ids"]], \
            "config.json eagle_config.eagle_aux_hidden_state_layer_ids (+1, SGLang)"
    return None, ""
