"""The eyas drafter checkpoint: `config.json` (DrafterConfig) + `model.safetensors` (engine
names, no embedding) + `eyas.json` (provenance). Also the one tensor reader for every
checkpoint file eyas accepts (safetensors, or `.bin` through `torch.load(weights_only=True)`,
which refuses anything but tensors: an untrusted pickle never runs).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eyas.core import vocab as core_vocab
from eyas.core.drafter import ACTIVATIONS, DrafterConfig, Eagle3Drafter
from eyas.errors import EyasError

FORMAT = "eyas.drafter"
VERSION = 1
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"


def share(path: Path) -> None:
    """Give a file, or a directory and all under it, the modes the user's umask gives new files
    (0644 / 0755 by default). safetensors writes 0600 files and mkdtemp makes 0700 directories,
    so an engine serving as another user (a container) could not read what eyas wrote."""
    mask = os.umask(0)
    os.umask(mask)
    path = Path(path)
    for p in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else [])]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def read_tensors(path: Path, keys=None) -> dict[str, torch.Tensor]:
    """All tensors of a weights file (safetensors, or a tensor-only `.bin`/`.pt`), or only those
    of `keys` that it holds (a safetensors file then reads no other tensor)."""
    path = Path(path)
    if not path.is_file():
        raise EyasError(f"{path}: no such weights file")
    if path.suffix == ".safetensors":
        try:
            if keys is None:
                return load_file(path)
            with safe_open(str(path), framework="pt") as h:
                return {k: h.get_tensor(k) for k in keys if k in h.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise EyasError(f"{path}: not a readable safetensors file ({e}); re-export it") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise EyasError(f"{path}: refused to load (only plain tensors are accepted, never code): "
                        f"{str(e).splitlines()[0][:200]}; convert it to safetensors where it was made") from e
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise EyasError(f"{path}: expected a dict of tensors; got {type(obj).__name__}")
    return obj if keys is None else {k: obj[k] for k in keys if k in obj}


def safetensors_header(path: Path) -> tuple[list[str], dict[str, str] | None]:
    """(tensor names, metadata) of a safetensors file, without reading any tensor."""
    try:
        with safe_open(str(path), framework="pt") as h:
            return list(h.keys()), h.metadata()
    except (SafetensorError, OSError, ValueError) as e:
        raise EyasError(f"{path}: not a readable safetensors file ({e}); re-export it") from e


def weight_files(ckpt: Path, names: tuple[str, ...] = WEIGHT_FILES) -> list[Path]:
    """The weights of a checkpoint directory: the first of `names` present, else the shards
    that `model.safetensors.index.json` names (else `model-*-of-*.safetensors`), all present."""
    ckpt = Path(ckpt)
    for name in names:
        if (ckpt / name).is_file():
            return [ckpt / name]
    index = ckpt / SHARD_INDEX
    if index.is_file():
        wmap = read_json(index).get("weight_map")
        if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
            raise EyasError(f"{index}: no weight_map of tensor names to shard files; re-save the checkpoint")
        files = sorted({ckpt / v for v in wmap.values()})
        gone = [f.name for f in files if not f.is_file()]
        if gone:
            raise EyasError(f"{index} names {len(gone)} missing shard(s) ({', '.join(gone[:3])}); "
                            "copy the complete checkpoint directory")
        return files
    shards = sorted(ckpt.glob("model-*-of-*.safetensors"))
    if shards:
        return shards
    raise EyasError(f"{ckpt}: no {' or '.join(names)} and no sharded model-*-of-*.safetensors; "
                    f"pass a drafter checkpoint directory{run_hint(ckpt)}")


def run_hint(d: Path) -> str:
    """For an `eyas train` run directory given where a checkpoint belongs: which to pass."""
    found = [str(Path(d) / n) for n in ("best", "final") if (Path(d) / n / "config.json").is_file()]
    return f" ({d} is a training run: pass {' or '.join(found)})" if found else ""


def weights_label(files: list[Path]) -> Path:
    """The path messages name for these weights: the file, or the shards' index (or first shard)."""
    if len(files) == 1:
        return files[0]
    index = files[0].parent / SHARD_INDEX
    return index if index.is_file() else files[0]


def read_weights(ckpt: Path, names: tuple[str, ...] = WEIGHT_FILES,
                 keys=None) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """(tensors, files) of a checkpoint directory, one file or shards (`weight_files`);
    `keys` limits what is read. A tensor stored in two shards is refused."""
    files = weight_files(ckpt, names)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        part = read_tensors(f, keys)
        twice = sorted(set(part) & set(state))
        if twice:
            raise EyasError(f"{f}: {twice[:3]} also stored in another shard; the checkpoint is inconsistent")
        state.update(part)
    return state, files


def read_json(path: Path) -> dict:
    """A JSON object from `path`, with the file named on any error."""
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise EyasError(f"{path}: missing; pass a complete checkpoint directory{run_hint(Path(path).parent)}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{path}: not valid JSON ({e}); the file is corrupt, re-export it") from e
    if not isinstance(obj, dict):
        raise EyasError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def is_eyas_checkpoint(ckpt: Path) -> bool:
    f = Path(ckpt) / "config.json"
    try:
        cfg = json.loads(f.read_text()) if f.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(cfg, dict) and cfg.get("format") == FORMAT


