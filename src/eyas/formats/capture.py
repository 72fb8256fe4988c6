"""Captured hidden states (DESIGN 7): safetensors shards + `manifest.json`, their writer
primitives, the resumable loop that produces and writes planned shards (`write_shards`, for
`eyas capture` and `serve.vllm_capture`) and `CaptureReader`; also the minimal view of prepared
data that capture and vocab need. The same states in other tools' layouts (speculators,
SpecForge): `eyas.formats.foreign_features`.

A shard `shard-KKKKK.safetensors` holds the samples of one contiguous run of sample
indices, concatenated along tokens: `aux` [sum T, n_aux*H], `last` [sum T, H] (output of
the target's final norm: target logits = lm_head(last)), `input_ids` int32 [sum T],
`loss_mask` uint8 [sum T], and, when the manifest says `target_argmax: true` (what `eyas
capture` writes; imported features and older captures lack it), `argmax` int32 [sum T]: the
target's full-vocabulary argmax of lm_head(last) at each position whose next token is
supervised, -1 elsewhere. The manifest gives each sample's (shard, offset, length,
split) and each shard's sha256. Shards appear under their final name only when complete
(temp name, fsync, rename); the manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eyas.core.ttt import predicts_supervised
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io
from eyas.formats.foreign_features import speculators_states, speculators_write_sample

FORMAT = "eyas.capture"
VERSION = 1
LAST_STATE = "post_final_norm"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
ID_BYTES, MASK_BYTES, ARGMAX_BYTES = 4, 1, 4  # int32 ids, uint8 mask, int32 argmax on disk
ARGMAX_KEY = "target_argmax"  # manifest flag: shards hold `argmax`


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def bytes_per_token(hidden: int, n_aux: int, dtype: torch.dtype) -> int:
    """Disk bytes per captured token: aux + last states, id, mask and argmax."""
    return (n_aux + 1) * hidden * torch.empty((), dtype=dtype).element_size() + ID_BYTES + MASK_BYTES + ARGMAX_BYTES


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(root: Path, k: int, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """Write shard k under a temporary name, fsync, then rename: never a partial final file."""
    from safetensors.torch import save_file

    final = root / shard_name(k)
    tmp = root / f".{final.name}.tmp"
    try:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        ckpt_io.share(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. ENOSPC: leave no partial file behind
        raise
    os.replace(tmp, final)
    _fsync_dir(root)
    return final


def shard_rows(path: Path) -> int | None:
    """Token rows of a finished shard, or None when it cannot be opened (then it is redone)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_slice("input_ids").get_shape()[0]
    except Exception:  # a damaged file of any kind is simply captured again
        return None


def write_json(path: Path, obj) -> None:
    """Deterministic JSON via temp file + fsync + rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _shard_tensors(rows: list[dict], records: list) -> dict[str, torch.Tensor]:
    out = {
        "aux": torch.cat([r["aux"] for r in rows]),
        "last": torch.cat([r["last"] for r in rows]),
        "input_ids": torch.tensor([t for rec in records for t in rec.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for rec in records for m in rec.loss_mask], dtype=torch.uint8),
    }
    if all("argmax" in r for r in rows):
        out["argmax"] = torch.cat([r["argmax"] for r in rows])
    return out


def write_shards(out: Path, records: list, shards: list[list[int]], mine: list[int],
                 produce: Callable[[list[int], Callable[[int], object]], list[dict]],
                 spec_dir: Path | None) -> dict:
    """Produce and write each of `mine` (shard numbers) unless already finished; the
    progress bar counts tokens (produce reports each batch through its second argument)."""
    from tqdm import tqdm

    done = skipped = 0
    total = sum(len(records[i].input_ids) for k in mine for i in shards[k])
    bar = tqdm(total=total, desc="capture", unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True)
    for k in mine:
        idx = shards[k]
        tokens = sum(len(records[i].input_ids) for i in idx)
        if (out / shard_name(k)).is_file() and shard_rows(out / shard_name(k)) == tokens:
            skipped += 1
            bar.update(tokens)
            continue
        before = bar.n
        rows = produce(idx, bar.update)
        bar.update(tokens - (bar.n - before))  # a producer that does not report per batch
        if spec_dir is not None:  # before the shard: a finished shard implies its hs_ files
            for i, r in zip(idx, rows):
                speculators_write_sample(spec_dir, i, torch.tensor(records[i].input_ids), speculators_states(r))
        # one metadata key: safetensors writes several keys in no fixed order (bytes would vary)
        meta = {"eyas": json.dumps({"format": FORMAT + ".shard", "shard": k, "first_sample": idx[0],
                                    "samples": len(idx)}, sort_keys=True)}
        write_shard(out, k, _shard_tensors(rows, [records[i] for i in idx]), meta)
        done += 1
    bar.close()
    return {"captured_shards": done, "skipped_shards": skipped}


# ---------------------------------------------------------------- prepared data (read side)


@dataclass
class Record:
    """One prepared sample as capture and vocab see it."""

    index: int
    split: str
    id: str
    input_ids: list[int]
    loss_mask: list[int]


def data_fingerprint(data_dir: Path) -> str:
    """sha256 (16 hex) over the prepared directory's manifest and sample files."""
    h = hashlib.sha256()
    for name in ("manifest.json", "train.jsonl", "eval.jsonl"):
        f = Path(data_dir) / name
        if f.is_file():
            h.update(name.encode())
            h.update(sha256_file(f).encode())
    return h.hexdigest()[:16]


