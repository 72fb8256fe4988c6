"""Hidden states in other tools' layouts: the speculators offline layout that `eyas capture
--format speculators` writes beside its shards (`hidden_states/hs_{i}.safetensors`, an Arrow
dataset, and `eyas_speculators.json`), and the speculators and SpecForge features that
`eyas capture import` reads. eyas's own capture format: `eyas.formats.capture`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io

SPECULATORS_INFO = "eyas_speculators.json"  # what speculators' files do not record (the aux layers, the split)


# ---------------------------------------------------------------- writing the speculators layout


def speculators_write_sample(root: Path, index: int, token_ids: torch.Tensor, states: torch.Tensor) -> None:
    """`hidden_states/hs_{index}.safetensors` as speculators' FileTransfer reads it:
    `hidden_states` [T, n_aux + 1, H] (aux layers, then the last decoder layer's output
    BEFORE the final norm: speculators applies its own frozen `verifier_norm`) and
    `token_ids` [T] int64."""
    from safetensors.torch import save_file

    d = root / "hidden_states"
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"hs_{index}.safetensors"
    tmp = d / f".{final.name}.tmp"
    save_file({"hidden_states": states.contiguous(), "token_ids": token_ids.long().contiguous()}, str(tmp))
    ckpt_io.share(tmp)
    os.replace(tmp, final)


def speculators_states(row: dict) -> torch.Tensor:
    """One captured sample's states as speculators stores them: aux layers, then the pre-norm last."""
    H = row["last"].shape[-1]
    aux = row["aux"].reshape(row["aux"].shape[0], -1, H)  # (T, n_aux, H)
    return torch.cat([aux, row["pre"].unsqueeze(1)], dim=1)  # (T, n_aux + 1, H)


def speculators_write_dataset(root: Path, input_ids: list[list[int]], loss_masks: list[list[int]], n_train: int,
                              layer_ids: list[int]) -> dict:
    """The Arrow dataset (`datasets.save_to_disk`) speculators' ArrowDataset reads:
    `input_ids`, `loss_mask`, `seq_len`, torch format; rows in hs_{i} order, train first.
    Beside it SPECULATORS_INFO: the `--train-data-ratio` that makes speculators' split equal
    eyas's, and the aux layer ids (HF index), which speculators' files do not record and
    `capture import` reads back. Returns that info."""
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_masks,
                            "seq_len": [len(x) for x in input_ids]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(root))
    n = len(input_ids)
    # int(n * ratio) == n_train exactly; speculators needs a ratio strictly inside (0, 1)
    ratio = (n_train + 0.5) / n if 0 < n_train < n else None
    info = {"train_data_ratio": ratio, "train_samples": n_train, "samples": n, "layer_ids": list(layer_ids),
            "last_hidden_state": "pre_final_norm (output of the last decoder layer)"}
    (root / SPECULATORS_INFO).write_text(json.dumps(info, indent=1) + "\n")
    return info


# ---------------------------------------------------------------- reading speculators and SpecForge features


def specforge_files(src: Path) -> list[Path]:
    """SpecForge's `data_<index>.ckpt` (or `.pt`) files under `src`, in index order."""
    files = [f for f in src.rglob("data_*.ckpt")] + [f for f in src.rglob("data_*.pt")]

    def idx(f: Path) -> int:
        try:
            return int(f.stem.split("_", 1)[1])
        except ValueError as e:
            raise EyasError(f"SpecForge file {f}: name is not data_<index>.ckpt") from e
    return sorted(files, key=idx)


def read_specforge(f: Path) -> dict:
    try:
        d = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EyasError(f"SpecForge file {f} cannot be read as tensors ({e}); regenerate it") from e
    missing = [k for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state") if k not in d]
    if missing:
        raise EyasError(f"SpecForge file {f} lacks {missing}; generate it with --enable-aux-hidden-states")
    return {"input_ids": d["input_ids"].reshape(-1), "loss_mask": d["loss_mask"].reshape(-1),
            "aux": d["aux_hidden_state"].reshape(d["input_ids"].numel(), -1),
            "last": d["hidden_state"].reshape(d["input_ids"].numel(), -1)}


def speculators_items(src: Path, norm: torch.nn.Module) -> list[Callable[[], dict]]:
    from datasets import load_from_disk
    from safetensors.torch import load_file

    try:
        ds = load_from_disk(str(src)).with_format(None)
    except Exception as e:
        raise EyasError(f"speculators data {src} is not a saved dataset ({e}); pass the directory "
                        "that holds the Arrow dataset and hidden_states/") from e

    def item(i: int) -> dict:
        f = src / "hidden_states" / f"hs_{i}.safetensors"
        if not f.is_file():
            raise EyasError(f"speculators data {src}: {f} is missing; generate it (speculators "
                            "data generation) or drop the sample")
        t = load_file(str(f))
        row = ds[i]
        if t["token_ids"].tolist() != list(row["input_ids"]):
            raise EyasError(f"speculators file {f}: token_ids differ from the dataset row {i}; regenerate it")
        hs = t["hidden_states"]  # (T, n_aux + 1, H): last is pre-norm
        if hs.dim() != 3 or hs.shape[-1] != norm.weight.shape[0]:
            raise EyasError(f"speculators file {f}: hidden_states {tuple(hs.shape)} are not [T, layers, "
                            f"{norm.weight.shape[0]}] (the --target's hidden size); pass the target the features "
                            "came from")
        with torch.no_grad():
            last = norm(hs[:, -1].to(norm.weight.dtype)).to(hs.dtype)
        return {"input_ids": t["token_ids"], "loss_mask": torch.tensor(row["loss_mask"]),
                "aux": hs[:, :-1].flatten(1), "last": last}

    return [lambda i=i: item(i) for i in range(len(ds))]


def speculators_recorded(src: Path) -> dict:
    """What an eyas `--format speculators` export recorded beside its features (or {})."""
    f = src / SPECULATORS_INFO
    if not f.is_file():
        return {}
    try:
        info = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{f} is not valid JSON ({e}); restore it, or delete it and pass --layers and "
                        "--train-ratio") from e
    return info if isinstance(info, dict) else {}
