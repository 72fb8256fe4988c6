"""Draft-vocabulary files (`vocab.safetensors`: `d2t` int64 [N] offsets, `t2d` bool [V],
metadata strings) and the vocabulary tensors inside drafter checkpoint directories
(`d2t`, `t2d`, `lm_head.weight`, the same top-level names in eyas, SGLang/EAGLE and
speculators layouts). Every read validates DESIGN 4's invariants.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.core import vocab as core
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io

FORMAT = "eyas.vocab"
VERSION = 1
VOCAB_KEYS = ("d2t", "t2d", "lm_head.weight")


@dataclass
class VocabMap:
    """A draft vocabulary: `target_id = i + d2t[i]`, `t2d[j]` true iff j is a draft token."""

    d2t: torch.Tensor  # (N,) int64 offsets
    t2d: torch.Tensor  # (V,) bool
    meta: dict = field(default_factory=dict)

    @property
    def draft_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_size(self) -> int:
        return self.t2d.numel()

    @property
    def target_ids(self) -> torch.Tensor:
        return core.target_ids(self.d2t)


def vocab_fingerprint(d2t: torch.Tensor, target_size: int) -> str:
    """Short stable id of a draft vocabulary (its target ids and the target vocabulary size)."""
    h = hashlib.sha256(f"{target_size}:".encode())
    h.update(core.target_ids(d2t).numpy().astype("<i8").tobytes())
    return h.hexdigest()[:16]


def save_vocab(path: Path, vm: VocabMap) -> None:
    """Write `vm` atomically as one safetensors file; metadata values become strings."""
    from safetensors.torch import save_file

    core.check_maps(vm.d2t, vm.t2d)
    meta = {"format": FORMAT, "version": str(VERSION), "target_vocab_size": str(vm.target_size),
            "draft_vocab_size": str(vm.draft_size), "fingerprint": vocab_fingerprint(vm.d2t, vm.target_size)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in vm.meta.items() if k not in meta})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file({"d2t": vm.d2t.long().contiguous(), "t2d": vm.t2d.bool().contiguous()}, str(tmp), metadata=meta)
        ckpt_io.share(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # nothing stray beside --out if the write or the rename failed


def _decode_meta(meta: dict) -> dict:
    out = {}
    for k, v in (meta or {}).items():
        try:
            out[k] = json.loads(v)
        except (json.JSONDecodeError, TypeError):
            out[k] = v
    return out


def load_vocab(path: Path, target_size: int | None = None) -> VocabMap:
    """Read and validate a vocab file (EyasError naming the file and the fix otherwise)."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise EyasError(f"vocab file {path} is a directory; pass the vocabulary file itself (`eyas vocab build` "
                        f"writes one .safetensors file, e.g. {path / 'vocab.safetensors'})")
    if not path.is_file():
        raise EyasError(f"vocab file {path} does not exist; build one with `eyas vocab build`")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys, meta = set(f.keys()), f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in ("d2t", "t2d") if k in keys}
    except Exception as e:  # safetensors raises several types for a damaged file
        raise EyasError(f"vocab file {path} is not a readable safetensors file ({e}); rebuild it") from e
    missing = [k for k in ("d2t", "t2d") if k not in tensors]
    if missing:
        raise EyasError(f"vocab file {path} lacks {missing}; it must hold d2t and t2d (eyas vocab build)")
    meta = _decode_meta(meta)
    declared = meta.get("target_vocab_size")
    if isinstance(declared, int) and declared != tensors["t2d"].numel():
        raise EyasError(f"vocab file {path}: metadata says target vocab {declared} but t2d has "
                        f"{tensors['t2d'].numel()} entries; rebuild it")
    try:
        core.check_maps(tensors["d2t"], tensors["t2d"], target_size)
    except EyasError as e:
        raise EyasError(f"vocab file {path}: {e}") from e
    return VocabMap(tensors["d2t"].long(), tensors["t2d"].bool(), meta)


# ---------------------------------------------------------------- inside checkpoints


