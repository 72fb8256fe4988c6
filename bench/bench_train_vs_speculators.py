"""eyas vs speculators: EAGLE-3 training throughput, peak memory and simulated acceptance.

Both frameworks train on the same in-memory features (the target's aux states and last
hidden state for the same samples, same seq length), the same draft vocabulary, TTT
length, steps and samples per step; each runs in its own subprocess so peak RSS is its
own. speculators follows the CPU recipe in ENVIRONMENT.md (sdpa attention,
resolve_loss_config("kl_div", "eager"), plain AdamW loop); eyas steps with the optimizer
`eyas train` builds (`--optimizer`, default eyas's: Muon on the hidden matrices). Both
drafters are then scored with eyas's metric code on the same eval samples (speculators' via
eyas's importer).

    python bench/bench_train_vs_speculators.py --data DATA --vocab VOCAB \
        [--target smollm2-135m] [--ttt 3] [--seq-len 512] [--steps 20] [--dtype bf16] [--compute-argmax]

The features hold what `eyas capture` stores, the target's full-vocabulary argmax included
(DESIGN 6 needs it for the out-of-vocabulary mask and acc_i; speculators' loss does not): by
default eyas's steps read it, as `eyas train` does from an eyas capture; `--compute-argmax`
times eyas computing it every step, as `eyas train` does in the first epoch of features that
lack it (imported from SpecForge or speculators, or --online). The time `features` spent on
the argmax (a capture-time cost, once per capture) is reported as `argmax_seconds`.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def features(target: Path, data: Path, seq_len: int, n: int, dtype: str, out: Path) -> None:
    """Run the target once; save aux, post-norm last, pre-norm last, ids, masks (fp32) and the
    argmax where the next token is supervised (-1 elsewhere), as `eyas capture` does."""
    from eyas import targets
    from eyas.core import ttt
    from eyas.formats.data import read_samples

    model, _ = targets.load(target, dtype=dtype)
    L = model.config.num_hidden_layers
    layers = targets.default_aux_layers(L)
    stack = targets.find_decoder_stack(model)
    pre = {}
    h = stack.norm.register_forward_pre_hook(lambda m, a: pre.__setitem__("x", a[0]))
    rows, argmax_s = [], 0.0
    head = model.get_output_embeddings().weight
    samples = [s for s in read_samples(data, "train") + read_samples(data, "eval") if sum(s.loss_mask) > 8][:n]
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(s.input_ids[:seq_len]).view(1, -1)
            with targets.capture_aux(model, layers) as cap:
                stack.base(input_ids=ids)
                mask = torch.tensor(s.loss_mask[:seq_len])
                t0 = time.perf_counter()
                sup = ttt.predicts_supervised(mask)
                am = torch.full_like(mask, -1)
                am[sup] = ttt.vocab_argmax(cap.last[0][sup], head.to(cap.last.dtype))
                argmax_s += time.perf_counter() - t0
                rows.append({"aux": cap.aux()[0].float(), "last": cap.last[0].float(), "pre": pre["x"][0].float(),
                             "input_ids": ids[0], "loss_mask": mask, "argmax": am})
    h.remove()
    torch.save({"rows": rows, "layers": layers, "argmax_seconds": argmax_s}, out)


def run_eyas(a, feats: dict, out: Path) -> dict:
    from eyas import targets
    from eyas.core.optim import make_optimizer
    from eyas.core import ttt
    from eyas.formats.vocab import load_vocab
    from eyas.stages.train import fresh_drafter

    tdir = targets.resolve(a.target)
    tcfg = targets.load_config(tdir)
    model, _ = targets.load(tdir)
    vm = load_vocab(a.vocab)
    head = model.lm_head.weight.detach().float()
    d = fresh_drafter(tcfg, vm.target_ids, feats["layers"], model.get_input_embeddings().weight.float(), head, 0)
    del model
    if a.random_head:  # ablation: the head from nn.Linear's default init instead of the target's rows
        torch.nn.init.kaiming_uniform_(d.lm_head.weight, a=5 ** 0.5)
    ac = torch.bfloat16 if a.dtype == "bf16" else None
    lm = head.to(ac or torch.float32)
    tids = vm.target_ids
    # the optimizer `eyas train` builds
    opt = make_optimizer(d, a.optimizer, a.lr, dtype=a.dtype)
    train, ev = feats["rows"][: a.train], feats["rows"][a.train:]
    rows = ttt.head_rows(lm, tids)  # as eyas's Trainer splits it once on a CPU

    def batch(r):
        known = None if a.compute_argmax else r["argmax"][ttt.predicts_supervised(r["loss_mask"])]
        table = ttt.target_table(r["last"][None].to(lm.dtype), r["loss_mask"][None], lm, tids, d.t2d,
                                 argmax=known, rows=rows)
        return r["aux"][None].to(ac or torch.float32), r["input_ids"][None], table

    def step(r):
        aux, ids, table = batch(r)
        with torch.autocast("cpu", dtype=ac or torch.float32, enabled=ac is not None):
            loss, _ = ttt.ttt_forward(d, aux, ids, table, a.ttt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()

    return _timed(a, train, step, lambda: _eyas_eval(d, ev, batch, a, ac))


def _eyas_eval(d, ev, batch, a, ac) -> dict:
    from eyas.core import ttt

    total = None
    with torch.no_grad(), torch.autocast("cpu", dtype=ac or torch.float32, enabled=ac is not None):
        for r in ev:
            aux, ids, table = batch(r)
            total = ttt.add_stats(total, ttt.ttt_forward(d, aux, ids, table, a.ttt)[1])
    return ttt.metrics(total)


def _timed(a, train, step, evaluate) -> dict:
    step(train[0])  # warm-up (allocations, first-call overheads) not timed
    tokens, t0 = 0, time.perf_counter()
    for s in range(a.steps):
        r = train[s % len(train)]
        step(r)
        tokens += r["input_ids"].numel()
    dt = time.perf_counter() - t0
    m = evaluate()
    return {"tokens_per_s": tokens / dt, "seconds": dt, "tokens": tokens,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "accept_len": m["accept_len"], "acc_0": m["acc_0"]}


def run_speculators(a, feats: dict, out: Path) -> dict:
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    from eyas import targets
    from eyas.formats.vocab import load_vocab

    tdir = targets.resolve(a.target)
    vcfg = AutoConfig.from_pretrained(tdir)
    layer_cfg = copy.deepcopy(vcfg)
    layer_cfg.num_hidden_layers = 1
    vm = load_vocab(a.vocab)
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=vm.t2d, d2t=vm.d2t, verifier_name_or_path=str(tdir), draft_vocab_size=vm.draft_size,
        norm_before_residual=False, ttt_steps=a.ttt, target_layer_ids=feats["layers"], draft_attn_impl="sdpa")
    loss_cfg = resolve_loss_config("kl_div", "eager")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, betas=(0.9, 0.95))
    ac = torch.bfloat16 if a.dtype == "bf16" else None
    train, ev = feats["rows"][: a.train], feats["rows"][a.train:]

    def step(r):
        # speculators.models.eagle3.data.shift_batch: align (x[t+1], g[t], y[t+1], l[t+1]), positions from 1
        ids = r["input_ids"][1:][None]
        with torch.autocast("cpu", dtype=ac or torch.float32, enabled=ac is not None):
            _, loss, _ = model(hidden_states=r["aux"][:-1][None], input_ids=ids, document_ids=torch.zeros_like(ids),
                               loss_mask=r["loss_mask"][1:][None], verifier_last_hidden_states=r["pre"][1:][None],
                               position_ids=torch.arange(1, ids.shape[1] + 1)[None], ttt_steps=a.ttt,
                               ttt_step_loss_decay=0.8, loss_config=loss_cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def evaluate():
        from eyas.core.drafter import Eagle3Drafter
        from eyas.formats.engines import import_checkpoint

        model.save_pretrained(out / "spec")
        cfg, state, _ = import_checkpoint(out / "spec")
        d = Eagle3Drafter(cfg)
        d.load_state_dict({k: v for k, v in state.items() if k in d.state_dict()}, strict=False)
        d.load_target_embedding(model.embed_tokens.weight.detach().float())
        from eyas import targets as tg
        from eyas.core import ttt

        m, _ = tg.load(tdir)  # the target's full head, as eyas's metric code expects
        full = m.lm_head.weight.detach().float()
        tids = vm.target_ids

        def batch(r):
            table = ttt.target_table(r["last"][None], r["loss_mask"][None], full.to(ac or torch.float32), tids, d.t2d)
            return r["aux"][None].to(ac or torch.float32), r["input_ids"][None], table

        return _eyas_eval(d, ev, batch, a, ac)

    return _timed(a, train, step, evaluate)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", type=Path, required=True, help="prepared data (eyas data prepare)")
    p.add_argument("--vocab", type=Path, required=True, help="vocab file (eyas vocab build)")
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (one sample each)")
    p.add_argument("--train", type=int, default=40, help="training samples (the rest of --samples are eval)")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--random-head", action="store_true", help="eyas ablation: random lm_head init")
    p.add_argument("--optimizer", default="muon", choices=("muon", "adamw"),
                   help="eyas's optimizer (eyas train --optimizer; default muon, eyas's default); speculators: AdamW")
    p.add_argument("--compute-argmax", action="store_true",
                   help="eyas: compute the target's full-vocabulary argmax every step, as `eyas train` does in the "
                   "first epoch of features without it (default: read from the features, as from an eyas capture)")
    p.add_argument("--only", choices=("eyas", "speculators"), help="run one framework")
    p.add_argument("--which", choices=("eyas", "speculators"), help=argparse.SUPPRESS)
    p.add_argument("--feats", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.which:
        feats = torch.load(a.feats, weights_only=True)
        fn = run_eyas if a.which == "eyas" else run_speculators
        if a.which == "eyas":  # as every eyas command runs (eyas.cli.main); speculators keeps glibc's defaults
            from eyas.cpu import hostmem

            hostmem.retain_freed_memory()
        print(json.dumps(fn(a, feats, a.feats.parent)))
        return
    from eyas import targets

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "feats.pt"
        features(targets.resolve(a.target), a.data, a.seq_len, a.samples, a.dtype, f)
        res = {"argmax_seconds": torch.load(f, weights_only=True)["argmax_seconds"]}
        for which in [a.only] if a.only else ("eyas", "speculators"):
            cmd = [sys.executable, __file__, "--which", which, "--feats", str(f)] + sys.argv[1:]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                res[which] = {"error": out.stderr.strip().splitlines()[-1:]}
                continue
            res[which] = json.loads(out.stdout.strip().splitlines()[-1])
    e, s = res.get("eyas", {}), res.get("speculators", {})
    if "tokens_per_s" in e and "tokens_per_s" in s:
        res["speedup_tokens_per_s"] = e["tokens_per_s"] / s["tokens_per_s"]
    res["settings"] = {k: str(v) for k, v in vars(a).items() if k not in ("which", "feats")}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
