"""The EAGLE-3 training recipe (DESIGN 6): the loop over batches of a feature source, evaluation,
atomic checkpoints with exact resume, DDP/FSDP, metrics (JSONL, TensorBoard, plots).

The components it wires live where their layer is: the tensor math (TTT attention, loss,
metrics) in `core.ttt`, batch planning in `core.batching`, optimizers in `core.optim`, the
process group in `core.distributed`, feature sources in `formats.features` (captured) and
`targets.online` (made by the target), checkpoint files in `formats.checkpoint`.
`eyas.stages.train` resolves and validates the inputs, then runs `Trainer`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn

from eyas.config import to_json
from eyas.core import ttt
from eyas.core.batching import plan_train_batches, shape_length
from eyas.core.distributed import Dist
from eyas.core.drafter import Eagle3Drafter
from eyas.core.optim import lr_lambda, make_optimizer
from eyas.errors import EyasError
from eyas.formats.checkpoint import read_tensors, save_checkpoint, sweep_partial
from eyas.formats.features import Batch, split_fingerprint
from eyas.formats.metrics import read_metrics

if TYPE_CHECKING:
    from eyas.stages.train import TrainConfig

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
# Settings a resumed run must share with the original for the result to be the same run.
RESUME_MUST_MATCH = ("ttt", "epochs", "lr", "batch_tokens", "max_len", "seed", "dtype", "warmup_ratio", "grad_clip",
                     "weight_decay", "max_steps", "aux_gain", "align_topk", "optimizer")
STEP_HOOKS: list[Callable[[int], None]] = []  # called after each optimizer step (tests inject kills)


class TrainingDiverged(EyasError):
    """NaN/Inf in the loss or gradients: training stops, no poisoned checkpoint is written."""


GAIN_TOKENS = 65536  # training tokens the aux channel RMS is measured on


@torch.no_grad()
def aux_rms(source, max_tokens: int = GAIN_TOKENS) -> tuple[torch.Tensor, int]:
    """Per-channel RMS of the aux features over the first training samples (index order, so
    every rank measures the same), until `max_tokens` tokens; and the tokens counted."""
    sq, n = None, 0
    for i in range(len(source.lengths("train"))):
        b = source.batch("train", [i])
        x = b.aux[0, : b.tokens].double().cpu()  # without the padding (online: not zeros)
        if not bool(torch.isfinite(x).all()):
            raise EyasError(f"training sample {b.ids[0]} has non-finite aux features; find the damaged samples "
                            "with `eyas capture validate` and recapture them")
        sq = x.pow(2).sum(0) if sq is None else sq + x.pow(2).sum(0)
        n += b.tokens
        if n >= max_tokens:
            break
    if sq is None or n == 0:
        raise EyasError("no training samples to measure the aux feature scale on")
    return (sq / n).sqrt(), n


def apply_aux_gain(drafter: Eagle3Drafter, source, keep_function: bool) -> dict:
    """Give `drafter` the fc input gain of this data (what run.json records). `keep_function`
    (a drafter with trained weights): fc.weight is divided by the gain, so nothing changes
    but the coordinates Adam works in. Off for drafters that normalise fc's input themselves."""
    from eyas.core.drafter import aux_gain_from_rms

    if drafter.cfg.norm_before_fc or drafter.cfg.fc_norm:
        return {"aux_gain": "off: the drafter normalises fc's input (norm_before_fc / fc_norm)"}
    rms, n = aux_rms(source)
    gain = aux_gain_from_rms(rms)
    drafter.set_aux_gain(gain, keep_function)
    return {"aux_gain": {"tokens": n, "rms_min": float(rms.min()), "rms_median": float(rms.median()),
                         "rms_max": float(rms.max()), "gain_min": float(gain.min()), "gain_max": float(gain.max())}}


