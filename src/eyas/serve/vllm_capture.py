"""Capture through vLLM (`eyas capture --engine vllm`): the aux states and the final state of
each prepared sample, taken from the target as vLLM runs it (tensor / pipeline parallel), written
into eyas's capture shards by `formats.capture.write_shards` (same plan, manifest, resume).

How: vLLM's `extract_hidden_states` speculative method with eyas's KV connector
(`serve.vllm_connector`). Each sample is one request with `max_tokens=1`: its prefill runs the
target over every token, the states at the requested layers are cached per token, and the
connector writes them to `OUT/.vllm-spool/<index>.safetensors` when the request finishes. This
module reads those files back, shard by shard, and deletes them.

What vLLM does not give is computed here from what it does give (DESIGN 7):
- vLLM's layer ids are HF `output_hidden_states` indices (the state entering decoder layer i;
  DESIGN 3), the convention eyas stores, except id L: vLLM hands out the last layer's output
  BEFORE the final norm, where eyas's id L (and `last`) is the final norm's output. eyas asks
  vLLM for id L as well and applies the target's own final norm (its module, built by
  transformers on the meta device, with only its weights read from the checkpoint).
- The target's full-vocabulary argmax (`argmax`, DESIGN 6's out-of-vocabulary mask) is not an
  output of the engine; it is `ttt.vocab_argmax(last, lm_head)` as in eyas's own capture, with
  the head's rows read from the checkpoint, on `--device` (use a GPU for a large vocabulary).
- vLLM returns the requested layers sorted and without repeats; they are put back in the order
  of `--layers` here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from eyas.errors import EyasError
from eyas.serve import vllm_jobs
from eyas.serve.vllm_jobs import EngineArgs

log = logging.getLogger(__name__)
SPOOL = ".vllm-spool"
WAIT_S = 600.0  # for the worker's file after `generate` returned: the write of one sample's states


def capture_shards(target: Path, data: Path, out: Path, layer_ids: list[int], num_layers: int, dtype: str,
                   shards: list[list[int]], mine: list[int], speculators: bool, device: str,
                   engine: EngineArgs) -> dict:
    """Write the shards `mine` of the plan `shards` into `out` through vLLM (finished shards are
    skipped); returns `write_shards`' counts."""
    job = {"target": str(target), "data": str(data), "out": str(out), "layer_ids": layer_ids,
           "num_layers": num_layers, "dtype": dtype, "shards": shards, "mine": mine, "speculators": speculators,
           "device": device, "engine": vllm_jobs.engine_to_job(engine)}
    return vllm_jobs.run_child(__name__, job, Path(out) / SPOOL / "job.json")["counts"]


def engine_layers(layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids vLLM is asked for: eyas's, plus L (the pre-norm last state), sorted, unique (vLLM's order)."""
    return sorted(set(layer_ids) | {num_layers})


def extract_config(layer_ids: list[int], num_layers: int, spool: Path) -> dict:
    """`speculative_config` and `kv_transfer_config` for vLLM's extract_hidden_states with eyas's connector."""
    from eyas.serve import vllm_connector

    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                 engine_layers(layer_ids, num_layers)}}}
    kv = {"kv_connector": vllm_connector.CONNECTOR, "kv_connector_module_path": vllm_connector.MODULE,
          "kv_role": "kv_producer",
          # per-sample file names come with each request; the files appear by rename, so no lock files
          "kv_connector_extra_config": {"shared_storage_path": str(spool), "allow_custom_save_path": True,
                                        "use_synchronization_lock": False}}
    return {"speculative_config": spec, "kv_transfer_config": kv}


# ---------------------------------------------------------------- the target's final norm and head


def norm_and_head(target: Path, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    """The target's final norm (a module, weights loaded) and LM head weight (V, H), read from the
    checkpoint alone: the model is built on the meta device, so a target of any size costs only
    these two tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eyas import targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target), dtype=dtype)
    norm = targets.find_decoder_stack(model).norm
    head = targets.output_head(model)
    if head is None:
        raise EyasError(f"target {target}: eyas finds no LM head in {type(model).__name__}; the vLLM capture "
                        "stores the target's argmax and needs it: use --engine eyas")
    names = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    norm_names = [n for n, p in names.items() if any(p is q for q in norm.parameters())]
    head_names = [n for n, p in names.items() if p is head]
    tensors = _read_weights(target, norm_names + head_names)
    missing = [n for n in norm_names if n not in tensors] + ([] if any(n in tensors for n in head_names)
                                                             else head_names)
    if missing:
        raise EyasError(f"target {target}: the checkpoint lacks {missing}; eyas reads the final norm and LM head by "
                        "their transformers names: use --engine eyas for this target")
    norm = norm.to_empty(device=device)
    with torch.no_grad():
        for n, p in norm.named_parameters():
            full = next(k for k in norm_names if k == n or k.endswith("." + n))
            p.copy_(tensors[full].to(dtype))
    head_w = next(tensors[n] for n in head_names if n in tensors).to(dtype=dtype, device=device)
    return norm.eval(), head_w


