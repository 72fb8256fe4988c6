"""`eyas capture [merge | import]`: run the target over prepared samples and store the aux
and final hidden states as shards (DESIGN 7); join part captures; turn speculators or
SpecForge features into eyas shards.

Work is planned before anything runs: samples (train then eval, file order) are cut into
shards by size (`--shard-mb`), so a shard's contents never depend on where a run was
killed; each shard is captured in length-sorted, token-budgeted batches and written
atomically. A rerun of the same command skips finished shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eyas import targets
from eyas.config import add_arguments, arg, command, from_namespace
from eyas.core import ttt
from eyas.core.batching import plan_capture_batches, plan_shards
from eyas.errors import EyasError
from eyas.formats import capture as fcap
from eyas.formats import foreign_features as ffeat
from eyas.stages.common import (TARGET_RUNNERS, atomic_dir, emit, provenance, refuse_out_over_inputs,
                               refuse_symlink_out, resolve_dtype)

log = logging.getLogger(__name__)
PLAN_FILE = ".eyas-capture-plan.json"


@dataclass(frozen=True)
class CaptureConfig:
    """`eyas capture`: one field per flag (also built from Python: tests, the quickstart)."""

    target: str | None = arg("built-in name or local HF directory", None)
    data: Path | None = arg("prepared data directory (eyas data prepare)", None)
    out: Path | None = arg("output directory", None)
    layers: str = arg("aux layers: auto = [2, L//2, L-3], or i,j,k (HF index)", "auto")
    dtype: str = arg("run and store dtype; auto = bf16 where the machine runs it natively, else fp32", "auto",
                     choices=("auto", "bf16", "fp16", "fp32"))
    batch_tokens: int = arg("padded tokens per forward batch", 4096)
    shard_mb: float = arg("target shard size in MB", 512)
    shard_index: int = arg("this part's index (0-based)", 0)
    num_shards: int = arg("split the work into this many parts", 1)
    force: bool = arg("ignore the free-space check; replace a foreign --out", False)
    device: str = arg("cpu, cuda, cuda:N or auto", "cpu")
    format: str = arg("speculators: also write the speculators offline layout under OUT/speculators", "eyas",
                      choices=("eyas", "speculators"))
    engine: str = arg("who runs the target: eyas (transformers, this process) or vllm (its extract_hidden_states, "
                      "tensor / pipeline parallel; docs/scale.md)", "eyas", choices=TARGET_RUNNERS)
    tensor_parallel_size: int = arg("with --engine vllm: vLLM's tensor_parallel_size", 1)
    pipeline_parallel_size: int = arg("with --engine vllm: vLLM's pipeline_parallel_size", 1)
    vllm_args: str | None = arg("with --engine vllm: other vllm.LLM keywords as a JSON object", None, metavar="JSON")
    json: bool = arg("print a machine-readable JSON summary", False)


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    parts: list[Path] = arg("part directories", positional=True)
    out: Path = arg("output directory")
    force: bool = arg("replace a non-empty --out", False)
    json: bool = arg("print a machine-readable JSON summary", False)


@dataclass(frozen=True, kw_only=True)
class ImportConfig:
    source: Path = arg("directory of features", positional=True)
    source_format: str = arg("the tool that wrote the features", flag="--from", choices=("speculators", "specforge"))
    target: str = arg("the target the features came from")
    out: Path = arg("output directory")
    layers: str = arg("aux layers the features hold (HF index); auto = those an eyas export recorded "
                      "(eyas_speculators.json), else [2, L//2, L-3]", "auto")
    train_ratio: float | None = arg("first share of samples marked train, rest eval (default: the split an eyas "
                                    "export recorded, else 1.0: no eval split)", None)
    shard_mb: float = arg("target shard size in MB", 512)
    force: bool = arg("replace a non-empty --out", False)
    json: bool = arg("print a machine-readable JSON summary", False)


@dataclass(frozen=True, kw_only=True)
class ValidateConfig:
    capture: Path = arg("capture directory", positional=True)
    data: Path | None = arg("prepared data directory the capture came from", None)
    json: bool = arg("print a machine-readable JSON summary", False)


# ---------------------------------------------------------------- CLI


def register(sub) -> None:
    p = sub.add_parser(
        "capture", help="store the target's aux + final hidden states for offline training",
        description="Run the target over prepared samples (both splits) and store per token the "
        "concatenated aux states [T, 3H] at --layers (HF hidden_states index) and the final-norm output "
        "[T, H], with the target's full-vocabulary argmax where the next token is supervised (training's "
        "out-of-vocabulary mask), as safetensors shards + manifest.json. Rerun the same command to resume after a "
        "kill. Actions: `merge` joins part captures, `import` converts speculators/SpecForge features, "
        "`validate` checks a capture.")
    add_arguments(p, CaptureConfig)
    p.set_defaults(func=lambda args: run_capture(from_namespace(CaptureConfig, args)))
    csub = p.add_subparsers(dest="capture_command", metavar="ACTION")
    command(csub, "merge", MergeConfig, run_merge, help="join part captures (--shard-index/--num-shards) into one",
            description="Join the part directories of one split capture into a single capture.")
    command(csub, "import", ImportConfig, run_import, help="convert speculators or SpecForge features to eyas shards",
            description="speculators: DIR holds the Arrow dataset and hidden_states/hs_*.safetensors (last state "
            "pre-norm; the target's final norm is applied). specforge: DIR holds rows_*/data_*.ckpt "
            "(aux_hidden_state, hidden_state post-norm, input_ids, loss_mask).")
    command(csub, "validate", ValidateConfig, run_validate, help="check a capture: shard hashes, every sample's "
            "shapes and values", description="Read a whole capture and check each shard's sha256 against the "
            "manifest and every sample's shapes, dtype and finiteness (NaN/inf); with --data also its tokens "
            "against the prepared data it was captured from. Exits 2 naming the first bad shard or sample and "
            "what to do about it.")


def check(cfg: CaptureConfig):
    """Exit 2 on flag values that cannot work; returns vLLM's engine settings with --engine vllm."""
    missing = [f"--{n}" for n in ("target", "data", "out") if getattr(cfg, n) is None]
    if missing:
        raise EyasError(f"eyas capture needs {', '.join(missing)} (see `eyas capture --help`)")
    if cfg.num_shards < 1 or not 0 <= cfg.shard_index < cfg.num_shards:
        raise EyasError(f"--shard-index {cfg.shard_index} --num-shards {cfg.num_shards}: need 0 <= index < count")
    if cfg.batch_tokens < 1:
        raise EyasError(f"--batch-tokens {cfg.batch_tokens}: must be positive, e.g. 4096")
    check_shard_mb(cfg.shard_mb)
    if cfg.engine == "vllm":
        from eyas.serve.vllm_jobs import parse_engine_args

        return parse_engine_args(cfg.dtype, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.vllm_args)
    given = [f for f, v in (("--tensor-parallel-size", cfg.tensor_parallel_size != 1),
                            ("--pipeline-parallel-size", cfg.pipeline_parallel_size != 1),
                            ("--vllm-args", cfg.vllm_args)) if v]
    if given:
        raise EyasError(f"{given[0]} only applies to --engine vllm; add --engine vllm or drop {given[0]}")
    return None