def read_prepared(data_dir: Path) -> tuple[dict, list[Record]]:
    """Manifest and samples of both splits (train first, then eval) of a prepared dir,
    read through `eyas.formats.data` (the one reader of that format)."""
    from eyas.formats import data as fdata

    data_dir = Path(data_dir)
    manifest = fdata.read_manifest(data_dir)
    records = []
    for split in ("train", "eval"):
        for x in fdata.read_samples(data_dir, split):
            records.append(Record(len(records), split, str(x.id), list(x.input_ids), list(x.loss_mask)))
    if not records:
        raise EyasError(f"--data {data_dir}: no samples in train.jsonl or eval.jsonl; prepare some data first")
    return manifest, records


# ---------------------------------------------------------------- reading captures


REQUIRED = ("format", "version", "target_fingerprint", "layer_ids", "hidden_size", "dtype", "samples", "shards")


def read_manifest(root: Path) -> dict:
    """Load and check a capture manifest (format, version, required keys, confined paths)."""
    root = Path(root)
    mf = root / "manifest.json"
    if not mf.is_file():
        raise EyasError(f"capture {root}: no manifest.json; the capture is unfinished or this is not one: "
                        "rerun the same `eyas capture` command to finish it")
    try:
        m = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EyasError(f"{mf}: not valid JSON ({e}); rerun `eyas capture` to rewrite it") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise EyasError(f"{mf}: format {m.get('format') if isinstance(m, dict) else None!r} is not {FORMAT!r}; "
                        "pass a directory written by `eyas capture`")
    if m.get("version") != VERSION:
        raise EyasError(f"{mf}: version {m.get('version')} is not supported (expected {VERSION}); recapture")
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise EyasError(f"{mf}: missing {missing}; rerun `eyas capture` to rewrite it")
    if m["dtype"] not in NAME_DTYPES:
        raise EyasError(f"{mf}: dtype {m['dtype']!r} unknown; expected one of {list(NAME_DTYPES)}")
    real = root.resolve()
    for s in m["shards"]:
        p = (root / s["file"]).resolve()
        if p.parent != real or "/" in s["file"] or "\\" in s["file"]:
            raise EyasError(f"{mf}: shard path {s['file']!r} leaves the capture directory; refusing to read it")
    return m