def save_checkpoint(out: Path, drafter: Eagle3Drafter, meta: dict, dtype: torch.dtype | None = None) -> None:
    """Write an eyas checkpoint atomically (temp dir + rename; replaces `out`)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp.", dir=out.parent))
    try:
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in drafter.trainable_state_dict().items()}
        save_file(state, tmp / "model.safetensors", metadata={"format": FORMAT})
        cfg = {"format": FORMAT, "version": VERSION, **drafter.cfg.to_dict()}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "eyas.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        share(tmp)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sweep_partial(parent: Path) -> list[str]:
    """Remove what a killed `save_checkpoint` left in `parent` (`.NAME.tmp.*`, `.NAME.old`
    directories); finished checkpoints are never touched. A `.NAME.old` whose NAME is gone (killed
    between moving the old checkpoint aside and the new one in) goes back to NAME instead: it is
    the last complete one. Returns the names removed or restored."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    junk = [p for p in parent.iterdir() if p.is_dir() and p.name.startswith(".")
            and (".tmp." in p.name or p.name.endswith(".old"))]
    for p in junk:
        back = parent / p.name[1:].removesuffix(".old")
        if p.name.endswith(".old") and not back.exists():
            p.rename(back)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return sorted(p.name for p in junk)


def read_config(ckpt: Path) -> DrafterConfig:
    cfg = read_json(Path(ckpt) / "config.json")
    if cfg.get("format") != FORMAT:
        raise EyasError(f"{ckpt}/config.json: not an eyas checkpoint (format={cfg.get('format')!r}); "
                        "use `eyas convert` for other layouts")
    if cfg.get("version") != VERSION:
        raise EyasError(f"{ckpt}/config.json: eyas checkpoint version {cfg.get('version')} is not {VERSION}; "
                        "upgrade eyas or re-export")
    body = {k: v for k, v in cfg.items() if k not in ("format", "version")}
    try:
        cfg = DrafterConfig.from_dict(body)
    except (TypeError, ValueError) as e:
        raise EyasError(f"{ckpt}/config.json: {e}; re-export the checkpoint") from e
    if cfg.hidden_act not in ACTIVATIONS:
        raise EyasError(f"{ckpt}/config.json: hidden_act={cfg.hidden_act!r}, but the drafter layer computes "
                        f"{'/'.join(ACTIVATIONS)} only; set it back to \"silu\" (the weights were trained with it)")
    return cfg


def load_checkpoint(ckpt: Path, target_embedding: torch.Tensor | None = None) -> tuple[Eagle3Drafter, dict]:
    """Load an eyas checkpoint. The embedding stays unloaded unless `target_embedding` is given."""
    ckpt = Path(ckpt)
    cfg = read_config(ckpt)
    state = read_tensors(ckpt / "model.safetensors")
    drafter = Eagle3Drafter(cfg)
    want = set(drafter.trainable_state_dict())
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise EyasError(f"{ckpt}/model.safetensors: missing keys {missing[:6]}, unexpected keys {extra[:6]}; "
                        "the file does not match its config.json")
    for k, v in drafter.trainable_state_dict().items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise EyasError(f"{ckpt}/model.safetensors: {k} has shape {tuple(state[k].shape)}, config.json "
                            f"implies {tuple(v.shape)}; re-export the checkpoint")
    state["d2t"], state["lm_head.weight"], _ = core_vocab.sort_map(state["d2t"], state["t2d"],
                                                                    state["lm_head.weight"])  # another order
    try:  # DESIGN 4: a wrong map raises no error downstream, it only drafts wrong tokens
        core_vocab.check_maps(state["d2t"], state["t2d"], cfg.vocab_size)
    except core_vocab.VocabMapError as e:
        raise EyasError(f"{ckpt}/model.safetensors: {e}") from e
    drafter.load_state_dict(state, strict=False)
    if target_embedding is not None:
        drafter.load_target_embedding(target_embedding)
    meta_file = ckpt / "eyas.json"
    meta = read_json(meta_file) if meta_file.exists() else {}
    return drafter, meta


def resolve_drafter(path: Path) -> tuple[Path, str]:
    """The checkpoint a drafter argument names, as every command that takes a drafter reads it:
    the directory itself when it holds a checkpoint (any layout: a config.json beside it), else a
    training run's best/, else its final/. Returns (directory, what was picked)."""
    path = Path(path)
    if path.is_file():
        raise EyasError(f"{path} is a file, not a checkpoint directory; pass the directory that holds it "
                        f"({path.parent})")
    if not path.is_dir():
        raise EyasError(f"{path}: no such directory; pass a drafter checkpoint or a training run directory")
    if (path / "config.json").is_file():
        return path, "the checkpoint given"
    for name in ("best", "final"):
        if (path / name / "config.json").is_file():
            return path / name, f"{name}/ of the run"
    raise EyasError(f"{path}: no drafter checkpoint here or in best/ or final/; pass a checkpoint directory or the "
                    "run directory `eyas train` wrote")
