"""Training features made on the fly by the target (`eyas train --online`): the same
`formats.features.Batch` that captured features give."""

from __future__ import annotations

import torch
from torch import nn

from eyas.core.batching import pad as _pad
from eyas.core.batching import shape_length
from eyas.formats.features import Batch
from eyas.targets.hooks import capture_aux, find_decoder_stack


class OnlineSource:
    """The target runs inside the training process: each batch of token ids goes through
    the target's decoder stack with aux hooks (targets.capture_aux); nothing touches disk."""

    def __init__(self, splits: dict[str, list], model: nn.Module, layer_ids: list[int], max_len: int):
        self.splits, self.model, self.layer_ids, self.max_len = splits, model, layer_ids, max_len
        self.base = find_decoder_stack(model).base
        self.device = next(model.parameters()).device

    def lengths(self, split: str) -> list[int]:
        return [min(len(s.input_ids), self.max_len) for s in self.splits[split]]

    def sample_id(self, split: str, i: int):
        return self.splits[split][i].id

    @torch.no_grad()
    def batch(self, split: str, idxs: list[int]) -> Batch:
        samples = [self.splits[split][i] for i in idxs]
        L = self.max_len
        n = [len(s.input_ids[:L]) for s in samples]
        ids = _pad([torch.tensor(s.input_ids[:L]) for s in samples], shape_length(max(n)))
        mask = _pad([torch.tensor(s.loss_mask[:L]) for s in samples], ids.shape[1])
        att = _pad([torch.ones(k, dtype=torch.long) for k in n], ids.shape[1])
        with capture_aux(self.model, self.layer_ids) as cap:
            self.base(input_ids=ids.to(self.device), attention_mask=att.to(self.device))
            aux, last = cap.aux().float(), cap.last.float()
        return Batch(aux=aux, last=last, input_ids=ids, loss_mask=mask, ids=[s.id for s in samples],
                     keys=[(split, i) for i in idxs], tokens=sum(n))
