"""The target's KV cache, preallocated: one buffer per layer, grown by views, never reallocated
while decoding (transformers' DynamicCache concatenates on every step)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from eyas.core import speculative as spec

class KVPool:
    """The keys and values of every layer in one buffer (2L, B, h, capacity, d), so that moving
    the accepted path into place is one gather and one copy per step instead of two per layer.
    A layer whose shape differs from the first one's keeps buffers of its own."""

    def __init__(self, n_layers: int, capacity: int):
        self.n_layers, self.capacity = n_layers, capacity
        self.buf: torch.Tensor | None = None

    def views(self, i: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """(keys, values) buffers of layer i inside the pool, or None when it does not fit."""
        B, h, _, d = key_states.shape
        if self.buf is None:
            self.buf = key_states.new_empty(2 * self.n_layers, B, h, self.capacity, d)
        if tuple(value_states.shape) != tuple(key_states.shape) or self.buf.shape[1:3] != (B, h) \
                or self.buf.shape[-1] != d or self.buf.dtype != key_states.dtype:
            return None
        return self.buf[2 * i], self.buf[2 * i + 1]

    def compact(self, start: int, rows: torch.Tensor, in_place: bool) -> None:
        if self.buf is not None:
            spec.compact_rows(self.buf, start, rows, in_place)


class PreallocLayer(DynamicLayer):
    """A DynamicLayer that writes into one preallocated buffer instead of `torch.cat` per
    step (no O(context) copy per token), and can be compacted in place. With a `KVPool`
    its buffers are views into the pool, which then compacts every layer at once."""

    def __init__(self, capacity: int, pool: KVPool | None = None, index: int = 0):
        super().__init__()
        self.capacity, self.length = capacity, 0
        self.pool, self.index, self.pooled = pool, index, False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, h, _, d = key_states.shape
        views = self.pool.views(self.index, key_states, value_states) if self.pool is not None else None
        self.pooled = views is not None
        if views is not None:
            self.kbuf, self.vbuf = views
        else:
            self.kbuf = key_states.new_empty(B, h, self.capacity, d)
            self.vbuf = value_states.new_empty(B, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True
        self._view()

    def _view(self) -> None:
        self.keys = self.kbuf[..., : self.length, :]
        self.values = self.vbuf[..., : self.length, :]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, T = self.length, key_states.shape[-2]
        if n + T > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({n}+{T})")
        self.kbuf[..., n:n + T, :] = key_states
        self.vbuf[..., n:n + T, :] = value_states
        self.length = n + T
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove)) if tokens_to_remove < 0 else min(
            self.length, tokens_to_remove)
        if self.is_initialized:
            self._view()

    def keep_sequences(self, batch_rows: torch.Tensor) -> None:
        """Keep only these batch rows (sequences), in this order."""
        if self.pooled:
            raise RuntimeError("keep_sequences on a pooled KV layer")
        if self.is_initialized:
            self.kbuf, self.vbuf = self.kbuf[batch_rows], self.vbuf[batch_rows]
            self._view()

    def compact(self, start: int, rows: torch.Tensor, in_place: bool | None = None) -> None:
        """Keep rows start+rows (in order) at start.., drop everything after them (a pooled
        layer's rows are moved by `KVPool.compact`)."""
        if self.is_initialized and not self.pooled:
            spec.compact_rows(self.kbuf, start, rows, in_place)
            spec.compact_rows(self.vbuf, start, rows, in_place)
        self.length = start + rows.numel()
        if self.is_initialized:
            self._view()