def _read_weights(target: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors that the checkpoint holds (of a tied head: whichever name it stores)."""
    from safetensors import safe_open

    index = target / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = {}
        for f in sorted(target.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                where.update({k: f.name for k in h.keys()})
    found: dict[str, torch.Tensor] = {}
    for n in names:
        if n in where:
            with safe_open(str(target / where[n]), framework="pt") as h:
                found[n] = h.get_tensor(n)
    return found


# ---------------------------------------------------------------- the child process


class Producer:
    """`write_shards`' producer: one `generate` call per shard, rows in eyas's capture layout."""

    def __init__(self, job: dict):
        from eyas import targets
        from eyas.formats import capture as fcap

        self.job, self.out = job, Path(job["out"])
        self.spool = self.out / SPOOL
        _, self.records = fcap.read_prepared(Path(job["data"]))
        self.dtype = targets.parse_dtype(job["dtype"])
        self.device = targets.parse_device(job["device"])
        self.norm, self.head = norm_and_head(Path(job["target"]), self.dtype, self.device)
        self.L = job["num_layers"]
        self.cols = {j: k for k, j in enumerate(engine_layers(job["layer_ids"], self.L))}
        self.llm = None  # started on the first shard that is not already on disk

    def _start(self) -> None:
        longest = max(len(self.records[i].input_ids) for k in self.job["mine"] for i in self.job["shards"][k])
        engine = vllm_jobs.engine_from_job(self.job)
        extra = {"max_model_len": longest + 1, **engine.extra}  # a sample + the one token vLLM samples
        engine = EngineArgs(engine.dtype, engine.tensor_parallel_size, engine.pipeline_parallel_size, extra)
        # prefix caching off: every token's states must come from this sample's own prefill
        self.llm = vllm_jobs.make_llm(Path(self.job["target"]), engine, enable_prefix_caching=False,
                                      **extract_config(self.job["layer_ids"], self.L, self.spool))

    def __call__(self, idx: list[int], tick) -> list[dict]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            self._start()
        paths = [self.spool / f"{i}.safetensors" for i in idx]
        for p in paths:
            p.unlink(missing_ok=True)
        params = [SamplingParams(max_tokens=1, detokenize=False,
                                 extra_args={"kv_transfer_params": {"hidden_states_path": str(p)}}) for p in paths]
        self.llm.generate([TokensPrompt(prompt_token_ids=self.records[i].input_ids) for i in idx], params,
                          use_tqdm=False)
        rows = [self._row(i, _wait_load(p)) for i, p in zip(idx, paths)]
        tick(sum(len(self.records[i].input_ids) for i in idx))
        return rows

    @torch.no_grad()
    def _row(self, i: int, t: dict) -> dict:
        from eyas.core import ttt

        rec = self.records[i]
        if t["token_ids"].tolist() != rec.input_ids:
            raise EyasError(f"vLLM returned states for other tokens than sample {rec.id} ({len(t['token_ids'])} vs "
                            f"{len(rec.input_ids)} tokens); delete {self.out} and capture again")
        hs = t["hidden_states"].to(self.dtype)  # (T, n_engine_layers, H)
        pre = hs[:, self.cols[self.L]]
        last = self.norm(pre.to(self.device))  # eyas's `last`: the final norm's output
        aux = torch.cat([last.cpu() if j == self.L else hs[:, self.cols[j]] for j in self.job["layer_ids"]], -1)
        sup = ttt.predicts_supervised(torch.tensor(rec.loss_mask))
        argmax = torch.full((len(rec.input_ids),), -1, dtype=torch.int32)
        chunk = 256 if self.device.type == "cpu" else 8192
        argmax[sup] = ttt.vocab_argmax(last[sup.to(self.device)], self.head, chunk).to(torch.int32).cpu()
        row = {"aux": aux, "last": last.cpu(), "argmax": argmax}
        if self.job["speculators"]:
            row["pre"] = pre  # speculators stores the last state before the norm
        return row


def _wait_load(path: Path) -> dict:
    from safetensors.torch import load_file

    deadline = time.monotonic() + WAIT_S
    while not path.is_file():
        if time.monotonic() > deadline:
            raise EyasError(f"vLLM's worker wrote no hidden states to {path} within {WAIT_S:.0f} s (see vLLM's "
                            "messages above); rerun the same command to resume")
        time.sleep(0.02)
    t = load_file(str(path))
    path.unlink()
    return t


def _job(job: dict) -> dict:
    from eyas.formats.capture import write_shards

    out = Path(job["out"])
    producer = Producer(job)
    spec_dir = out / "speculators" if job["speculators"] else None
    counts = write_shards(out, producer.records, job["shards"], job["mine"], producer, spec_dir)
    return {"counts": counts}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vllm_jobs.child_main(_job)