def run_capture(cfg: CaptureConfig) -> int:
    summary = capture(cfg)
    human = (f"captured {summary['samples']} samples / {summary['tokens']} tokens into {summary['shards']} shards "
             f"({summary['captured_shards']} new, {summary['skipped_shards']} already done) -> {cfg.out}")
    emit(cfg, summary, human)
    return 0


# ---------------------------------------------------------------- planning


def check_shard_mb(mb: float) -> None:
    if not 0 < mb < math.inf:
        raise EyasError(f"--shard-mb {mb}: must be a positive finite size in MB, e.g. 512")


def plan_id(common: dict, shards: list[list[int]]) -> str:
    blob = json.dumps({"common": common, "shards": shards}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_disk(out: Path, need: int, force: bool) -> None:
    """Print the estimate; refuse (exit 2) when the free space is short, unless --force."""
    probe = out if out.exists() else out.parent
    while not probe.exists():
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    if usage.total == 0:  # /proc, /sys: no storage behind it
        raise EyasError(f"--out {out}: {probe} is not on a disk (it reports no space at all); choose a directory "
                        "on a disk")
    free = usage.free
    log.info("needs about %.2f GB on disk; %.2f GB free at %s", need / 1e9, free / 1e9, probe)
    if need > free and not force:
        raise EyasError(f"--out {out}: about {need / 1e9:.2f} GB needed but only {free / 1e9:.2f} GB free; "
                        "free space, lower the sample count, split with --num-shards, or pass --force")


def prepare_out(out: Path, pid: str, force: bool) -> None:
    """Make `out` ready: fresh, a resumable run of the same plan, or (with --force) wiped."""
    refuse_symlink_out(out)
    out.mkdir(parents=True, exist_ok=True)
    plan_file, manifest = out / PLAN_FILE, out / "manifest.json"
    previous = None
    for f in (plan_file, manifest):
        if f.is_file():
            try:
                previous = json.loads(f.read_text()).get("plan_id")
            except (ValueError, AttributeError):  # damaged or not ours: other content
                previous = None
            break
    foreign = any(out.iterdir()) and previous != pid
    if foreign and not force:
        raise EyasError(f"--out {out} holds other content (not a capture of these arguments); "
                        "choose another --out or pass --force to replace it")
    if foreign:
        shutil.rmtree(out)
        out.mkdir(parents=True)
    fcap.write_json(plan_file, {"plan_id": pid})


# ---------------------------------------------------------------- running the target


class Forward:
    """Runs the target's decoder stack on padded batches and returns per-sample aux states,
    final-norm states, the target's full-vocabulary argmax where a loss reads it (`argmax`
    int32, -1 at positions whose next token is not supervised; only when the LM head is found)
    and, if asked, the pre-norm output of the last layer (what speculators stores).

    The argmax is the one product with the whole LM head that training needs (DESIGN 6: the
    out-of-vocabulary mask and acc_i): computed here once per capture, it is not recomputed by
    every training run from the stored states (a 49k x 576 product per token on SmolLM2)."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], device: torch.device, prenorm: bool):
        self.stack = targets.find_decoder_stack(model)
        self.layer_ids, self.device = layer_ids, device
        self.head = targets.output_head(model)
        self._ctx = targets.capture_aux(model, layer_ids)
        self.cap = self._ctx.__enter__()
        self.pre: torch.Tensor | None = None
        self._hook = self.stack.layers[-1].register_forward_hook(self._keep_pre) if prenorm else None

    def _keep_pre(self, module, args, output) -> None:
        self.pre = output[0] if isinstance(output, (tuple, list)) else output

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._ctx.__exit__(None, None, None)

    @torch.no_grad()
    def __call__(self, seqs: list[list[int]], loss_masks: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        loss = torch.zeros(len(seqs), T, dtype=torch.long)
        for b, (s, m) in enumerate(zip(seqs, loss_masks)):  # right padding; padded positions are never stored
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
            loss[b, : len(s)] = torch.tensor(m)
        sup = ttt.predicts_supervised(loss)
        self.cap.clear()
        self.stack.base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        aux, last = self.cap.aux(), self.cap.last  # (B, T, n*H), (B, T, H)
        argmax = None
        if self.head is not None:
            argmax = torch.full((len(seqs), T), -1, dtype=torch.int32)
            sup_d = sup.to(last.device)
            chunk = 256 if last.device.type == "cpu" else 8192  # rows of (chunk, V) logits at a time
            argmax[sup] = ttt.vocab_argmax(last[sup_d], self.head.to(last.dtype), chunk).to(torch.int32).cpu()
        out = []
        for b, s in enumerate(seqs):
            n = len(s)
            row = {"aux": aux[b, :n].cpu(), "last": last[b, :n].cpu()}
            if argmax is not None:
                row["argmax"] = argmax[b, :n]
            if self.pre is not None:
                row["pre"] = self.pre[b, :n].cpu()
            out.append(row)
        return out


# ---------------------------------------------------------------- the manifest


def build_manifest(common: dict, pid: str, records: list, shards: list[list[int]], mine: list[int],
                   out: Path, part: dict | None) -> dict:
    """The manifest for shards `mine` (hashes read back from disk). Deterministic: no times."""
    samples, shard_entries = [], []
    for k in mine:
        name, offset = fcap.shard_name(k), 0
        for i in shards[k]:
            r = records[i]
            samples.append({"index": i, "id": r.id, "split": r.split, "shard": name,
                            "offset": offset, "length": len(r.input_ids)})
            offset += len(r.input_ids)
        shard_entries.append({"file": name, "sha256": fcap.sha256_file(out / name), "samples": len(shards[k]),
                              "tokens": offset, "bytes": (out / name).stat().st_size})
    return {**common, "format": fcap.FORMAT, "version": fcap.VERSION, "plan_id": pid,
            "num_planned_shards": len(shards), "part": part, "num_samples": len(samples),
            "num_tokens": sum(s["length"] for s in samples), "samples": samples, "shards": shard_entries}


def finish(out: Path, manifest: dict, records: list, spec_dir: Path | None, prov: dict) -> None:
    """Manifest last; provenance beside it; the speculators dataset for a whole capture."""
    fcap.write_json(out / "provenance.json", prov)
    if spec_dir is not None and manifest["part"] is None:
        n_train = sum(1 for r in records if r.split == "train")
        ffeat.speculators_write_dataset(spec_dir, [r.input_ids for r in records],
                                        [r.loss_mask for r in records], n_train, manifest["layer_ids"])
    fcap.write_json(out / "manifest.json", manifest)
    (out / PLAN_FILE).unlink(missing_ok=True)


# ---------------------------------------------------------------- the capture stage


def capture(cfg: CaptureConfig) -> dict:
    """Run `eyas capture` for `cfg` (resolving and loading the target)."""
    cfg = resolve_dtype(cfg, targets.fast_dtype)  # auto: bf16 where the machine runs it natively, else fp32
    engine_args = check(cfg)
    path = targets.resolve(cfg.target)
    tcfg = targets.load_config(path)
    layer_ids = targets.parse_layers(cfg.layers, tcfg.num_hidden_layers)
    if tcfg.num_hidden_layers in layer_ids:
        log.warning("--layers %s: id %d is the final-norm output; SGLang and vLLM never capture it, so a drafter "
                    "trained on it can be benched by eyas but not served", cfg.layers, tcfg.num_hidden_layers)
    targets.parse_dtype(cfg.dtype)
    device = targets.parse_device(cfg.device)
    refuse_out_over_inputs(cfg.out, {"--data": cfg.data, "--target": targets.local_dir(cfg.target)})
    manifest, records = fcap.read_prepared(cfg.data)
    common = {"target": str(path), "target_fingerprint": targets.fingerprint(path),
              "data": str(Path(cfg.data).resolve()), "data_fingerprint": fcap.data_fingerprint(cfg.data),
              "layer_ids": layer_ids, "hidden_size": tcfg.hidden_size, "num_layers": tcfg.num_hidden_layers,
              "dtype": cfg.dtype, "last_state": fcap.LAST_STATE, "shard_mb": cfg.shard_mb}
    if not targets.same_target(path, manifest.get("target_fingerprint")):
        raise EyasError(f"--data {cfg.data} was prepared for target fingerprint {manifest['target_fingerprint']}, "
                        f"not {common['target_fingerprint']} ({path}); prepare the data for this target")
    V = tcfg.vocab_size
    bad = next((r for r in records if any(not 0 <= t < V for t in r.input_ids)), None)
    if bad is not None:
        raise EyasError(f"--data {cfg.data}: sample {bad.id} holds token ids outside 0..{V - 1}; "
                        "it was prepared for another tokenizer: prepare it for this target")
    if cfg.engine == "vllm":
        return capture_with_vllm(path, records, common, cfg, engine_args)
    model, _ = targets.load(path, dtype=cfg.dtype, device=str(device))
    return capture_records(model, records, common, cfg, device)


def capture_with_vllm(path: Path, records: list, common: dict, cfg: CaptureConfig, engine_args) -> dict:
    """`eyas capture --engine vllm`: the same plan, disk estimate, shards and manifest as
    `capture_records`, the states from vLLM (`serve.vllm_capture`, in a child process); the
    target is never loaded here."""
    from eyas.serve import vllm_capture, vllm_engine

    vllm_engine.require()
    speculators = cfg.format == "speculators"
    common = {**common, "engine": "vllm", fcap.ARGMAX_KEY: True}  # joins the plan id: engines never mix in one capture
    lengths = [len(r.input_ids) for r in records]
    bpt = fcap.bytes_per_token(common["hidden_size"], len(common["layer_ids"]), targets.parse_dtype(common["dtype"]))
    shards = plan_shards(lengths, bpt, int(cfg.shard_mb * 1_000_000))
    pid = plan_id(common, shards)
    mine = [k for k in range(len(shards)) if k % cfg.num_shards == cfg.shard_index]
    need = sum(lengths[i] for k in mine for i in shards[k]) * bpt * (2 if speculators else 1)
    check_disk(cfg.out, need, cfg.force)
    prepare_out(cfg.out, pid, cfg.force)
    counts = vllm_capture.capture_shards(path, cfg.data, cfg.out, common["layer_ids"], common["num_layers"],
                                         common["dtype"], shards, mine, speculators, cfg.device, engine_args)
    shutil.rmtree(cfg.out / vllm_capture.SPOOL, ignore_errors=True)
    part = {"index": cfg.shard_index, "count": cfg.num_shards} if cfg.num_shards > 1 else None
    m = build_manifest(common, pid, records, shards, mine, cfg.out, part)
    spec_dir = cfg.out / "speculators" if speculators else None
    finish(cfg.out, m, records, spec_dir, provenance(cfg))
    return {"out": str(cfg.out), "samples": m["num_samples"], "tokens": m["num_tokens"], "shards": len(mine),
            "bytes_per_token": bpt, "layer_ids": common["layer_ids"], "part": part, "engine": "vllm", **counts}


def capture_records(model: torch.nn.Module, records: list, common: dict, cfg: CaptureConfig,
                    device: torch.device = torch.device("cpu")) -> dict:
    """Capture `records` with an already loaded `model` (any wrapper whose decoder stack
    `targets.find_decoder_stack` finds) into `cfg.out`; resumable."""
    speculators = cfg.format == "speculators"
    fwd = Forward(model, common["layer_ids"], device, prenorm=speculators)  # fails fast: no layers found
    if fwd.head is not None:
        common = {**common, fcap.ARGMAX_KEY: True}
    lengths = [len(r.input_ids) for r in records]
    dtype = targets.parse_dtype(common["dtype"])
    bpt = fcap.bytes_per_token(common["hidden_size"], len(common["layer_ids"]), dtype)
    shards = plan_shards(lengths, bpt, int(cfg.shard_mb * 1_000_000))
    pid = plan_id(common, shards)
    mine = [k for k in range(len(shards)) if k % cfg.num_shards == cfg.shard_index]
    need = sum(lengths[i] for k in mine for i in shards[k]) * bpt * (2 if speculators else 1)
    spec_dir = cfg.out / "speculators" if speculators else None
    try:
        check_disk(cfg.out, need, cfg.force)
        prepare_out(cfg.out, pid, cfg.force)

        def produce(idx: list[int], tick: Callable[[int], object]) -> list[dict]:
            got: dict[int, dict] = {}
            for batch in plan_capture_batches(idx, lengths, cfg.batch_tokens):
                got.update(zip(batch, fwd([records[i].input_ids for i in batch],
                                          [records[i].loss_mask for i in batch])))
                tick(sum(lengths[i] for i in batch))
            return [got[i] for i in idx]

        counts = fcap.write_shards(cfg.out, records, shards, mine, produce, spec_dir)
    finally:
        fwd.close()
    part = {"index": cfg.shard_index, "count": cfg.num_shards} if cfg.num_shards > 1 else None
    m = build_manifest(common, pid, records, shards, mine, cfg.out, part)
    finish(cfg.out, m, records, spec_dir, provenance(cfg))
    return {"out": str(cfg.out), "samples": m["num_samples"], "tokens": m["num_tokens"], "shards": len(mine),
            "bytes_per_token": bpt, "layer_ids": common["layer_ids"], "part": part, **counts}


# ---------------------------------------------------------------- merge


def run_validate(args: ValidateConfig) -> int:
    reader = fcap.CaptureReader(args.capture, verify=True)
    summary = {"capture": str(args.capture), **reader.validate(args.data)}
    emit(args, summary, f"{args.capture}: {summary['samples']} samples, {summary['tokens']} tokens, "
         f"{summary['shards']} shards: all hashes, shapes and values check out"
         + (f", tokens match {args.data}" if args.data else ""))
    return 0


def run_merge(args: MergeConfig) -> int:
    summary = merge(args.parts, args.out, args.force)
    emit(args, summary, f"merged {len(args.parts)} parts: {summary['samples']} samples, "
         f"{summary['shards']} shards -> {args.out}")
    return 0


def merge(parts: list[Path], out: Path, force: bool = False) -> dict:
    """Join part captures of one plan into `out`, equal to a single uninterrupted run."""
    ms = [fcap.read_manifest(p) for p in parts]
    keys = ("plan_id", "target_fingerprint", "data_fingerprint", "layer_ids", "dtype", "hidden_size")
    for p, m in zip(parts, ms):
        diff = [k for k in keys if m.get(k) != ms[0].get(k)]
        if diff:
            raise EyasError(f"capture part {p} differs from {parts[0]} in {diff}; merge parts of one capture only")
        if m.get("part") is None:
            raise EyasError(f"capture {p} is not a part (no --num-shards); it needs no merge")
    count = ms[0]["part"]["count"]
    seen = sorted(m["part"]["index"] for m in ms)
    if seen != list(range(count)):
        raise EyasError(f"capture parts: got indices {seen}, need each of 0..{count - 1} exactly once; "
                        "pass every part directory")
    refuse_out_over_inputs(out, {"capture part": list(parts)})
    for p, m in zip(parts, ms):  # every part checked before --out is touched
        for s in m["shards"]:
            if fcap.sha256_file(p / s["file"]) != s["sha256"]:
                raise EyasError(f"capture shard {p / s['file']} is corrupted or truncated (sha256 differs); "
                                "delete it and rerun that part's `eyas capture` command")
    merged = _merged_manifest(ms)
    recs = _records_from_parts(parts, ms)
    with atomic_dir(out, force=force) as tmp:  # a failed merge leaves --out as it was
        for p, m in zip(parts, ms):
            for s in m["shards"]:
                shutil.copyfile(p / s["file"], tmp / s["file"])
            spec = p / "speculators" / "hidden_states"
            if spec.is_dir():
                shutil.copytree(spec, tmp / "speculators" / "hidden_states", dirs_exist_ok=True)
        spec_dir = tmp / "speculators" if (tmp / "speculators").is_dir() else None
        cfg = MergeConfig(parts=[Path(p) for p in parts], out=Path(out), force=force)
        finish(tmp, merged, recs, spec_dir, {"merged_from": [str(p) for p in parts], **provenance(cfg)})
    return {"out": str(out), "samples": merged["num_samples"], "tokens": merged["num_tokens"],
            "shards": len(merged["shards"])}


def _merged_manifest(ms: list[dict]) -> dict:
    m = dict(ms[0])
    m["samples"] = sorted((s for x in ms for s in x["samples"]), key=lambda s: s["index"])
    m["shards"] = sorted((s for x in ms for s in x["shards"]), key=lambda s: s["file"])
    m["part"] = None
    m["num_samples"] = len(m["samples"])
    m["num_tokens"] = sum(s["length"] for s in m["samples"])
    return m


def _records_from_parts(parts: list[Path], ms: list[dict]) -> list:
    recs = []
    for p in parts:
        r = fcap.CaptureReader(p, verify=False)
        for i, s in enumerate(r.samples):
            t = r[i]
            recs.append(fcap.Record(s["index"], s["split"], s["id"], t["input_ids"].tolist(),
                                    t["loss_mask"].tolist()))
    return sorted(recs, key=lambda r: r.index)


# ---------------------------------------------------------------- import


def run_import(args: ImportConfig) -> int:
    summary = import_features(args.source_format, args.source, args.target, args.out, args.layers,
                              args.train_ratio, args.shard_mb, args.force)
    emit(args, summary, f"imported {summary['samples']} samples / {summary['tokens']} tokens from "
         f"{args.source_format} {args.source} -> {args.out}")
    return 0


def import_features(kind: str, src: Path, target: str, out: Path, layers: str = "auto",
                    train_ratio: float | None = None, shard_mb: float = 512, force: bool = False) -> dict:
    """Convert speculators/SpecForge features into an eyas capture at `out`."""
    if not src.is_dir():
        raise EyasError(f"{kind} features {src}: no such directory")
    refuse_out_over_inputs(out, {"source": src, "--target": targets.local_dir(target)})
    if train_ratio is not None and not 0.0 < train_ratio <= 1.0:
        raise EyasError(f"--train-ratio {train_ratio} must lie in (0, 1]")
    check_shard_mb(shard_mb)
    path = targets.resolve(target)
    tcfg = targets.load_config(path)
    layer_ids = targets.parse_layers(layers, tcfg.num_hidden_layers)
    rec = ffeat.speculators_recorded(src) if kind == "speculators" else {}
    if rec.get("layer_ids") is not None:
        if layers != "auto" and layer_ids != rec["layer_ids"]:
            raise EyasError(f"--layers {layers}: {src / ffeat.SPECULATORS_INFO} records that these features hold "
                            f"layers {rec['layer_ids']}; drop --layers or pass those")
        layer_ids = [int(i) for i in rec["layer_ids"]]
    if kind == "specforge":
        files = ffeat.specforge_files(src)
        items = [lambda f=f: ffeat.read_specforge(f) for f in files]
    else:
        model, _ = targets.load(path)
        items = ffeat.speculators_items(src, targets.find_decoder_stack(model).norm)
    if not items:
        raise EyasError(f"{kind} features {src}: no samples found")
    first = items[0]()
    H, n_aux = tcfg.hidden_size, len(layer_ids)
    if first["aux"].shape[-1] != n_aux * H or first["last"].shape[-1] != H:
        raise EyasError(f"{kind} features {src}: aux width {first['aux'].shape[-1]} / last width "
                        f"{first['last'].shape[-1]} do not fit {n_aux} layers x hidden {H} of {path}; "
                        "pass the right --target and --layers")
    dtype = first["aux"].dtype
    if dtype not in fcap.DTYPE_NAMES:
        raise EyasError(f"{kind} features {src}: dtype {dtype} is not supported (fp32, bf16, fp16)")
    if train_ratio is not None:
        n_train = int(len(items) * train_ratio)
    elif rec.get("train_samples") is not None:
        n_train = min(int(rec["train_samples"]), len(items))  # the split the export recorded
    else:
        n_train = len(items)
        log.warning("capture import: every sample is marked train (no eval split): training will evaluate on "
                    "training data; pass --train-ratio 0.95 to hold some out")
    rows = _collect(items, dtype, n_train)
    records = [fcap.Record(i, split, f"{kind}-{i}", r["input_ids"].tolist(), r["loss_mask"].tolist())
               for i, (split, r) in enumerate(rows)]
    common = {"target": str(path), "target_fingerprint": targets.fingerprint(path), "data": str(src.resolve()),
              "data_fingerprint": f"import:{kind}", "layer_ids": layer_ids, "hidden_size": H,
              "num_layers": tcfg.num_hidden_layers, "dtype": fcap.DTYPE_NAMES[dtype],
              "last_state": fcap.LAST_STATE, "shard_mb": shard_mb}
    bpt = fcap.bytes_per_token(H, n_aux, dtype)
    shards = plan_shards([len(r.input_ids) for r in records], bpt, int(shard_mb * 1_000_000))
    pid = plan_id(common, shards)
    check_disk(out, sum(len(r.input_ids) for r in records) * bpt, force)
    prepare_out(out, pid, force)
    fcap.write_shards(out, records, shards, list(range(len(shards))), lambda idx, tick: [rows[i][1] for i in idx], None)
    m = build_manifest(common, pid, records, shards, list(range(len(shards))), out, None)
    cfg = ImportConfig(source=src, source_format=kind, target=target, out=out, layers=layers, train_ratio=train_ratio,
                       shard_mb=shard_mb, force=force)
    finish(out, m, records, None, {"imported_from": {"format": kind, "dir": str(src)}, **provenance(cfg)})
    return {"out": str(out), "samples": m["num_samples"], "tokens": m["num_tokens"], "shards": len(shards)}


def _collect(items: list[Callable[[], dict]], dtype: torch.dtype, n_train: int) -> list[tuple[str, dict]]:
    rows = []
    for i, load in enumerate(items):
        r = load()
        r["aux"], r["last"] = r["aux"].to(dtype), r["last"].to(dtype)
        if not bool(torch.isfinite(r["aux"]).all() and torch.isfinite(r["last"]).all()):
            raise EyasError(f"imported sample {i} holds NaN/inf hidden states; regenerate it")
        rows.append(("train" if i < n_train else "eval", r))
    return rows