class Trainer:
    def __init__(self, cfg: TrainConfig, drafter: Eagle3Drafter, source, target: ttt.Target, out: Path,
                 meta: dict, dist_: Dist | None = None, device: torch.device | None = None):
        self.cfg, self.drafter, self.source, self.target, self.out, self.meta = cfg, drafter, source, target, out, meta
        self.dist = dist_ or Dist()
        self.device = device or torch.device(cfg.device)
        # --time-budget is in minutes; the loop counts seconds
        self.budget_s = cfg.time_budget * 60 if cfg.time_budget else None
        self.autocast = torch.bfloat16 if cfg.dtype == "bf16" else (torch.float16 if cfg.dtype == "fp16" else None)
        drafter.to(self.device)
        self.lm_head = target.lm_head.to(self.device, torch.bfloat16 if self.autocast else torch.float32)
        self.target_ids = (torch.arange(drafter.d2t.numel()) + drafter.d2t.cpu()).to(self.device)
        # split once (draft rows, other rows) on a CPU, where a per-batch gather slowed epoch-0 steps; on a GPU
        # the gather is cheap and a second copy of a large head is not. Without the other rows (most of the head)
        # when every sample brings its argmax (docs/cpu-performance.md, "Measurements behind the code's constants")
        rest = not getattr(source, "argmax_stored", lambda: False)()
        self.head_rows = ttt.head_rows(self.lm_head, self.target_ids, rest) if self.device.type == "cpu" else None
        self.module = self._wrap(ttt.TTTModule(drafter, cfg.ttt, self.autocast, cfg.align_topk))
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = make_optimizer(drafter, cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.dtype, fused=not cfg.fsdp)
        # batches are planned on the padded shapes
        self.train_lengths = [shape_length(n) for n in source.lengths("train")]
        self.eval_lengths = [shape_length(n) for n in source.lengths("eval")]
        self.train_data = split_fingerprint(source)  # saved with each checkpoint, checked on --resume
        per_epoch = len(plan_train_batches(self.train_lengths, cfg.batch_tokens, cfg.seed, 0, self.dist.world))
        total = per_epoch * cfg.epochs
        self.total = min(total, cfg.max_steps) if cfg.max_steps is not None else total
        # seconds of training so far (kept across --resume) and the share of --time-budget they are
        self.train_seconds, self.time_spent = 0.0, 0.0
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(self.total, max(1, int(cfg.warmup_ratio * self.total)),
                                (lambda: self.time_spent) if self.budget_s else None))
        self.step, self.epoch, self.batch_in_epoch, self.best = 0, 0, 0, -1.0
        self.stopped_by_time = False
        self._clock = (time.perf_counter(), 0.0)  # (perf_counter, train_seconds) when run() started
        self.tb = None
        # The target's full-vocabulary argmax per sample depends on the data alone: read from the
        # capture when it holds it (eyas capture does), else computed in the first epoch and reused
        # after it (the (M, V) lm_head product's share of a step: docs/cpu-performance.md).
        self.argmax_cache: dict[tuple, torch.Tensor] = {}

    def _wrap(self, module: nn.Module) -> nn.Module:
        if self.dist.world <= 1:
            return module
        if self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(module)
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                   broadcast_buffers=False)

    # ------------------------------------------------------------ one step

    def _prepare(self, b: Batch):
        dev = self.device
        aux, ids, mask = b.aux.to(dev), b.input_ids.to(dev), b.loss_mask.to(dev)
        last = b.last.to(dev, self.lm_head.dtype)
        cached = [self.argmax_cache.get(k) for k in b.keys]
        known = torch.cat(cached) if cached and all(c is not None for c in cached) else None
        if known is None and b.argmax is not None:  # captured: no product with the V - N other head rows
            known = b.argmax[ttt.predicts_supervised(b.loss_mask)]
            if bool((known < 0).any()):
                raise EyasError(f"capture of samples {b.ids}: argmax missing at a supervised position; the "
                                "capture does not match its own loss masks: recapture")
        table = ttt.target_table(last, mask, self.lm_head, self.target_ids, self.drafter.t2d, self.cfg.target_chunk,
                                 argmax=known, logit_scale=self.target.logit_scale, softcap=self.target.softcap,
                                 rows=self.head_rows)
        if known is None and b.keys:
            for k, a in zip(b.keys, table.argmax.split(table.rows_per_sample())):
                self.argmax_cache[k] = a.to(torch.int32)
        if self.autocast is not None:
            aux = aux.to(self.autocast)
        return aux, ids, table

    def train_step(self, b: Batch) -> dict:
        aux, ids, table = self._prepare(b)
        denom = self.dist.all_sum(table.step_counts(self.cfg.ttt))  # global loss positions per step
        self.opt.zero_grad(set_to_none=True)
        loss, stats = self.module(aux, ids, table, denom, float(self.dist.world))
        # every rank's share (its CE over the global positions, times world): the sum / world is
        # the loss of the whole global batch, as one process would log it
        total = self.dist.all_sum(loss.detach().reshape(1))[0] / self.dist.world
        if not bool(torch.isfinite(total)):
            self._diverged("loss", b)
        loss.backward()
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
        if not bool(torch.isfinite(gnorm)):
            self._diverged("gradient norm", b)
        self.opt.step()
        self.sched.step()
        return {"loss": float(total), "grad_norm": float(gnorm), "stats": stats}

    def _diverged(self, what: str, b: Batch) -> None:
        last = self._latest_checkpoint()
        raise TrainingDiverged(
            f"non-finite {what} at step {self.step + 1} (epoch {self.epoch}, batch {self.batch_in_epoch}, "
            f"samples {b.ids[:8]}); no checkpoint was written for it; last good checkpoint: "
            f"{last or 'none'}; check those samples' features (eyas capture validate), lower --lr or use --dtype fp32")

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.drafter.eval()
        total = None
        plan = plan_train_batches(self.eval_lengths, self.cfg.batch_tokens, 0, 0, self.dist.world, shuffle=False)
        for idxs in plan:
            mine = idxs[self.dist.rank::self.dist.world]
            aux, ids, table = self._prepare(self.source.batch("eval", mine))
            _, stats = self.module(aux, ids, table, torch.ones(self.cfg.ttt, device=self.device))
            total = ttt.add_stats(total, stats)
        self.drafter.train()
        if total is None:
            return {}
        total = ttt.StepStats(**{k: self.dist.all_sum(getattr(total, k)) for k in ttt.StepStats.__dataclass_fields__})
        return ttt.metrics(total)

    # ------------------------------------------------------------ the loop

    def run(self) -> dict:
        cfg = self.cfg
        if self.dist.main:
            self._open_logs()
        bar = self._bar()
        last_eval: dict = {}
        t0, tokens = time.perf_counter(), 0
        self._clock = (t0, self.train_seconds)  # train_seconds = seconds at start + time since (_tick)
        try:
            while self.step < self.total and self.epoch < cfg.epochs and not self.stopped_by_time:
                plan = plan_train_batches(self.train_lengths, cfg.batch_tokens, cfg.seed, self.epoch, self.dist.world)
                while self.batch_in_epoch < len(plan) and self.step < self.total:
                    self._tick()
                    if self.budget_s and self._out_of_time():
                        break
                    idxs = plan[self.batch_in_epoch][self.dist.rank::self.dist.world]
                    b = self.source.batch("train", idxs)
                    r = self.train_step(b)
                    self.step += 1
                    self.batch_in_epoch += 1
                    tokens += b.tokens * self.dist.world
                    tps = tokens / max(1e-9, time.perf_counter() - t0)
                    if bar is not None:
                        bar.update(1)
                        left = {"budget_left": f"{(self.budget_s - self.train_seconds) / 60:.1f}min"} \
                            if self.budget_s else {}
                        bar.set_postfix(loss=f"{r['loss']:.3f}", tok_s=f"{tps:,.0f}", **left)
                    if self.step % cfg.log_every == 0 or self.step == 1:
                        self._log({"kind": "train", "step": self.step, "epoch": self.epoch, "loss": r["loss"],
                                   "grad_norm": r["grad_norm"], "lr": self.sched.get_last_lr()[0], "tokens_per_s": tps})
                    for hook in STEP_HOOKS:
                        hook(self.step)
                    if self.step % cfg.eval_every == 0 and self.step < self.total:
                        last_eval = self._eval_and_save()
                if self.batch_in_epoch >= len(plan):
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        finally:  # close the bar so an error prints on its own line
            if bar is not None:
                bar.close()
        if self.stopped_by_time and self.dist.main:
            log.info("--time-budget %.1f min spent: stopped at step %d of %d (the schedule ended with it)",
                     cfg.time_budget, self.step, self.total)
        if not last_eval or last_eval.get("step") != self.step:
            last_eval = self._eval_and_save()
        self._finish(last_eval, tokens / max(1e-9, time.perf_counter() - t0))
        return last_eval

    def _tick(self) -> None:
        t0, seconds0 = self._clock
        self.train_seconds = seconds0 + time.perf_counter() - t0

    def _out_of_time(self) -> bool:
        """Whether the time budget is spent, by the ranks' mean training seconds (so every rank stops
        at the same step); sets `time_spent`, which the schedule follows."""
        seconds = self.dist.all_sum(torch.tensor([self.train_seconds], dtype=torch.float64, device=self.device))
        self.train_seconds = float(seconds[0]) / self.dist.world
        self.time_spent = min(1.0, self.train_seconds / self.budget_s)
        self.stopped_by_time = self.time_spent >= 1.0
        return self.stopped_by_time

    def _bar(self):
        if not self.dist.main:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self.total, initial=self.step, unit="step", desc="train", dynamic_ncols=True,
                    disable=os.environ.get("EYAS_NO_PROGRESS") == "1")

    def _eval_and_save(self) -> dict:
        m = self.evaluate()
        self._tick()  # the checkpoint's seconds include its evaluation, as the running clock does
        m = {"kind": "eval", "step": self.step, "epoch": self.epoch, **m}
        self._log(m)
        if self.dist.main:
            log.info("step %d: %s", self.step, ", ".join(f"{k}={v:.4f}" for k, v in m.items()
                                                          if k.startswith(("acc_", "loss", "accept"))
                                                          and isinstance(v, float)))
        self.save(m)
        return m

    # ------------------------------------------------------------ files

    def _open_logs(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tb"))
        except ImportError:  # tensorboard is optional
            self.tb = None

    def _log(self, rec: dict) -> None:
        if not self.dist.main:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{rec['kind']}/{k}", v, rec["step"])

    def _export_drafter(self) -> Eagle3Drafter:
        """A plain CPU drafter holding the full weights (gathers FSDP shards on every rank)."""
        sd = {}
        for k, v in self.drafter.state_dict().items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            sd[k] = v.detach().cpu()
        if not self.dist.main:
            return None
        d = Eagle3Drafter(self.drafter.cfg)
        d.load_state_dict(sd)
        d.set_aux_gain(self.drafter.aux_gain.cpu(), keep_function=False)  # folded by save_checkpoint
        d.embedding_loaded = True
        return d

    def save(self, metrics: dict) -> None:
        d = self._export_drafter()
        opt_state = self._optimizer_state()
        if not self.dist.main:
            return
        meta = {**self.meta, "step": self.step, "metrics": metrics}
        ck = self.out / "checkpoints" / f"step-{self.step}"
        save_checkpoint(ck, d, meta)
        # best before the state: a run resumed from this step must know this step's score (it
        # was lost before, so a resumed run could replace RUN/best with a worse checkpoint)
        al = metrics.get("accept_len", -1.0)
        if al > self.best:
            self.best = al
            save_checkpoint(self.out / "best", d, meta)
        state = {"optimizer": opt_state, "optimizer_layout": self._optimizer_layout,
                 "scheduler": self.sched.state_dict(), "step": self.step, "epoch": self.epoch,
                 "batch_in_epoch": self.batch_in_epoch, "best": self.best, "rng": rng_state(),
                 "train_seconds": self.train_seconds, "train_data": self.train_data,
                 "config": to_json(self.cfg), "aux_gain": self.drafter.aux_gain.detach().cpu().clone(),
                 "world": self.dist.world}
        tmp = ck / f".{STATE_FILE}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, ck / STATE_FILE)
        self._prune()

    @property
    def _sharded(self) -> bool:
        return self.cfg.fsdp and self.dist.world > 1

    @property
    def _optimizer_layout(self) -> str:
        """How the saved optimizer state is keyed: parameter names (FSDP) or torch's own ids."""
        return "fqn" if self._sharded else "torch"

    def _optimizer_state(self) -> dict:
        """The optimizer state to save: as torch keeps it, or under FSDP gathered from the shards into
        one full state keyed by parameter name (a collective: every rank calls it). cpu_offload:
        the full state lands in host memory on rank 0 only, the others get an empty dict (the
        large drafters FSDP is for would otherwise hold it whole on every GPU)."""
        if not self._sharded:
            return self.opt.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.opt,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _load_state(self, weights: dict, opt_state: dict | None) -> None:
        if not self._sharded:
            self.drafter.load_state_dict(weights, strict=False)
            if opt_state is not None:
                self.opt.load_state_dict(opt_state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.module, {f"drafter.{k}": v for k, v in weights.items()}, options=opts)
        if opt_state is not None:
            set_optimizer_state_dict(self.module, self.opt, optim_state_dict=opt_state, options=opts)

    def _prune(self) -> None:
        steps = sorted(checkpoint_steps(self.out))
        for s in steps[: max(0, len(steps) - max(1, self.cfg.keep_last))]:
            shutil.rmtree(self.out / "checkpoints" / f"step-{s}", ignore_errors=True)

    def _latest_checkpoint(self) -> Path | None:
        steps = checkpoint_steps(self.out)
        return self.out / "checkpoints" / f"step-{max(steps)}" if steps else None

    def _finish(self, m: dict, tps: float) -> None:
        d = self._export_drafter()
        if not self.dist.main:
            return
        save_checkpoint(self.out / "final", d, {**self.meta, "step": self.step, "metrics": m})
        if self.tb is not None:
            self.tb.close()
        try:
            plot_metrics(self.out / "metrics.jsonl", self.out / "plots")
        except Exception as e:  # plotting must never lose a finished run
            log.warning("could not draw plots: %s", e)
        self.summary = {"step": self.step, "steps_planned": self.total, "stopped_by_time": self.stopped_by_time,
                        "tokens_per_s": tps, **{k: v for k, v in m.items() if k != "kind"}}

    def resume(self) -> int:
        """Load the newest complete checkpoint (weights, optimizer, schedule, RNG, data position)."""
        for parent in (self.out / "checkpoints", self.out):
            for name in sweep_partial(parent):
                log.info("removed %s/%s left by an interrupted checkpoint write", parent, name)
        ck = self._latest_checkpoint()
        if self.dist.world > 1:  # every rank must resume the same step, or the collectives part ways (a hang)
            at = float(ck.name.split("-", 1)[1]) if ck is not None else -1.0
            sums = self.dist.all_sum(torch.tensor([at, at * at], dtype=torch.float64, device=self.device))
            if float(sums[1]) * self.dist.world != float(sums[0]) ** 2:
                raise EyasError(f"--resume {self.out}: the processes found different newest checkpoints (this one: "
                                f"{ck.name if ck else 'none'}); every node must read the same run directory: put --out "
                                "on a shared filesystem, or copy RUN/checkpoints to every node before resuming")
        if ck is None:
            return 0
        try:
            state = torch.load(ck / STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling raises many types for a damaged file
            raise EyasError(f"--resume: {ck / STATE_FILE} cannot be read ({type(e).__name__}); delete {ck} to "
                            "resume from the checkpoint before it, or start a new --out") from e
        now = to_json(self.cfg)
        saved = {"optimizer": "adamw", **state["config"]}  # runs from before --optimizer trained with AdamW
        changed = {k: (v, now.get(k)) for k, v in saved.items()
                   if k in RESUME_MUST_MATCH and now.get(k) != v}
        if changed:
            then, given = {k: v[0] for k, v in changed.items()}, {k: v[1] for k, v in changed.items()}
            raise EyasError(f"--resume {self.out}: the run was started with different settings {then} (now {given}); "
                            "resume with the original flags or start a new --out")
        if state.get("train_data", self.train_data) != self.train_data:
            raise EyasError(f"--resume {self.out}: {ck.name} was trained on other data (its training split's sample "
                            f"ids and lengths differ from {self.meta.get('features', 'this run')}'s): its data "
                            "position would index other samples; resume with the run's own --capture / --data "
                            "(run.json names it), or start a new --out")
        if state.get("world", self.dist.world) != self.dist.world:  # the batch plan and global batch follow it
            raise EyasError(f"--resume {self.out}: {ck.name} was written by a run of {state['world']} process(es), "
                            f"this one has {self.dist.world}; resume with --nproc-per-node {state['world']} (the "
                            "same layout), or start a new --out")
        layout = state.get("optimizer_layout", "torch")
        if state["optimizer"] is not None and layout != self._optimizer_layout:
            raise EyasError(f"--resume {self.out}: {ck.name} was saved {'with' if layout == 'fqn' else 'without'} "
                            "FSDP sharding; resume with the same --fsdp setting and process count")
        try:
            weights = read_tensors(ck / "model.safetensors")
        except EyasError as e:
            raise EyasError(f"--resume: {ck}/model.safetensors cannot be read; delete {ck} to resume from the "
                            "checkpoint before it, or start a new --out") from e
        # model.safetensors holds fc.weight with the gain folded in; training continues on the
        # unfolded weight (exact: the gain is a power of two). Older states had no gain.
        gain = state.get("aux_gain", torch.ones_like(self.drafter.aux_gain.cpu()))
        weights["fc.weight"] = weights["fc.weight"] / gain.to(weights["fc.weight"])
        self.drafter.set_aux_gain(gain, keep_function=False)
        rows, want = weights["lm_head.weight"].shape[0], self.drafter.cfg.draft_vocab_size
        if rows != want:
            raise EyasError(f"--resume: {ck}/model.safetensors has a {rows}-token draft head, this run's --vocab "
                            f"{want} tokens: resume with the run's own --vocab, or start a new --out")
        if "d2t" in weights and not torch.equal(weights["d2t"].long().cpu(), self.drafter.d2t.long().cpu()):
            # same size, other tokens: loading it would leave this run's targets (target_ids, head_rows)
            # on --vocab's tokens and the head on the checkpoint's, a silent mismatch
            raise EyasError(f"--resume: {ck}/model.safetensors was trained on another draft vocabulary (the same "
                            "size as --vocab, other tokens): resume with the run's own --vocab, or start a new --out")
        self._load_state(weights, state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step, self.epoch = state["step"], state["epoch"]
        self.batch_in_epoch, self.best = state["batch_in_epoch"], state["best"]
        self.train_seconds = state.get("train_seconds", 0.0)
        if self.budget_s:
            self.time_spent = min(1.0, self.train_seconds / self.budget_s)
        set_rng_state(state["rng"])
        return self.step


def checkpoint_steps(out: Path) -> list[int]:
    """Steps of complete checkpoints (those with their training state) under out/checkpoints."""
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return []
    return [int(p.name.split("-", 1)[1]) for p in root.iterdir()
            if p.name.startswith("step-") and p.name[5:].isdigit() and (p / STATE_FILE).is_file()]


def rng_state() -> dict:
    """torch / python / numpy RNG states as plain tensors and lists (loadable with weights_only)."""
    v, mt, gauss = random.getstate()
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": [v, list(mt), gauss],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                      int(np_state[3]), float(np_state[4])]}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    v, mt, gauss = s["python"]
    random.setstate((v, tuple(mt), gauss))
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))


def plot_metrics(metrics_file: Path, out: Path) -> list[Path]:
    """PNG curves (train loss; eval acc_i and acceptance length) from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_file)
    train = [r for r in recs if r["kind"] == "train"]
    ev = [r for r in recs if r["kind"] == "eval" and "accept_len" in r]
    out.mkdir(parents=True, exist_ok=True)
    files = []
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    ax[0].plot([r["step"] for r in ev], [r["loss"] for r in ev], "o-", label="eval")
    ax[0].set_title("loss")
    ax[0].legend()
    K = len([k for k in (ev[0] if ev else {}) if k.startswith("acc_")])
    for i in range(K):
        ax[1].plot([r["step"] for r in ev], [r[f"acc_{i}"] for r in ev], "o-", label=f"acc_{i}")
    ax[1].set_title("eval top-1 agreement per TTT step")
    if K:
        ax[1].legend(fontsize=7)
    ax[2].plot([r["step"] for r in ev], [r["accept_len"] for r in ev], "o-")
    ax[2].set_title("simulated acceptance length")
    for a in ax:
        a.set_xlabel("step")
    fig.tight_layout()
    files.append(out / "curves.png")
    fig.savefig(files[-1], dpi=80)
    plt.close(fig)
    return files
