"""eyas vs speculators: drafter QUALITY at the same data and training budget, measured by decoding.

Both drafters train on the same captured features (`eyas capture` directories), the same
draft vocabulary, TTT length, max length, batches (eyas's token-budget plan: same samples in
the same order per step), step count, learning rate, warmup + cosine schedule and gradient
clipping. What differs is each framework's own model, loss and optimizer:

- eyas: `eyas train` (the CLI, in a subprocess), its final checkpoint, with eyas's default
  optimizer (Muon on the hidden matrices, AdamW betas 0.9/0.95 on the rest;
  `--eyas-optimizer adamw` trains with speculators' optimizer instead);
- speculators 0.9.0: `Eagle3DraftModel.from_training_args` with the eagle3 defaults of
  speculators' own training CLI (norm_before_residual, norm_before_fc and norm_output True,
  embedding frozen, draft head and embedding from the verifier, TTT step loss decay 1.0),
  sdpa attention, `resolve_loss_config("kl_div", "eager")`,
  in a plain AdamW loop (betas 0.9/0.95, no decay; its Trainer assumes CUDA). eyas's capture
  stores `last` AFTER the target's final norm, so the model's frozen `verifier_norm` is replaced by identity: the
  teacher logits are then exactly lm_head(final-norm state), as in eyas. A step's samples
  are packed into sequences of at most --pack-tokens (document ids keep them apart) and
  their losses summed weighted by supervised tokens (sdpa's dense mask makes one 4k-token
  pack with TTT 5 cost gigabytes).

Then both are scored the same two ways: `eyas train --init-from D --max-steps 0` (teacher-
forced validation metrics on the eval split, eyas's metric code) and one `eyas bench` run with
both drafters on the same prompts, interleaved prompt by prompt (real decoding with the target:
acceptance length, per-position acceptance, tokens/s against one plain baseline). The speculators drafter is imported into an eyas checkpoint by eyas's own
importer (`formats.engines.import_checkpoint`) so both run in the same runtime.

    python bench/bench_quality_vs_speculators.py --capture CAP [CAP ...] --vocab V.safetensors \
        --prompts P.jsonl --out OUT [--ttt 5] [--max-steps 300] [--batch-tokens 4096] \
        [--eyas-epochs E] [--eyas-flags norm_before_residual,norm_before_fc,norm_output] [--draft-cutoff 0] \
        [--eyas-run RUN] [--speculators-minutes M]

`--eyas-run` takes a finished `eyas train` run on the same capture and plan (the quickstart's own train
stage, say) instead of training eyas again. `--speculators-minutes` is an equal-time comparison: speculators'
loop stops when that much time is spent, its schedule following steps or time, whichever is further along
(as `eyas train --time-budget`); pass eyas's loop time to give both the same wall clock on this machine.

Each phase writes its result under OUT and is skipped when rerun (delete it to redo).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

SPEC_DECAY = 1.0  # speculators' TrainConfig default ttt_step_loss_decay (eyas weights step i by 0.8**i)


def eyas_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "eyas.cli", *args]


def run(cmd: list[str], log: Path) -> None:
    print("$", " ".join(cmd), flush=True)
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"failed (rc {rc}): {' '.join(cmd)}; see {log}")


def train_args(a, max_steps: int | None) -> list[str]:
    return ["--ttt", str(a.ttt), "--epochs", str(a.eyas_epochs), "--lr", str(a.lr), "--batch-tokens", str(a.batch_tokens),
            "--max-len", str(a.max_len), "--seed", "0", "--dtype", a.dtype, "--eval-every", str(10 ** 9)] + \
           (["--max-steps", str(max_steps)] if max_steps is not None else [])


def train_eyas(a) -> dict:
    """`eyas train` in this (child) process, timed, with its own peak RSS."""
    from eyas import cli

    t0 = time.perf_counter()
    rc = cli.main(["train", "--target", a.target, "--capture", *map(str, a.capture), "--vocab", str(a.vocab),
                   "--out", str(a.out / "eyas"), "--force", *train_args(a, a.max_steps),
                   "--optimizer", a.eyas_optimizer, *(["--drafter-flags", a.eyas_flags] if a.eyas_flags else [])])
    if rc:
        sys.exit(rc)
    return {"seconds": time.perf_counter() - t0, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def train_plan(a, epochs: int):
    """The captures' train split and the batches `eyas train` takes from it (seed 0), all epochs."""
    from eyas.core.batching import plan_train_batches, shape_length
    from eyas.formats.capture import CaptureReader
    from eyas.formats.features import CaptureSplit, TensorSource

    readers = [CaptureReader(c) for c in a.capture]
    src = TensorSource({"train": CaptureSplit(readers, "train")}, a.max_len)
    lengths = src.lengths("train")
    shapes = [shape_length(n) for n in lengths]  # `eyas train` plans on padded shapes
    epoch_plans = [plan_train_batches(shapes, a.batch_tokens, 0, e) for e in range(epochs)]
    total = len(epoch_plans[0]) * epochs  # as Trainer.total: epoch 0's batch count x epochs
    if a.max_steps is not None:
        total = min(total, a.max_steps)
    return readers, src, lengths, [b for p in epoch_plans for b in p][:total]


