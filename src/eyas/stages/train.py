"""`eyas train`: EAGLE-3 training-time-test training of a drafter, offline from captured
features (`--capture`) or with the target running in-process (`--online --data`).

This driver resolves and validates the inputs (target, features, vocabulary, init
checkpoint, run directory) and hands a ready drafter and feature source to
`eyas.training.Trainer`. The same command runs under `torchrun` (DDP; `--fsdp` to shard).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import torch

from eyas import targets
from eyas.core import vocab as core_vocab
from eyas.core.drafter import DrafterConfig, Eagle3Drafter
from eyas.errors import EyasError
from eyas.stages.common import (add_json_flag, emit, provenance, refuse_out_over_inputs, refuse_symlink_out,
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


def register(sub) -> None:
    p = sub.add_parser("train", help="train an EAGLE-3 drafter (training-time test)",
                       description=__doc__.split("\n\n")[0], epilog=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="built-in name or local HF directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--capture", type=Path, nargs="+",
                     help="captured features (eyas capture); several directories of the same target and "
                     "layers are trained on together")
    src.add_argument("--online", action="store_true", help="run the target in-process on --data")
    p.add_argument("--data", type=Path, help="prepared data directory (with --online)")
    p.add_argument("--layers", default="auto", help="aux layers for --online: auto = [2, L//2, L-3] or i,j,k")
    p.add_argument("--vocab", required=True,
                   help="vocab file (eyas vocab build), or `from-checkpoint` to keep --init-from's own mapping")
    p.add_argument("--out", type=Path, required=True, help="run directory")
    p.add_argument("--ttt", type=int, default=7, help="TTT unroll length K (default 7)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training split (default 1)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per optimizer step (batch x longest sample; default 8192)")
    p.add_argument("--max-len", type=int, default=2048, help="truncate samples to this many tokens (default 2048)")
    p.add_argument("--drafter-flags", default="",
                   help="architecture flags of a new drafter, comma list of norm_before_residual, norm_before_fc, "
                   "fc_norm, norm_output (speculators' eagle3 training default: norm_before_residual,"
                   "norm_before_fc,norm_output). Default none = the EAGLE-3 layout every engine serves; "
                   "`eyas export` refuses a flag the chosen engine would ignore")
    p.add_argument("--init-from", type=Path, help="start from this drafter checkpoint (any layout)")
    p.add_argument("--remap", action="store_true",
                   help="with --init-from: carry lm_head rows by target id when the vocabularies differ")
    p.add_argument("--resume", action="store_true", help="continue RUN from its newest checkpoint")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (0: evaluate only)")
    p.add_argument("--time-budget", type=float, metavar="MIN",
                   help="minutes of training: the cosine schedule follows steps or time spent, whichever is "
                   "further along, and training stops (evaluated, saved as RUN/final) when the time is spent; "
                   "the run's end then depends on the machine's speed. Counts the optimizer loop with its "
                   "evaluations (not loading, the last evaluation or saving); carried across --resume, which may "
                   "change it. Default: none (every planned step)")
    p.add_argument("--eval-every", type=int, default=200, help="evaluate + checkpoint every S steps (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed for init and data order (default 0)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="compute dtype (autocast; master weights stay fp32). auto (default) = bf16 on CUDA and "
                   "AMX / AVX512-BF16 CPUs, else fp32 (bf16 without native support is several times slower)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (under torchrun: cuda = local rank)")
    p.add_argument("--warmup-ratio", type=float, default=0.03, help="share of steps for linear warmup (default 0.03)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm, 0 = off (default 1.0)")
    p.add_argument("--optimizer", default="muon", choices=("muon", "adamw"),
                   help="muon (default): Muon on the hidden matrices, AdamW on the rest; on the fp32 quickstart's "
                   "features it reached in 400 steps what AdamW reached in 855, and ended 1.09x higher in simulated "
                   "acceptance, but its Newton-Schulz iteration adds about 0.12 s per step (SmolLM2's drafter, bf16, "
                   "2-core Zen 4 CPU; negligible on a GPU), a cost per step, so it weighs less at large "
                   "--batch-tokens. adamw: AdamW on all")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="decoupled weight decay, both optimizers (default 0)")
    p.add_argument("--keep-last", type=int, default=2, help="step checkpoints to keep (default 2)")
    p.add_argument("--fsdp", action="store_true", help="shard the drafter with FSDP (fully_shard) under torchrun")
    p.add_argument("--aux-gain", default="rms", choices=("rms", "off"),
                   help="fc input scaling: rms (default) trains fc on aux features scaled per channel to RMS ~1 "
                   "(powers of two measured on the first 64k training tokens, folded into fc.weight in every "
                   "checkpoint, so engines see a plain fc); off = raw features")
    p.add_argument("--align-topk", type=int, default=0,
                   help="train later TTT steps only on slots top-k drafting reaches: position t counts at step i "
                   "only if the data's token was in the drafter's top-k at every earlier step (GRIFFIN's "
                   "misalignment mask; e.g. 4, the tree's top-k). Default 0 = off")
    p.add_argument("--force", action="store_true", help="start over in a non-empty --out")
    add_json_flag(p)
    p.set_defaults(func=run_train)


# ---------------------------------------------------------------- validation


def _check_args(args) -> None:
    bad = [(f, v) for f, v in (("--ttt", args.ttt), ("--epochs", args.epochs), ("--batch-tokens", args.batch_tokens),
                               ("--eval-every", args.eval_every), ("--keep-last", args.keep_last)) if v < 1]
    if bad:
        example = {"--ttt": 7, "--epochs": 3, "--batch-tokens": 4096, "--eval-every": 200, "--keep-last": 3}
        raise EyasError(f"{bad[0][0]} {bad[0][1]} must be a positive integer; e.g. {bad[0][0]} {example[bad[0][0]]}")
    if args.align_topk < 0:
        raise EyasError(f"--align-topk {args.align_topk} must be >= 0 (0 = off); e.g. --align-topk 4")
    if not 0 < args.lr < math.inf:
        raise EyasError(f"--lr {args.lr} must be a positive finite number; e.g. --lr 1e-3")
    for flag, v in (("--grad-clip", args.grad_clip), ("--weight-decay", args.weight_decay)):
        if not 0 <= v < math.inf:
            raise EyasError(f"{flag} {v} must be a finite number >= 0 (0 = off)")
    if args.max_len < 3:
        raise EyasError(f"--max-len {args.max_len} is too short; TTT needs at least 3 tokens (e.g. 2048)")
    if args.max_steps is not None and args.max_steps < 0:
        raise EyasError(f"--max-steps {args.max_steps} must be >= 0")
    if args.time_budget is not None and not 0 < args.time_budget < math.inf:
        raise EyasError(f"--time-budget {args.time_budget} must be a positive number of minutes; e.g. --time-budget 10")
    if not 0 <= args.warmup_ratio < 1:
        raise EyasError(f"--warmup-ratio {args.warmup_ratio} must lie in [0, 1)")
    if args.fsdp and args.optimizer == "muon":
        raise EyasError("--optimizer muon orthogonalises whole matrices, which --fsdp shards across processes; "
                        "add --optimizer adamw, or drop --fsdp (DDP keeps whole matrices)")
    if args.online and args.data is None:
        raise EyasError("--online needs --data DIR (prepared data, eyas data prepare)")
    args.flags = parse_drafter_flags(args.drafter_flags)
    if args.flags and args.init_from:
        raise EyasError("--drafter-flags applies to a new drafter; --init-from keeps the checkpoint's own flags "
                        "(drop one of them)")
    if args.remap and not args.init_from:
        raise EyasError("--remap only applies with --init-from CKPT")
    if args.vocab == "from-checkpoint" and not args.init_from:
        raise EyasError("--vocab from-checkpoint needs --init-from CKPT")
    refuse_out_over_inputs(args.out, {"--capture": args.capture, "--data": args.data, "--vocab": args.vocab,
                                      "--init-from": args.init_from, "--target": targets.local_dir(args.target)})
    refuse_symlink_out(args.out)


def _target_dir(spec: str) -> Path:
    return targets.resolve(spec)


def _some_supervised(masks, max_len: int, what: str) -> None:
    """Exit 2 unless some training sample keeps a supervised token within --max-len (a token
    after the first: the first has no features before it). Else training would run, learn
    nothing and report a loss of 0."""
    if not any(bool(torch.as_tensor(m)[1:max_len].any()) for m in masks):
        raise EyasError(f"{what}: no training sample has a supervised token within the first --max-len {max_len} "
                        "tokens (the answers start later); raise --max-len")


def _features(args, tdir: Path, tcfg, model, dist_) -> tuple[object, list[int], str]:
    """(feature source, aux layer ids, description) after checking them against the target."""
    from eyas import training

    fp = targets.fingerprint(tdir)
    L = tcfg.num_hidden_layers
    if args.online:
        from eyas.formats.data import read_manifest, read_samples

        m = read_manifest(args.data)
        if not targets.same_target(tdir, m.get("target_fingerprint") or "none"):
            raise EyasError(f"{args.data}/manifest.json was prepared for target fingerprint "
                            f"{m.get('target_fingerprint')} but --target {tdir} has {fp}; prepare the data "
                            "for this target (eyas data prepare --target ...)")
        layers = targets.parse_layers(args.layers, L)
        splits = {s: read_samples(args.data, s) for s in ("train", "eval")}
        _some_supervised((s.loss_mask for s in splits["train"]), args.max_len, f"--data {args.data}")
        return training.OnlineSource(splits, model, layers, args.max_len), layers, str(args.data)
    from eyas.formats.capture import CaptureReader

    readers = []
    for cap in args.capture:
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
            raise EyasError(f"{man}: layer ids {reader.layer_ids} differ from {args.capture[0]}'s "
                            f"{readers[0].layer_ids}; capture every --capture directory with the same --layers")
        readers.append(reader)
    splits = {s: training.CaptureSplit(readers, s) for s in ("train", "eval")}
    _some_supervised(splits["train"].loss_masks(), args.max_len, f"--capture {' '.join(map(str, args.capture))}")
    return training.TensorSource(splits, args.max_len), list(readers[0].layer_ids), ",".join(map(str, args.capture))


def _load_vocab(args, tcfg):
    from eyas.formats.vocab import load_vocab

    vm = load_vocab(args.vocab)
    if vm.target_size != tcfg.vocab_size:
        raise EyasError(f"vocab file {args.vocab} covers {vm.target_size} target ids but --target has "
                        f"{tcfg.vocab_size}; build the vocabulary for this target (eyas vocab build)")
    return vm


def _check_vocab_tokenizer(args, vm, tok) -> None:
    """Same size is not same tokens (Llama 2 and Mistral both have 32,000 ids): a vocabulary
    built on data of another tokenizer would pick the wrong frequent tokens, silently."""
    recorded = vm.meta.get("tokenizer_fingerprint") if vm is not None else None
    own = targets.tokenizer_fingerprint(tok) if recorded else None
    if recorded and own != recorded:
        raise EyasError(f"vocab file {args.vocab} was built from data tokenized by another tokenizer "
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

    if ck.is_eyas_checkpoint(ckpt):
        d, meta = ck.load_checkpoint(ckpt)
        return d.cfg, d.trainable_state_dict(), meta
    try:
        from eyas.formats.engines import import_checkpoint
    except ImportError as e:
        raise EyasError(f"--init-from {ckpt}: not an eyas checkpoint, and this eyas cannot import other "
                        "layouts; convert it with `eyas convert` first") from e
    return import_checkpoint(ckpt)


def init_drafter(args, tcfg, vm, aux: list[int], embed: torch.Tensor, head: torch.Tensor,
                 tokenizer_fp: str | None = None) -> tuple[Eagle3Drafter, dict]:
    """The drafter to train from --init-from, with the vocabulary decision made explicit."""
    cfg, state, meta = _read_init(args.init_from)
    meta = meta if isinstance(meta, dict) else {}
    trained = meta.get("eyas") if isinstance(meta.get("eyas"), dict) else meta  # an eyas export nests it
    recorded = trained.get("tokenizer_fingerprint") if isinstance(trained, dict) else None
    if recorded and tokenizer_fp and recorded != tokenizer_fp:  # same sizes are not same tokens
        raise EyasError(f"--init-from {args.init_from}: trained for a target with another tokenizer (fingerprint "
                        f"{recorded}, --target's is {tokenizer_fp}): its lm_head rows and d2t name other tokens; "
                        "initialise from a drafter of this target's tokenizer")
    hidden = {cfg.target_hidden_size, cfg.hidden_size}  # the drafter embeds with the target's embedding
    if cfg.vocab_size != tcfg.vocab_size or hidden != {tcfg.hidden_size}:
        raise EyasError(f"--init-from {args.init_from}: drafter for vocab {cfg.vocab_size} / hidden "
                        f"{cfg.target_hidden_size} (its own {cfg.hidden_size}), but --target has {tcfg.vocab_size} / "
                        f"{tcfg.hidden_size}; initialise from a drafter of this target")
    if list(cfg.aux_layer_ids) != list(aux):
        raise EyasError(f"--init-from {args.init_from}: drafter reads aux layers {cfg.aux_layer_ids} but the "
                        f"features hold {aux}; capture those layers (eyas capture --layers "
                        f"{','.join(map(str, cfg.aux_layer_ids))})")
    old_ids = core_vocab.target_ids(state["d2t"])
    new_ids = old_ids if vm is None else vm.target_ids
    info = {"init_from": str(args.init_from), "vocab": "checkpoint" if vm is None else "same"}
    if meta.get("note"):  # the import sorted a map held in another order
        log.info("--init-from %s: %s", args.init_from, meta["note"])
        info["init_note"] = meta["note"]
    if vm is not None and not torch.equal(old_ids, new_ids):
        rep = core_vocab.compare_maps(old_ids, new_ids)
        if not args.remap:
            raise EyasError(
                f"vocabulary mismatch: --init-from {args.init_from} maps its {rep['size_a']} draft ids to other "
                f"target ids than --vocab {args.vocab} ({rep['size_b']} ids): same position {rep['same_position']}"
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
        raise EyasError(f"--init-from {args.init_from}: missing keys {missing[:6]}, unexpected {unexpected[:6]}; "
                        "pass a one-layer EAGLE-3 drafter checkpoint")
    d.load_target_embedding(embed)
    return d, info


# ---------------------------------------------------------------- the run directory


def _prepare_out(args, dist_) -> None:
    out: Path = args.out
    busy = out.exists() and any(p.name not in ("metrics.jsonl",) for p in out.iterdir())
    if busy and not args.resume and not args.force:
        raise EyasError(f"--out {out} already holds a run; pass --resume to continue it, --force to start over, "
                        "or choose another --out")
    if dist_.main and busy and args.force and not args.resume:
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


def run_train(args) -> int:
    from eyas import training

    _check_args(args)
    device = targets.parse_device(args.device)
    dist_ = training.init_distributed(device)
    if device.type == "cuda" and dist_.world > 1:
        device = torch.device("cuda", int(__import__("os").environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    tdir = _target_dir(args.target)
    tcfg = targets.load_config(tdir)
    vm = None if args.vocab == "from-checkpoint" else _load_vocab(args, tcfg)
    model, tok = targets.load(tdir, dtype=args.dtype if args.online else "fp32", device=str(device) if args.online else "cpu")
    _check_vocab_tokenizer(args, vm, tok)
    tokenizer_fp = targets.tokenizer_fingerprint(tok)
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    head = model.get_output_embeddings().weight.detach().float().cpu()
    source, aux, where = _features(args, tdir, tcfg, model, dist_)
    if not args.online:
        del model
    if args.init_from:
        drafter, init_info = init_drafter(args, tcfg, vm, aux, embed, head, tokenizer_fp)
    else:
        drafter = fresh_drafter(tcfg, vm.target_ids, aux, embed, head, args.seed, args.flags)
        init_info = {"init": "target head", **({"flags": sorted(args.flags)} if args.flags else {})}
    if not source.lengths("eval"):
        log.warning("no eval samples in %s: evaluating on the training split", where)
        source.splits["eval"] = source.splits["train"]
    cfg = training.TrainConfig(ttt=args.ttt, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                               max_len=args.max_len, max_steps=args.max_steps, eval_every=args.eval_every,
                               seed=args.seed, dtype=args.dtype, device=str(device), warmup_ratio=args.warmup_ratio,
                               grad_clip=args.grad_clip, weight_decay=args.weight_decay, keep_last=args.keep_last,
                               fsdp=args.fsdp, aux_gain=args.aux_gain == "rms", align_topk=args.align_topk,
                               time_budget=args.time_budget * 60 if args.time_budget else None,
                               optimizer=args.optimizer)
    if cfg.aux_gain and args.resume and training.checkpoint_steps(args.out):
        init_info.update(_recorded_gain(args.out))  # the gain itself comes with the checkpoint's state
    elif cfg.aux_gain:
        init_info.update(training.apply_aux_gain(drafter, source, keep_function=bool(args.init_from)))
    _prepare_out(args, dist_)
    from eyas.formats.vocab import vocab_fingerprint

    meta = {"kind": "eyas.train", "target": str(tdir), "target_fingerprint": targets.fingerprint(tdir),
            "tokenizer_fingerprint": tokenizer_fp, "aux_layer_ids": aux, "features": where, "vocab": str(args.vocab),
            "vocab_fingerprint": vocab_fingerprint(drafter.d2t, drafter.cfg.vocab_size),
            "train_config": cfg.__dict__, "init": init_info, "provenance": provenance(args)}
    scale, softcap = targets.logit_transform(tcfg)
    trainer = training.Trainer(cfg, drafter, source, training.Target(head, meta["target_fingerprint"], scale, softcap),
                               args.out, meta, dist_)
    start = trainer.resume() if args.resume else 0
    if args.fsdp and dist_.world <= 1:  # after every check: bad input still gets its one line
        log.warning("--fsdp: one process, nothing to shard; launch with torchrun --nproc-per-node N")
    if dist_.main:
        if args.resume:
            _trim_metrics(args.out, start)
        write_json_atomic(args.out / "run.json", meta)
    result = trainer.run()
    if dist_.main:
        s = {"out": str(args.out), "resumed_from": start, **getattr(trainer, "summary", {}),
             "checkpoint": str(args.out / "final"), "best": str(args.out / "best")}
        acc = " ".join(f"acc_{i}={result.get(f'acc_{i}', 0):.3f}" for i in range(args.ttt))
        why = f" of {trainer.total} (--time-budget spent)" if trainer.stopped_by_time else ""
        emit(args, s, f"trained {trainer.step} steps{why} -> {args.out / 'final'}\n"
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