class CaptureReader:
    """Random access to captured samples: `reader[i] -> dict(aux, last, input_ids, loss_mask)`
    (+ `argmax` long when the capture holds it).

    Shards are opened once (safetensors `safe_open`, memory-mapped) and kept open. With
    `verify=True` each shard's sha256 is checked the first time it is opened; `validate()`
    checks everything (hashes, shapes, finiteness, and tokens against prepared data).
    """

    def __init__(self, root: Path, verify: bool = True):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.verify = verify
        self._shards = {s["file"]: s for s in self.manifest["shards"]}
        self._open: dict[str, object] = {}
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.dtype: torch.dtype = NAME_DTYPES[self.manifest["dtype"]]
        self.target_fingerprint: str = self.manifest["target_fingerprint"]
        self.samples: list[dict] = self.manifest["samples"]
        self.keys = ("aux", "last", "input_ids", "loss_mask") + (("argmax",) if self.manifest.get(ARGMAX_KEY) else ())

    def __len__(self) -> int:
        return len(self.samples)

    def open_all(self) -> None:
        """Open (and, with `verify`, hash) every shard now, so a missing or damaged shard is
        reported before a consumer creates any output."""
        for name in self._shards:
            self._handle(name)

    def split_indices(self, split: str) -> list[int]:
        return [i for i, s in enumerate(self.samples) if s["split"] == split]

    def _handle(self, name: str):
        if name in self._open:
            return self._open[name]
        from safetensors import safe_open

        if name not in self._shards:
            raise EyasError(f"capture {self.root}/manifest.json names shard {name!r} for a sample but does not "
                            "list it; rerun `eyas capture` to rewrite the manifest")
        path = self.root / name
        fix = f"delete {path} and rerun the same `eyas capture` command to recapture it"
        if not path.is_file():
            raise EyasError(f"capture shard {path} is missing; {fix}")
        if self.verify and sha256_file(path) != self._shards[name]["sha256"]:
            raise EyasError(f"capture shard {path} is corrupted or truncated (sha256 differs from the "
                            f"manifest); {fix}")
        try:
            h = safe_open(str(path), framework="pt")
        except Exception as e:
            raise EyasError(f"capture shard {path} cannot be opened ({e}); {fix}") from e
        self._open[name] = h
        return h

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.samples[i]
        h = self._handle(s["shard"])
        a, b = s["offset"], s["offset"] + s["length"]
        path = self.root / s["shard"]
        try:
            out = {k: h.get_slice(k)[a:b] for k in self.keys}
        except Exception as e:
            raise EyasError(f"capture shard {path}: sample {i} cannot be read ({e}); delete the shard and "
                            "rerun the same `eyas capture` command") from e
        self._check(i, out, path)
        out["input_ids"] = out["input_ids"].long()
        out["loss_mask"] = out["loss_mask"].long()
        if "argmax" in out:
            out["argmax"] = out["argmax"].long()
        return out

    def loss_mask(self, i: int) -> torch.Tensor:
        """Sample i's loss mask alone (a few bytes per token; no features read)."""
        s = self.samples[i]
        return self._handle(s["shard"]).get_slice("loss_mask")[s["offset"]:s["offset"] + s["length"]]

    def _check(self, i: int, t: dict, path: Path) -> None:
        T, H, n = self.samples[i]["length"], self.hidden_size, len(self.layer_ids)
        want = {"aux": (T, n * H), "last": (T, H), "input_ids": (T,), "loss_mask": (T,), "argmax": (T,)}
        for k, shape in ((k, want[k]) for k in self.keys):
            if tuple(t[k].shape) != shape:
                raise EyasError(f"capture shard {path}: sample {i} {k} has shape {tuple(t[k].shape)}, expected "
                                f"{shape}; delete the shard and rerun the same `eyas capture` command")
        if "argmax" in t:
            if not torch.equal(t["argmax"] >= 0, predicts_supervised(t["loss_mask"])):
                raise EyasError(f"capture shard {path}: sample {i} argmax is not set exactly where the next token is "
                                "supervised; delete the shard and rerun the same `eyas capture` command")
        for k in ("aux", "last"):
            if t[k].dtype != self.dtype:
                raise EyasError(f"capture shard {path}: {k} dtype {t[k].dtype} differs from the manifest's "
                                f"{self.manifest['dtype']}; recapture")
            if not bool(torch.isfinite(t[k]).all()):
                raise EyasError(f"capture shard {path}: sample {i} {k} holds NaN/inf; the target overflowed "
                                "in this dtype: recapture with --dtype fp32 or bf16")

    def validate(self, data_dir: Path | None = None) -> dict:
        """Check every shard's hash and every sample (and tokens against `data_dir`)."""
        for name in self._shards:
            self._open.pop(name, None)
            keep, self.verify = self.verify, True
            try:
                self._handle(name)
            finally:
                self.verify = keep
        records = None
        if data_dir is not None:
            _, recs = read_prepared(Path(data_dir))
            records = {(r.split, r.id): r for r in recs}
        tokens = 0
        for i in range(len(self)):
            t = self[i]
            tokens += t["input_ids"].numel()
            if records is not None:
                self._check_tokens(i, t, records, data_dir)
        return {"samples": len(self), "tokens": tokens, "shards": len(self._shards)}

    def _check_tokens(self, i: int, t: dict, records: dict, data_dir: Path) -> None:
        s = self.samples[i]
        r = records.get((s["split"], s["id"]))
        if r is None or r.input_ids != t["input_ids"].tolist() or r.loss_mask != t["loss_mask"].tolist():
            recorded = self.manifest.get("data")
            if recorded and Path(recorded).resolve() != Path(data_dir).resolve():
                fix = f"this capture was made from --data {recorded}: validate against that, or recapture"
            else:
                fix = "the data changed after capture: recapture it"
            raise EyasError(f"capture {self.root}: sample {s['id']} ({s['split']}) does not match the prepared "
                            f"data in {data_dir}; {fix}")