def train_speculators(a) -> dict:
    import copy

    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    from eyas import targets
    from eyas.core.optim import lr_lambda
    from eyas.formats.checkpoint import save_checkpoint
    from eyas.formats.engines import import_checkpoint
    from eyas.formats.vocab import load_vocab
    from eyas.core.drafter import Eagle3Drafter

    tdir = targets.resolve(a.target)
    readers, src, lengths, plan = train_plan(a, a.epochs)
    vm = load_vocab(a.vocab)
    layer_cfg = copy.deepcopy(AutoConfig.from_pretrained(tdir))
    layer_cfg.num_hidden_layers = 1
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=vm.t2d, d2t=vm.d2t, verifier_name_or_path=str(tdir), draft_vocab_size=vm.draft_size,
        norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=a.ttt,
        target_layer_ids=list(readers[0].layer_ids), draft_attn_impl="sdpa")
    model.verifier_norm = torch.nn.Identity()  # eyas's `last` is already the final-norm output
    loss_cfg = resolve_loss_config("kl_div", "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ac = torch.bfloat16 if a.dtype == "bf16" else None
    tokens, t0, budget = 0, time.perf_counter(), (a.speculators_minutes or 0) * 60
    spent = (lambda: min(1.0, (time.perf_counter() - t0) / budget)) if budget else None
    warmup = max(1, int(0.03 * len(plan)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(len(plan), warmup, spent))
    done = 0
    for step, idxs in enumerate(plan):
        if spent is not None and spent() >= 1.0:
            break
        items = [src.splits["train"][i] for i in idxs]
        packs, cur = [], []
        for it in items:
            if cur and sum(min(x["input_ids"].shape[0], a.max_len) for x in cur) + it["input_ids"].shape[0] > a.pack_tokens:
                packs.append(cur)
                cur = []
            cur.append(it)
        packs.append(cur)
        sup = sum(int(it["loss_mask"][1:a.max_len].sum()) for it in items)
        opt.zero_grad(set_to_none=True)
        for pack in packs:
            # speculators.models.eagle3.data.shift_batch: (x[t+1], g[t], y[t+1], l[t+1]), positions from 1
            cut = [min(it["input_ids"].shape[0], a.max_len) for it in pack]
            ids = torch.cat([it["input_ids"][1:n].long() for it, n in zip(pack, cut)])[None]
            hs = torch.cat([it["aux"][: n - 1].float() for it, n in zip(pack, cut)])[None]
            last = torch.cat([it["last"][1:n].float() for it, n in zip(pack, cut)])[None]
            lm = torch.cat([it["loss_mask"][1:n].long() for it, n in zip(pack, cut)])[None]
            doc = torch.cat([torch.full((n - 1,), j) for j, n in enumerate(cut)])[None]
            pos = torch.cat([torch.arange(1, n) for n in cut])[None]
            with torch.autocast("cpu", dtype=ac or torch.float32, enabled=ac is not None):
                _, loss, _ = model(hidden_states=hs, input_ids=ids, document_ids=doc, loss_mask=lm,
                                   verifier_last_hidden_states=last, position_ids=pos, ttt_steps=a.ttt,
                                   ttt_step_loss_decay=SPEC_DECAY, loss_config=loss_cfg)
            (loss * (int(lm.sum()) / max(1, sup))).backward()
            tokens += ids.numel()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        done = step + 1
        if step % 10 == 0 or step == len(plan) - 1:
            dt = time.perf_counter() - t0
            print(f"speculators step {step + 1}/{len(plan)} loss {loss.item():.4f} {tokens / dt:.0f} tok/s", flush=True)
    dt = time.perf_counter() - t0
    own = own_eval(model, readers, a, loss_cfg, ac)
    model.save_pretrained(a.out / "speculators")
    cfg, state, _ = import_checkpoint(a.out / "speculators", target=tdir)
    d = Eagle3Drafter(cfg)
    d.load_state_dict({k: v for k, v in state.items() if k in d.state_dict()}, strict=False)
    save_checkpoint(a.out / "speculators_eyas", d, {"kind": "imported", "source": str(a.out / "speculators")})
    return {"seconds": dt, "steps": done, "planned_steps": len(plan), "tokens": tokens, "tokens_per_s": tokens / dt,
            "own_val": own,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def own_eval(model, readers, a, loss_cfg, ac) -> dict:
    """speculators' own accuracy counters on the eval split: a cross-check of eyas's import."""
    from eyas.formats.features import CaptureSplit

    ev = CaptureSplit(readers, "eval")
    sums: dict[str, float] = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=ac or torch.float32, enabled=ac is not None):
        for i in range(len(ev)):
            it = ev[i]
            n = min(it["input_ids"].shape[0], a.max_len)
            ids = it["input_ids"][1:n].long()[None]
            _, _, m = model(hidden_states=it["aux"][: n - 1].float()[None], input_ids=ids,
                            document_ids=torch.zeros_like(ids), loss_mask=it["loss_mask"][1:n].long()[None],
                            verifier_last_hidden_states=it["last"][1:n].float()[None],
                            position_ids=torch.arange(1, n)[None], ttt_steps=a.ttt, ttt_step_loss_decay=SPEC_DECAY,
                            loss_config=loss_cfg)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    return {f"full_acc_{i}": sums[f"full_acc_{i}_sum"] / max(1.0, sums[f"full_acc_{i}_total"]) for i in range(a.ttt)}


def eyas_run_dir(a) -> Path:
    return a.eyas_run or a.out / "eyas"


def bad_input(msg: str) -> None:
    print(msg, file=sys.stderr)
    sys.exit(2)


def adopt_eyas_run(a) -> dict:
    """`--eyas-run`: check the run trained this comparison's plan, and take its figures."""
    if not (a.eyas_run / "run.json").is_file() or not (a.eyas_run / "final").is_dir():
        bad_input(f"--eyas-run {a.eyas_run}: not a finished `eyas train` run (needs run.json and final/); "
                 "pass the run directory itself, or drop --eyas-run to train eyas here")
    run = json.loads((a.eyas_run / "run.json").read_text())
    cfg, want = run["train_config"], {"ttt": a.ttt, "epochs": a.eyas_epochs, "batch_tokens": a.batch_tokens,
                                      "max_len": a.max_len, "lr": a.lr, "seed": 0}
    if str(Path(run["features"]).resolve()) not in {str(c.resolve()) for c in a.capture}:
        bad_input(f"--eyas-run {a.eyas_run} trained on {run['features']}, not on --capture: pass its capture")
    bad = {k: (cfg.get(k), v) for k, v in want.items() if cfg.get(k) != v}
    if bad:
        bad_input(f"--eyas-run {a.eyas_run} trained with other settings (run, here): {bad}; pass the run's own")
    return {"from": str(a.eyas_run), "optimizer": cfg.get("optimizer"), "aux_gain": cfg.get("aux_gain")}


def eyas_real_throughput(a) -> dict:
    """eyas's tokens/s counts each sample's (max-len-capped) length; speculators' count drops
    the one token shifted off per sample. Recount eyas's tokens that way over the same loop time."""
    _, _, lengths, plan = train_plan(a, a.eyas_epochs)
    counted = sum(lengths[i] for b in plan for i in b)
    real = sum(lengths[i] - 1 for b in plan for i in b)
    train_rows = [json.loads(l) for l in (eyas_run_dir(a) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    tps = [r["tokens_per_s"] for r in train_rows if r.get("kind") == "train" and "tokens_per_s" in r][-1]
    seconds = counted / tps
    return {"loop_seconds": seconds, "real_tokens": real, "counted_tokens": counted, "tokens_per_s": real / seconds}


def last_eval(run_dir: Path) -> dict:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in rows if r.get("kind") == "eval"][-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--capture", type=Path, nargs="+", required=True)
    p.add_argument("--vocab", type=Path, required=True)
    p.add_argument("--prompts", type=Path, nargs="+", required=True,
                   help="bench prompts (never trained on), or `builtin-eval` with --data: the held-out eval split")
    p.add_argument("--data", type=Path, help="with --prompts builtin-eval: the prepared data whose eval split to bench")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ttt", type=int, default=5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eyas-epochs", type=int, help="eyas's epochs (default --epochs): an equal-time comparison "
                   "gives eyas the epochs its higher throughput buys in speculators' training time")
    p.add_argument("--eyas-flags", default="", help="eyas train --drafter-flags (e.g. the speculators layout: "
                   "norm_before_residual,norm_before_fc,norm_output)")
    p.add_argument("--eyas-optimizer", default="muon", choices=("muon", "adamw"),
                   help="eyas train --optimizer (default muon, eyas's default; adamw = speculators' optimizer)")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--pack-tokens", type=int, default=1024, help="speculators: tokens per packed forward")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--tree", default="4,5,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="eyas bench --repeats (median-wall run of R per prompt)")
    p.add_argument("--draft-cutoff", default="0", help="eyas bench --draft-cutoff (default 0: every draft runs to its full "
                   "size, so acceptance measures the drafter, not the cutoff)")
    p.add_argument("--eyas-run", type=Path, help="a finished `eyas train` run on this capture and plan, used "
                   "instead of training eyas here (its settings are checked against these)")
    p.add_argument("--speculators-minutes", type=float, help="equal time: stop speculators' loop after M minutes, "
                   "its schedule following steps or time, whichever is further along")
    p.add_argument("--which", choices=("eyas", "speculators"), help=argparse.SUPPRESS)
    a = p.parse_args()
    a.eyas_epochs = a.eyas_epochs or a.epochs
    if a.speculators_minutes is not None and a.speculators_minutes <= 0:
        bad_input(f"--speculators-minutes {a.speculators_minutes}: must be > 0 (omit it for no time cap)")
    adopted = adopt_eyas_run(a) if a.eyas_run and not a.which else None  # checked before anything is written
    a.out.mkdir(parents=True, exist_ok=True)
    if a.which:
        torch.set_num_threads(a.threads)
        res = train_eyas(a) if a.which == "eyas" else train_speculators(a)
        (a.out / f"train_{a.which}.json").write_text(json.dumps(res, indent=1) + "\n")
        return
    argv = [x for x in sys.argv[1:]]
    if adopted and not (a.out / "train_eyas.json").exists():
        (a.out / "train_eyas.json").write_text(json.dumps(adopted, indent=1) + "\n")
    for which in ("eyas", "speculators"):
        if not (a.out / f"train_{which}.json").exists():
            run([sys.executable, __file__, "--which", which, *argv], a.out / f"train_{which}.log")
    drafters = {"eyas": eyas_run_dir(a) / "final", "speculators": a.out / "speculators_eyas"}
    res = {"settings": {k: str(v) for k, v in vars(a).items() if k != "which"}}
    bdir = a.out / "bench_both"  # both drafters in one run, prompt by prompt, one plain baseline
    cmd = eyas_cmd("bench", "--target", a.target, "--drafter", *map(str, drafters.values()),
                   "--prompts", *map(str, a.prompts), *(["--data", str(a.data)] if a.data else []),
                   "--max-new-tokens", str(a.max_new_tokens), "--k", str(a.k), "--tree", a.tree,
                   "--methods", "chain,tree", "--baselines", "plain", "--dtype", a.dtype, "--draft-cutoff", a.draft_cutoff,
                   "--repeats", str(a.repeats), "--threads", str(a.threads), "--out", str(bdir), "--force")
    ran = bdir / "argv.json"  # rerun the bench when anything in its command line changed
    if not (bdir / "report.json").exists() or not ran.exists() or json.loads(ran.read_text()) != cmd[1:]:
        run(cmd, a.out / "bench_both.log")
        ran.write_text(json.dumps(cmd[1:]) + "\n")
    summary = json.loads((bdir / "report.json").read_text())["summary"]
    name_of = {path: name for name, path in summary["drafters"].items()}
    for which, ckpt in drafters.items():
        r = {"train": json.loads((a.out / f"train_{which}.json").read_text())}
        ev = a.out / f"eval_{which}"
        if not (ev / "metrics.jsonl").exists():
            run(eyas_cmd("train", "--target", a.target, "--capture", *map(str, a.capture), "--vocab", str(a.vocab),
                         "--out", str(ev), "--force", "--init-from", str(ckpt), *train_args(a, 0)), a.out / f"eval_{which}.log")
        r["val"] = {k: v for k, v in last_eval(ev).items() if k.startswith(("acc_", "accept_len", "loss"))}
        s, name = summary["methods"], name_of[str(ckpt)]
        r["bench"] = {m: {k: s[f"{m}@{name}"][k] for k in ("acceptance_length", "acceptance_by_position",
                                                            "tokens_per_s", "speedup")} for m in ("chain", "tree")}
        res[which] = r
    res["eyas"]["train"].update(eyas_real_throughput(a))
    e, s = res["eyas"], res["speculators"]
    res["ratios"] = {f"{m}_acceptance_length": e["bench"][m]["acceptance_length"] / s["bench"][m]["acceptance_length"]
                     for m in ("chain", "tree")}
    res["ratios"]["val_accept_len"] = e["val"]["accept_len"] / s["val"]["accept_len"]
    res["ratios"]["train_tokens_per_s"] = e["train"]["tokens_per_s"] / s["train"]["tokens_per_s"]
    res["ratios"]["train_loop_seconds"] = e["train"]["loop_seconds"] / s["train"]["seconds"]
    (a.out / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
