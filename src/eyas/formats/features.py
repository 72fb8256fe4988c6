"""Training features as padded batches: captured features read from shards (`CaptureSplit`,
`TensorSource`) or made on the fly by the target (`targets.online.OnlineSource`), both yielding
`Batch`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Sequence

import torch

from eyas.core.batching import pad as _pad
from eyas.core.batching import shape_length


@dataclass
class Batch:
    aux: torch.Tensor  # (B, T, n_aux*H)
    last: torch.Tensor  # (B, T, H) final-norm target states
    input_ids: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T)
    argmax: torch.Tensor | None = None  # (B, T) the target's full-vocabulary argmax where captured (-1 elsewhere)
    ids: list = field(default_factory=list)  # sample keys, for error messages
    keys: list = field(default_factory=list)  # (split, index) of each sample: the trainer's cache key
    tokens: int = 0  # unpadded tokens (what tokens/s counts)


class TensorSource:
    """Captured features: per split, an indexable of dicts (aux, last, input_ids, loss_mask)
    (a CaptureReader view, or lists of tensors in tests). Right-padded into batches."""

    def __init__(self, splits: dict[str, Sequence], max_len: int):
        self.splits, self.max_len = splits, max_len

    def lengths(self, split: str) -> list[int]:
        s = self.splits[split]
        if hasattr(s, "lengths"):
            return [min(n, self.max_len) for n in s.lengths()]
        return [min(int(s[i]["input_ids"].shape[0]), self.max_len) for i in range(len(s))]

    def sample_id(self, split: str, i: int):
        s = self.splits[split]
        return s.key(i) if hasattr(s, "key") else i

    def argmax_stored(self) -> bool:
        """Every sample of every split comes with the target's argmax (captures that store it)."""
        return all(getattr(s, "argmax_stored", lambda: False)() for s in self.splits.values())

    def batch(self, split: str, idxs: list[int]) -> Batch:
        items = [self.splits[split][i] for i in idxs]
        L = self.max_len
        n = [min(it["input_ids"].shape[0], L) for it in items]
        T = shape_length(max(n))
        return Batch(aux=_pad([it["aux"][:L].float() for it in items], T),
                     last=_pad([it["last"][:L].float() for it in items], T),
                     input_ids=_pad([it["input_ids"][:L].long() for it in items], T),
                     loss_mask=_pad([it["loss_mask"][:L].long() for it in items], T),
                     argmax=_pad([it["argmax"][:L].long() for it in items], T, -1)
                     if all("argmax" in it for it in items) else None,
                     ids=[self.sample_id(split, i) for i in idxs],
                     keys=[(split, i) for i in idxs], tokens=sum(n))


class CaptureSplit:
    """One split of one or more CaptureReaders as an indexable (no data read until indexed)."""

    def __init__(self, readers, split: str):
        readers = readers if isinstance(readers, (list, tuple)) else [readers]
        self.idx = [(r, j) for r in readers for j in r.split_indices(split)]

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, i: int) -> dict:
        r, j = self.idx[i]
        return r[j]

    def lengths(self) -> list[int]:
        return [int(r.samples[j]["length"]) for r, j in self.idx]

    def argmax_stored(self) -> bool:
        return all("argmax" in r.keys for r, _ in self.idx)

    def loss_masks(self):
        return (r.loss_mask(j) for r, j in self.idx)

    def key(self, i: int) -> str:
        r, j = self.idx[i]
        return str(r.samples[j].get("id", j))


def split_fingerprint(source, split: str = "train") -> str:
    """Hash of a split's sample ids and lengths: what a checkpoint's data position indexes. Cheap
    (no features read); a copy of the same capture elsewhere has the same one."""
    ids = [str(source.sample_id(split, i)) for i in range(len(source.splits[split]))]
    blob = json.dumps([ids, source.lengths(split)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
