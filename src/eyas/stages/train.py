"""`eyas train`: EAGLE-3 training-time-test training of a drafter, offline from captured
features (`--capture`) or with the target running in-process (`--online --data`).

This driver resolves and validates the inputs (target, features, vocabulary, init
checkpoint, run directory) and hands a ready drafter and feature source to
`eyas.stages.trainer.Trainer`. The same command runs under `torchrun` (DDP; `--fsdp` to shard).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eyas import targets
from eyas.config import add_arguments, arg, from_namespace, to_json
from eyas.core import vocab as core_vocab
from eyas.core.drafter import DrafterConfig, Eagle3Drafter
from eyas.core.ttt import Target
from eyas.errors import EyasError
from eyas.stages.common import (emit, provenance, refuse_out_over_inputs, refuse_symlink_out, resolve_dtype,
                               write_json_atomic)

log = logging.getLogger(__name__)

HELP = """\
Defaults are chosen for one-layer drafters on small targets: Muon on the hidden matrices (fc,
the midlayer's projections) and AdamW on the draft head and norms (betas 0.9/0.95, no weight
decay; --optimizer adamw for AdamW on all), lr 1e-3 (speculators' default; the head starts from
the target's; Muon's steps are scaled to AdamW's RMS, so one lr serves both), linear warmup over
3% of the steps then cosine to 0, gradient clipping at 1.0, TTT length 7, loss weight 0.8**i.
The drafter's embedding is the target's (frozen) and its lm_head starts from the target's
lm_head rows of the draft ids; fc reads the aux features with a per-channel gain (--aux-gain),
folded into fc.weight in every checkpoint. Writes RUN/metrics.jsonl, RUN/checkpoints/step-N
(+ training state), RUN/best (highest simulated acceptance length), RUN/final,
RUN/plots/curves.png.

Multi-process: torchrun --nproc-per-node 4 -m eyas train ...   (one node)
  torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port 29500 --nproc-per-node 8 \\
      -m eyas train ...                                         (each node; NCCL on GPU, gloo on CPU)
"""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """`eyas train`: one field per flag; the Trainer reads the same object."""

    target: str = arg("built-in name or local HF directory")
    capture: list[Path] | None = arg("captured features (eyas capture); several directories of the same target "
                                     "and layers are trained on together", None, group="source",
                                     group_required=True)
    online: bool = arg("run the target in-process on --data", False, group="source")
    data: Path | None = arg("prepared data directory (with --online)", None)
    layers: str = arg("aux layers for --online: auto = [2, L//2, L-3] or i,j,k", "auto")
    vocab: str = arg("vocab file (eyas vocab build), or `from-checkpoint` to keep --init-from's own mapping")
    out: Path = arg("run directory")
    ttt: int = arg("TTT unroll length K", 7)
    epochs: int = arg("passes over the training split", 1)
    lr: float = arg("peak learning rate", 1e-3)
    batch_tokens: int = arg("padded tokens per optimizer step (batch x longest sample)", 8192)
    max_len: int = arg("truncate samples to this many tokens", 2048)
    drafter_flags: str = arg("architecture flags of a new drafter, comma list of norm_before_residual, "
                             "norm_before_fc, fc_norm, norm_output; default none = the layout every engine serves",
                             "")
    init_from: Path | None = arg("start from this drafter checkpoint (any layout)", None)
    remap: bool = arg("with --init-from: carry lm_head rows by target id when the vocabularies differ", False)
    resume: bool = arg("continue RUN from its newest checkpoint", False)
    max_steps: int | None = arg("stop after this many optimizer steps (0: evaluate only)", None)
    time_budget: float | None = arg("minutes of training; the schedule follows steps or time, whichever is further "
                                    "along (see the epilog)", None, metavar="MIN")
    eval_every: int = arg("evaluate + checkpoint every S steps", 200)
    seed: int = arg("seed for init and data order", 0)
    dtype: str = arg("compute dtype (autocast; master weights stay fp32); auto = bf16 where the machine runs it "
                     "natively, else fp32", "auto", choices=("auto", "bf16", "fp32"))
    device: str = arg("cpu, cuda, cuda:N or auto (under torchrun: cuda = local rank)", "cpu")
    warmup_ratio: float = arg("share of steps for linear warmup", 0.03)
    grad_clip: float = arg("max gradient norm, 0 = off", 1.0)
    optimizer: str = arg("muon: Muon on the hidden matrices, AdamW on the rest; adamw: AdamW on all", "muon",
                         choices=("muon", "adamw"))
    weight_decay: float = arg("decoupled weight decay, both optimizers (default 0)", 0.0)
    keep_last: int = arg("step checkpoints to keep", 2)
    fsdp: bool = arg("shard the drafter with FSDP (fully_shard) under torchrun", False)
    aux_gain: str = arg("fc input scaling: rms = per-channel power-of-two gain to RMS ~1, folded into fc.weight "
                        "in every checkpoint; off = raw features", "rms", choices=("rms", "off"))
    align_topk: int = arg("train later TTT steps only on slots top-k drafting reaches (GRIFFIN's misalignment "
                          "mask; e.g. 4); 0 = off (default 0)", 0)
    force: bool = arg("start over in a non-empty --out", False)
    json: bool = arg("print a machine-readable JSON summary", False)
    log_every: int = arg("log training metrics every N steps", 10, cli=False)
    target_chunk: int | None = arg("rows per chunk of the target table (None: core.ttt.TABLE_CHUNK by device)",
                                   None, cli=False)


def register(sub) -> None:
    p = sub.add_parser("train", help="train an EAGLE-3 drafter (training-time test)",
                       description=__doc__.split("\n\n")[0], epilog=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, TrainConfig)
    p.set_defaults(func=lambda args: train(from_namespace(TrainConfig, args)))


# ---------------------------------------------------------------- validation


def check(cfg: TrainConfig) -> dict[str, bool]:
    """Exit 2 on flag values that cannot work; returns the parsed --drafter-flags."""
    bad = [(f, v) for f, v in (("--ttt", cfg.ttt), ("--epochs", cfg.epochs), ("--batch-tokens", cfg.batch_tokens),
                               ("--eval-every", cfg.eval_every), ("--keep-last", cfg.keep_last)) if v < 1]
    if bad:
        example = {"--ttt": 7, "--epochs": 3, "--batch-tokens": 4096, "--eval-every": 200, "--keep-last": 3}
        raise EyasError(f"{bad[0][0]} {bad[0][1]} must be a positive integer; e.g. {bad[0][0]} {example[bad[0][0]]}")
    if cfg.align_topk < 0:
        raise EyasError(f"--align-topk {cfg.align_topk} must be >= 0 (0 = off); e.g. --align-topk 4")
    if not 0 < cfg.lr < math.inf:
        raise EyasError(f"--lr {cfg.lr} must be a positive finite number; e.g. --lr 1e-3")
    for flag, v in (("--grad-clip", cfg.grad_clip), ("--weight-decay", cfg.weight_decay)):
        if not 0 <= v < math.inf:
            raise EyasError(f"{flag} {v} must be a finite number >= 0 (0 = off)")
    if cfg.max_len < 3:
        raise EyasError(f"--max-len {cfg.max_len} is too short; TTT needs at least 3 tokens (e.g. 2048)")
    if cfg.max_steps is not None and cfg.max_steps < 0:
        raise EyasError(f"--max-steps {cfg.max_steps} must be >= 0")
    if cfg.time_budget is not None and not 0 < cfg.time_budget < math.inf:
        raise EyasError(f"--time-budget {cfg.time_budget} must be a positive number of minutes; e.g. --time-budget 10")
    if not 0 <= cfg.warmup_ratio < 1:
        raise EyasError(f"--warmup-ratio {cfg.warmup_ratio} must lie in [0, 1)")
    if cfg.fsdp and cfg.optimizer == "muon":
        raise EyasError("--optimizer muon orthogonalises whole matrices, which --fsdp shards across processes; "
                        "add --optimizer adamw, or drop --fsdp (DDP keeps whole matrices)")
    if cfg.online and cfg.data is None:
        raise EyasError("--online needs --data DIR (prepared data, eyas data prepare)")
    flags = parse_drafter_flags(cfg.drafter_flags)
    if flags and cfg.init_from:
        raise EyasError("--drafter-flags applies to a new drafter; --init-from keeps the checkpoint's own flags "
                        "(drop one of them)")
    if cfg.remap and not cfg.init_from:
        raise EyasError("--remap only applies with --init-from CKPT")
    if cfg.vocab == "from-checkpoint" and not cfg.init_from:
        raise EyasError("--vocab from-checkpoint needs --init-from CKPT")
    refuse_out_over_inputs(cfg.out, {"--capture": cfg.capture, "--data": cfg.data, "--vocab": cfg.vocab,
                                      "--init-from": cfg.init_from, "--target": targets.local_dir(cfg.target)})
    refuse_symlink_out(cfg.out)
    return flags


def _target_dir(spec: str) -> Path:
    return targets.resolve(spec)


def _some_supervised(masks, max_len: int, what: str) -> None:
    """Exit 2 unless some training sample keeps a supervised token within --max-len (a token
    after the first: the first has no features before it). Else training would run, learn
    nothing and report a loss of 0."""
    if not any(bool(torch.as_tensor(m)[1:max_len].any()) for m in masks):
        raise EyasError(f"{what}: no training sample has a supervised token within the first --max-len {max_len} "
                        "tokens (the answers start later); raise --max-len")


def _features(cfg, tdir: Path, tcfg, model, dist_) -> tuple[object, list[int], str]:
    """(feature source, aux layer ids, description) after checking them against the target."""
    from eyas.formats import features

    fp = targets.fingerprint(tdir)
    L = tcfg.num_hidden_layers
    if cfg.online:
        from eyas.formats.data import read_manifest, read_samples
        from eyas.targets.online import OnlineSource

        m = read_manifest(cfg.data)
        if not targets.same_target(tdir, m.get("target_fingerprint") or "none"):
            raise EyasError(f"{cfg.data}/manifest.json was prepared for target fingerprint "
                            f"{m.get('target_fingerprint')} but --target {tdir} has {fp}; prepare the data "
                            "for this target (eyas data prepare --target ...)")
        layers = targets.parse_layers(cfg.layers, L)
        splits = {s: read_samples(cfg.data, s) for s in ("train", "eval")}
        _some_supervised((s.loss_mask for s in splits["train"]), cfg.max_len, f"--data {cfg.data}")
        return OnlineSource(splits, model, layers, cfg.max_len), layers, str(cfg.data)
    from eyas.formats.capture import CaptureReader

    readers = []
    for cap in cfg.capture:
        reader = CaptureReader(cap)
        reader.open_all()  # a missing or damaged shard fails here, before --out is created
        man = cap / "manifest.json"
        if not targets.same_target(tdir, reader.target_fingerprint or "none"):
            raise EyasError(f"{man} was captured from target fingerprint {reader.target_fingerprint} but --target "
                            f"{tdir} has {fp}; capture features from this target or pass the matching --target")
        bad = [i for i in reader.layer_ids if not 0 <= i <= L]
        if bad or reader.hidden_size != tcfg.hidden_size:
            raise EyasError(f"{man}: layer ids {reader.layer_ids} / hidden size {reader.hidden_size} do not fit "
                            f"--target {tdir} ({L} layers, hidden {tcfg.hidden_size}); recapture for this target")
        if readers and reader.layer_ids != readers[0].layer_ids:
            raise EyasError(f"{man}: layer ids {reader.layer_ids} differ from {cfg.capture[0]}'s "
                            f"{readers[0].layer_ids}; capture every --capture directory with the same --layers")
        readers.append(reader)
    splits = {s: features.CaptureSplit(readers, s) for s in ("train", "eval")}
    _some_supervised(splits["train"].loss_masks(), cfg.max_len, f"--capture {' '.join(map(str, cfg.capture))}")
    return features.TensorSource(splits, cfg.max_len), list(readers[0].layer_ids), ",".join(map(str, cfg.capture))


def _load_vocab(cfg, tcfg):
    from eyas.formats.vocab import load_vocab

    vm = load_vocab(cfg.vocab)
    if vm.target_size != tcfg.vocab_size:
        raise EyasError(f"vocab file {cfg.vocab} covers {vm.target_size} target ids but --target has "
                        f"{tcfg.vocab_size}; build the vocabulary for this target (eyas vocab build)")
    return vm


def _check_vocab_tokenizer(cfg, vm, tok) -> None:
    """Same size is not same tokens (Llama 2 and Mistral both have 32,000 ids): a vocabulary
    built on data of another tokenizer would pick the wrong frequent tokens, silently."""
    recorded = vm.meta.get("tokenizer_fingerprint") if vm is not None else None
    own = targets.tokenizer_fingerprint(tok) if recorded else None
    if recorded and own != recorded:
        raise EyasError(f"vocab file {cfg.vocab} was built from data tokenized by another tokenizer "
                        f"(fingerprint {recorded}, --target's is {own}); build the vocabulary on data "
                        "prepared for this target (eyas vocab build)")


# ---------------------------------------------------------------- building the drafter


def _set_vocab(d: Eagle3Drafter, ids: torch.Tensor) -> None:
    d.d2t.copy_(core_vocab.d2t_from_ids(ids))
    d.t2d.copy_(core_vocab.t2d_from_ids(ids, d.cfg.vocab_size))


def parse_drafter_flags(text: str) -> dict[str, bool]:
    from eyas.formats.engines import FLAGS

    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in FLAGS]
    if unknown:
        raise EyasError(f"--drafter-flags {text}: unknown flag {unknown[0]!r}; choose from {', '.join(FLAGS)}")
    if "norm_before_fc" in names and "fc_norm" in names:
        raise EyasError(f"--drafter-flags {text}: norm_before_fc and fc_norm exclude each other; keep one")
    return {n: True for n in names}


def fresh_drafter(tcfg, ids: torch.Tensor, aux: list[int], embed: torch.Tensor, head: torch.Tensor,
                  seed: int, flags: dict[str, bool] | None = None) -> Eagle3Drafter:
    """A new drafter sized like the target: embedding = the target's (frozen), lm_head = the
    target's lm_head rows of the draft ids (as speculators does; training starts far above chance)."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig.from_target(tcfg, ids.numel(), aux, **(flags or {})))
    d.load_target_embedding(embed)
    with torch.no_grad():
        d.lm_head.weight.copy_(head[ids])
    _set_vocab(d, ids)
    return d


def _read_init(ckpt: Path) -> tuple[DrafterConfig, dict, dict]:
    from eyas.formats import checkpoint as ck

    ckpt, _ = ck.resolve_drafter(ckpt)  # a training run stands for its best/ (else final/)
    if ck.is_eyas_checkpoint(ckpt):
        d, meta = ck.load_checkpoint(ckpt)
        return d.cfg, d.trainable_state_dict(), meta
    try:
        from eyas.formats.engines import import_checkpoint
    except ImportError as e:
        raise EyasError(f"--init-from {ckpt}: not an eyas checkpoint, and this eyas cannot import other "
                        "layouts; convert it with `eyas convert` first") from e
    return import_checkpoint(ckpt)


def init_drafter(tc: TrainConfig, tcfg, vm, aux: list[int], embed: torch.Tensor, head: torch.Tensor,
                 tokenizer_fp: str | None = None) -> tuple[Eagle3Drafter, dict]:
    """The drafter to train from --init-from, with the vocabulary decision made explicit."""
    cfg, state, meta = _read_init(tc.init_from)
    meta = meta if isinstance(meta, dict) else {}
    trained = meta.get("eyas") if isinstance(meta.get("eyas"), dict) else meta  # an eyas export nests it
    recorded = trained.get("tokenizer_fingerprint") if isinstance(trained, dict) else None
    if recorded and tokenizer_fp and recorded != tokenizer_fp:  # same sizes are not same tokens
        raise EyasError(f"--init-from {tc.init_from}: trained for a target with another tokenizer (fingerprint "
                        f"{recorded}, --target's is {tokenizer_fp}): its lm_head rows and d2t name other tokens; "
                        "initialise from a drafter of this target's tokenizer")
    hidden = {cfg.target_hidden_size, cfg.hidden_size}  # the drafter embeds with the target's embedding
    if cfg.vocab_size != tcfg.vocab_size or hidden != {tcfg.hidden_size}:
        raise EyasError(f"--init-from {tc.init_from}: drafter for vocab {cfg.vocab_size} / hidden "
                        f"{cfg.target_hidden_size} (its own {cfg.hidden_size}), but --target has {tcfg.vocab_size} / "
                        f"{tcfg.hidden_size}; initialise from a drafter of this target")
    if list(cfg.aux_layer_ids) != list(aux):
        raise EyasError(f"--init-from {tc.init_from}: drafter reads aux layers {cfg.aux_layer_ids} but the "
                        f"features hold {aux}; capture those layers (eyas capture --layers "
                        f"{','.join(map(str, cfg.aux_layer_ids))})")
    old_ids = core_vocab.target_ids(state["d2t"])
    new_ids = old_ids if vm is None else vm.target_ids
    info = {"init_from": str(tc.init_from), "vocab": "checkpoint" if vm is None else "same"}
    if meta.get("note"):  # the import sorted a map held in another order
        log.info("--init-from %s: %s", tc.init_from, meta["note"])
        info["init_note"] = meta["note"]
    if vm is not None and not torch.equal(old_ids, new_ids):
        rep = core_vocab.compare_maps(old_ids, new_ids)
        if not tc.remap:
            raise EyasError(
                f"vocabulary mismatch: --init-from {tc.init_from} maps its {rep['size_a']} draft ids to other "
                f"target ids than --vocab {tc.vocab} ({rep['size_b']} ids): same position {rep['same_position']}"
                f"/{rep['size_b']}, overlap {rep['overlap']} ({rep['b_served_by_a']:.1%} of --vocab's ids held by "
                "the checkpoint); training across it would start from wrong lm_head rows. Fix: --remap (carry "
                "rows by target id), or --vocab from-checkpoint (keep the checkpoint's mapping)")
        head_w, carried = core_vocab.remap_rows(state["lm_head.weight"], old_ids, new_ids, head[new_ids])
        state = {**state, "lm_head.weight": head_w, "d2t": core_vocab.d2t_from_ids(new_ids),
                 "t2d": core_vocab.t2d_from_ids(new_ids, cfg.vocab_size)}
        cfg = replace(cfg, draft_vocab_size=new_ids.numel())
        info.update(vocab="remapped", rows_carried=carried, **{f"compare_{k}": v for k, v in rep.items()})
        log.info("remapped lm_head by target id: %d of %d rows carried", carried, new_ids.numel())
    d = Eagle3Drafter(cfg)
    benign = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")  # peers' frozen copies of target weights
    missing, unexpected = d.load_state_dict({k: v for k, v in state.items() if not k.startswith(benign)},
                                            strict=False)
    if [k for k in missing if not k.startswith("embed_tokens.")] or unexpected:
        raise EyasError(f"--init-from {tc.init_from}: missing keys {missing[:6]}, unexpected {unexpected[:6]}; "
                        "pass a one-layer EAGLE-3 drafter checkpoint")
    d.load_target_embedding(embed)
    return d, info


# ---------------------------------------------------------------- the run directory


def _prepare_out(cfg, dist_) -> None:
    out: Path = cfg.out
    busy = out.exists() and any(p.name not in ("metrics.jsonl",) for p in out.iterdir())
    if busy and not cfg.resume and not cfg.force:
        raise EyasError(f"--out {out} already holds a run; pass --resume to continue it, --force to start over, "
                        "or choose another --out")
    if dist_.main and busy and cfg.force and not cfg.resume:
        import shutil

        shutil.rmtree(out)
    if dist_.main:
        out.mkdir(parents=True, exist_ok=True)
    if dist_.world > 1:
        torch.distributed.barrier()


def _trim_metrics(out: Path, step: int) -> None:
    """Drop metric lines written after the checkpoint a resumed run restarts from."""
    f = out / "metrics.jsonl"
    if f.is_file():
        keep = [ln for ln in f.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
        f.write_text("".join(ln + "\n" for ln in keep))


def _recorded_gain(out: Path) -> dict:
    """The aux gain record of the run being resumed (run.json), so a resume neither measures it
    again (64k tokens of features; with --online, target forwards) nor forgets how it was made."""
    try:
        return {"aux_gain": json.loads((out / "run.json").read_text())["init"]["aux_gain"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {"aux_gain": "restored from the checkpoint's training state"}


def train(cfg: TrainConfig) -> int:
    """Run `eyas train` with `cfg` (also under torchrun: every rank calls this)."""
    from eyas.core.distributed import init_distributed
    from eyas.stages import trainer as tr

    cfg = resolve_dtype(cfg, targets.fast_dtype)  # auto: bf16 where the machine runs it natively, else fp32
    flags = check(cfg)
    device = targets.parse_device(cfg.device)
    dist_ = init_distributed(device)
    if device.type == "cuda" and dist_.world > 1:
        device = torch.device("cuda", int(__import__("os").environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    tdir = _target_dir(cfg.target)
    tcfg = targets.load_config(tdir)
    vm = None if cfg.vocab == "from-checkpoint" else _load_vocab(cfg, tcfg)
    model, tok = targets.load(tdir, dtype=cfg.dtype if cfg.online else "fp32",
                              device=str(device) if cfg.online else "cpu")
    _check_vocab_tokenizer(cfg, vm, tok)
    tokenizer_fp = targets.tokenizer_fingerprint(tok)
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    head = model.get_output_embeddings().weight.detach().float().cpu()
    source, aux, where = _features(cfg, tdir, tcfg, model, dist_)
    if not cfg.online:
        del model
    if cfg.init_from:
        drafter, init_info = init_drafter(cfg, tcfg, vm, aux, embed, head, tokenizer_fp)
    else:
        drafter = fresh_drafter(tcfg, vm.target_ids, aux, embed, head, cfg.seed, flags)
        init_info = {"init": "target head", **({"flags": sorted(flags)} if flags else {})}
    if not source.lengths("eval"):
        log.warning("no eval samples in %s: evaluating on the training split", where)
        source.splits["eval"] = source.splits["train"]
    if cfg.aux_gain == "rms" and cfg.resume and tr.checkpoint_steps(cfg.out):
        init_info.update(_recorded_gain(cfg.out))  # the gain itself comes with the checkpoint's state
    elif cfg.aux_gain == "rms":
        init_info.update(tr.apply_aux_gain(drafter, source, keep_function=bool(cfg.init_from)))
    _prepare_out(cfg, dist_)
    from eyas.formats.vocab import vocab_fingerprint

    meta = {"kind": "eyas.train", "target": str(tdir), "target_fingerprint": targets.fingerprint(tdir),
            "tokenizer_fingerprint": tokenizer_fp, "aux_layer_ids": aux, "features": where, "vocab": str(cfg.vocab),
            "vocab_fingerprint": vocab_fingerprint(drafter.d2t, drafter.cfg.vocab_size),
            # the longest position it was trained at (the doctor compares it with the served context)
            "trained_positions": max(source.lengths("train"), default=0),
            "train_config": {**to_json(cfg), "device": str(device)}, "init": init_info, "provenance": provenance(cfg)}
    scale, softcap = targets.logit_transform(tcfg)
    trainer = tr.Trainer(cfg, drafter, source, Target(head, meta["target_fingerprint"], scale, softcap),
                         cfg.out, meta, dist_, device)
    start = trainer.resume() if cfg.resume else 0
    if cfg.fsdp and dist_.world <= 1:  # after every check: bad input still gets its one line
        log.warning("--fsdp: one process, nothing to shard; launch with torchrun --nproc-per-node N")
    if dist_.main:
        if cfg.resume:
            _trim_metrics(cfg.out, start)
        write_json_atomic(cfg.out / "run.json", meta)
    result = trainer.run()
    if dist_.main:
        s = {"out": str(cfg.out), "resumed_from": start, **getattr(trainer, "summary", {}),
             "checkpoint": str(cfg.out / "final"), "best": str(cfg.out / "best")}
        acc = " ".join(f"acc_{i}={result.get(f'acc_{i}', 0):.3f}" for i in range(cfg.ttt))
        why = f" of {trainer.total} (--time-budget spent)" if trainer.stopped_by_time else ""
        emit(cfg, s, f"trained {trainer.step} steps{why} -> {cfg.out / 'final'}\n"
                      f"eval: loss {result.get('loss', float('nan')):.4f}  {acc}  "
                      f"simulated acceptance length {result.get('accept_len', float('nan')):.3f}")
    if dist_.world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        _leave_worker()
    return 0


def _leave_worker() -> None:
    """End a torchrun worker whose work is saved and whose process group is closed. On CPU,
    gloo + FSDP2 sometimes abort in C++ destructors at interpreter exit ("terminate called
    without an active exception", exit -6) after everything was written, which torchrun then
    reports as a failed run; leaving with os._exit(0) skips those destructors."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