def read_checkpoint_vocab(ckpt: Path, need_head: bool = True) -> dict[str, torch.Tensor]:
    """`d2t`, `t2d` and `lm_head.weight` of a drafter checkpoint directory (any layout, one
    weights file or shards). Without `need_head` only the maps: a speculators checkpoint may
    leave out its head (it then uses the verifier's) and, when it drafts over the whole
    vocabulary, its maps (identity)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise EyasError(f"checkpoint {ckpt} is not a directory; pass a drafter checkpoint directory")
    got, files = ckpt_io.read_weights(ckpt, keys=VOCAB_KEYS)
    f = ckpt_io.weights_label(files)
    if not need_head and "d2t" not in got and "t2d" not in got:
        full = _full_vocabulary(ckpt)
        if full is not None:
            got.update(d2t=torch.zeros(full, dtype=torch.long), t2d=torch.ones(full, dtype=torch.bool))
    missing = [k for k in VOCAB_KEYS if k not in got and (need_head or k != "lm_head.weight")]
    if missing:
        raise EyasError(f"checkpoint {f} lacks {missing}; a drafter must store d2t, t2d and lm_head.weight "
                        "(eyas convert can add them)")
    if "lm_head.weight" in got and got["lm_head.weight"].shape[0] != got["d2t"].numel():
        raise EyasError(f"checkpoint {f}: lm_head has {got['lm_head.weight'].shape[0]} rows but d2t maps "
                        f"{got['d2t'].numel()} draft ids; the checkpoint is inconsistent")
    # ids listed in another order (engines serve that as is): ascending, the head rows moved along
    got["d2t"], head, _ = core.sort_map(got["d2t"], got["t2d"], got.get("lm_head.weight"))
    if head is not None:
        got["lm_head.weight"] = head
    try:
        core.check_maps(got["d2t"], got["t2d"])
    except EyasError as e:
        raise EyasError(f"checkpoint {f}: {e}") from e
    return got


def read_maps_as_stored(ckpt: Path) -> tuple[dict[str, torch.Tensor], int | None]:
    """(whichever of `d2t`, `t2d`, `lm_head.weight` a drafter directory stores, unchecked; the target
    vocabulary size its config.json names): what `eyas vocab repair` starts from."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise EyasError(f"checkpoint {ckpt} is not a directory; pass a drafter checkpoint directory")
    got, _ = ckpt_io.read_weights(ckpt, keys=VOCAB_KEYS)
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    inner = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    V = cfg.get("vocab_size") or inner.get("vocab_size")
    return got, int(V) if isinstance(V, int) else None


def _full_vocabulary(ckpt: Path) -> int | None:
    """The target vocabulary size when config.json says the drafter drafts over all of it."""
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        return None
    inner = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    V = cfg.get("target_vocab_size") or cfg.get("vocab_size") or inner.get("vocab_size")
    N = cfg.get("draft_vocab_size") or V
    return int(V) if isinstance(V, int) and N == V else None


def load_any(path: Path) -> VocabMap:
    """A vocab file or a drafter checkpoint directory, as a VocabMap."""
    path = Path(path)
    if path.is_dir():
        t = read_checkpoint_vocab(path, need_head=False)
        return VocabMap(t["d2t"].long(), t["t2d"].bool(), {"source": "checkpoint"})
    return load_vocab(path)


def write_remapped_checkpoint(src: Path, out: Path, tensors: dict[str, torch.Tensor], vm: VocabMap) -> None:
    """Copy checkpoint `src` to `out` (a fresh directory) replacing `d2t`, `t2d`,
    `lm_head.weight` in the weights file (or shard) that holds each (added where none does),
    `draft_vocab_size` in its config.json (and the shards' index), and the vocabulary recorded in
    its eyas.json when it has one (`vm`: the new vocabulary). One shard in memory at a time."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    files = ckpt_io.weight_files(src)
    shutil.copytree(src, out, dirs_exist_ok=True)
    grown = 0  # bytes the replaced tensors add
    # keys no shard holds (the head of a drafter that scored with the verifier's) go to the last one
    held = set().union(*(ckpt_io.safetensors_header(f)[0] for f in files)) if len(files) > 1 else set()
    new = {k for k in tensors if k not in held}
    for f in files:
        sd = ckpt_io.read_tensors(f)
        mine = {k: v.contiguous() for k, v in tensors.items() if k in sd or (k in new and f == files[-1])}
        if not mine:
            continue
        grown += sum(v.numel() * v.element_size() - (sd[k].numel() * sd[k].element_size() if k in sd else 0)
                     for k, v in mine.items())
        sd.update(mine)
        if f.suffix == ".safetensors":
            save_file(sd, str(out / f.name), metadata=ckpt_io.safetensors_header(f)[1])
        else:
            torch.save(sd, out / f.name)
    index = out / ckpt_io.SHARD_INDEX
    if len(files) > 1 and index.is_file():
        idx = json.loads(index.read_text())
        if isinstance(idx.get("metadata"), dict) and isinstance(idx["metadata"].get("total_size"), int):
            idx["metadata"]["total_size"] += grown
        idx["weight_map"].update({k: files[-1].name for k in new})
        index.write_text(json.dumps(idx, indent=2) + "\n")
    cfg_file = out / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        cfg["draft_vocab_size"] = int(tensors["d2t"].numel())
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    meta_file = out / "eyas.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        meta["vocab_fingerprint"] = vocab_fingerprint(vm.d2t, vm.target_size)
        meta["draft_vocab_size"] = vm.draft_size
        if isinstance(meta.get("trained"), dict):  # an export keeps the training record there (doctor reads it)
            meta["trained"]["vocab_fingerprint"] = meta["vocab_fingerprint"]
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
