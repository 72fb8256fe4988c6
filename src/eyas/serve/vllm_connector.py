"""eyas's KV connector for vLLM's `extract_hidden_states` speculative method: it writes the
hidden states vLLM cached for each finished request to one safetensors file, on CPU and GPU.

vLLM loads this class by module path (`kv_transfer_config={"kv_connector": CONNECTOR,
"kv_connector_module_path": MODULE, ...}`), in its worker processes: this module imports vLLM
and is never imported by eyas itself.

How the states get here (vLLM 0.32): with `extract_hidden_states`, the target returns the states
at the layer ids listed in the drafter config's `eagle_aux_hidden_state_layer_ids` (HF index: i =
input of decoder layer i; id L = the last layer's output before the final norm), and a cache-only
"drafter" layer stores them, per token, in a KV cache group of shape [blocks, n_layers, block, H].
When a request finishes, the scheduler keeps its blocks (`request_finished` returns True) and
hands their ids to the worker, which reads the rows out of the cache here and reports the
request "sent", which frees the blocks.

The scheduler side (request bookkeeping, file names) is vLLM's `ExampleHiddenStatesConnector`,
inherited as is. Only the worker-side copy differs: that class copies through a CUDA stream into
pinned memory ("pin_memory=True requires a CUDA or other accelerator backend" on a CPU); this one
copies with a plain `.cpu()` (synchronous on a GPU, a no-op on a CPU) and hands the write to a
thread. A file appears under its final name only when complete (temp name, then rename), so the
reader waits for the name and needs no lock file.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

CONNECTOR = "EyasHiddenStatesConnector"
MODULE = __name__


class EyasHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a device-agnostic copy and atomic files."""

    def _save(self, pending: PendingSave) -> None:
        """Copy one request's rows out of the hidden-state cache and queue its file write."""
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        n = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).cpu()  # (T, n_layers, H)
        tensors = {"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}
        future = self._executor.submit(_write, tensors, pending.filename)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))  # logs a failed write

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Save the requests the scheduler finished last step; they count as sent once their rows
        are copied out (the blocks may be reused then: the file write reads the copy)."""
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return None, None  # only TP rank 0 writes and reports (`get_finished_count` is 1)
        meta = self._get_connector_metadata()
        if not isinstance(meta, ExampleHiddenStatesConnectorMetadata):
            return None, None
        done = set()
        for pending in meta.pending_saves:
            self._save(pending)
            done.add(pending.req_id)
        return done or None, None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)  # every queued file lands before the worker exits
        super().shutdown()


def _write(tensors: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    save_file(tensors, tmp)
    os.replace(tmp, path)
