"""`eyas quickstart`: the whole pipeline on the built-in default target, end to end —
fetch the target, prepare the built-in prompts with answers written by the target,
build the draft vocabulary, capture features, train, and bench on the eval split (never
trained on) — then print one summary table and where the report is.

Each stage is its stage function called with its config (the one its command line would
build; the log shows that command) into OUT/<stage>-<hash>, where the hash covers the config
(which names its inputs, themselves hashed directories), the target's fingerprint and eyas's
own code. A stage whose done-marker (OUT/.done/<stage>-<hash>.json) exists is skipped, so a
rerun only redoes what changed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from eyas import targets
from eyas.config import arg, build, command, to_argv, to_json
from eyas.errors import EyasError
from eyas.stages import bench as bench_stage
from eyas.stages import capture as capture_stage
from eyas.stages import data as data_stage
from eyas.stages import train as train_stage
from eyas.stages import vocab as vocab_stage
from eyas.stages.bench import DEFAULT_METHODS, default_cutoff, method_rows
from eyas.stages.common import emit, write_json_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Sizes of one budget. `minutes` is the rough expected time of each stage on 2 CPU cores."""

    prompts: int  # built-in prompts to prepare (before the eval split)
    answer_tokens: int  # --max-new-tokens of the regenerated answers
    eval_fraction: float
    max_len: int
    draft_vocab: int
    train_epochs: int
    train_max_steps: int
    ttt: int
    batch_tokens: int
    bench_prompts: int
    bench_new_tokens: int
    # resolved per machine (targets.fast_dtype): bf16 on CUDA and CPUs with AMX or AVX512-BF16, else fp32;
    # the bench stage's by targets.decode_dtype (fp32 on a CPU without AMX)
    dtype: str = "auto"
    minutes: tuple[float, ...] = (0.2, 6, 0.2, 1, 6, 4)
    inputs: tuple[str, ...] = ("builtin",)  # `eyas data prepare --input`
    tree: str = "4,5,16"  # `eyas bench --tree`
    optimizer: str = "adamw"  # `eyas train --optimizer`: the plan's minutes and steps were measured with it
    # minutes the whole run may take on a CPU: the train stage gets what the stages before it and
    # the bench's estimate leave (`train_budget`), so a slow hour trains fewer steps instead of
    # running late. None: every planned step
    deadline: float | None = None
    # the plan to run instead where the stages run in fp32 on a CPU (no native bf16), sized for
    # that machine; its `minutes` are that machine's own
    fp32_cpu: Plan | None = None


# `small` where every stage runs in fp32 on a CPU without native bf16 (how it was sized:
# docs/results/quickstart-plans.md)
FP32_CPU_SMALL = Plan(prompts=360, answer_tokens=160, eval_fraction=0.04, max_len=640, draft_vocab=4096,
                      train_epochs=5, train_max_steps=1500, ttt=3, batch_tokens=512, bench_prompts=10,
                      bench_new_tokens=48, minutes=(0.2, 5.2, 0.1, 2.6, 8.6, 2.7),
                      deadline=19.5, optimizer="muon")

PLANS = {
    # how each plan was measured and chosen: docs/results/quickstart-plans.md
    "small": Plan(prompts=700, answer_tokens=160, eval_fraction=0.04, max_len=640, draft_vocab=8192,
                  train_epochs=5, train_max_steps=1600, ttt=4, batch_tokens=1024, bench_prompts=10,
                  bench_new_tokens=64, minutes=(0.2, 4.8, 0.1, 1.6, 11.6, 2.4), fp32_cpu=FP32_CPU_SMALL,
                  deadline=19.5, optimizer="muon"),
    "medium": Plan(prompts=4000, answer_tokens=192, eval_fraction=0.04, max_len=1024, draft_vocab=8192,
                   train_epochs=3, train_max_steps=5000, ttt=5, batch_tokens=1024, bench_prompts=20,
                   bench_new_tokens=128, minutes=(0.2, 27, 0.1, 14, 56, 5.5), inputs=("builtin-public", "builtin"),
                   tree="6,6,24", optimizer="muon"),
    # large: sized for a GPU, where Muon's step costs milliseconds
    "large": Plan(prompts=4000, answer_tokens=256, eval_fraction=0.04, max_len=1024, draft_vocab=32000,
                  train_epochs=6, train_max_steps=10000, ttt=7, batch_tokens=8192, bench_prompts=40,
                  bench_new_tokens=128, minutes=(0.2, 45, 0.5, 10, 120, 25), inputs=("builtin-public", "builtin"),
                  tree="6,6,24", optimizer="muon"),
}

STAGES = ("target", "data", "vocab", "capture", "train", "bench")
# ETA factors per stage (data, vocab, capture, train, bench) for the plans' bf16/AMX minutes when
# the stages run in fp32 on a CPU without native bf16 (measured: docs/results/quickstart-plans.md)
FP32_CPU_SLOWDOWN = (2.6, 1.0, 3.6, 3.9, 3.0)



@dataclass(frozen=True)
class StageCall:
    """How the quickstart runs one stage: the `eyas` words of its command, and its config built
    from the plan's values and the directories of the stages before it."""

    words: tuple[str, ...]
    run: Callable[[object], int]
    config: Callable[[dict], object]


# Keep the stages' settings here only. --aux-gain explicit: runs trained before it are not reused;
# --optimizer: each plan's own (Plan.optimizer), the one its minutes and steps were measured with;
# --time-budget: see train_budget. Bench: the cutoff and methods explicit, so a changed default reruns
# the stage; baselines plain and prompt lookup only: transformers' generate() takes a large share of
# the bench and is never the fastest plain decoding (docs/results/quickstart-plans.md).
CALLS: dict[str, StageCall] = {
    "data": StageCall(("data", "prepare"), data_stage.run_prepare, lambda v: build(
        data_stage.PrepareConfig, target=v["target"], input=list(v["inputs"]), regenerate=True, limit=v["prompts"],
        max_new_tokens=v["answer_tokens"], eval_fraction=v["eval_fraction"], max_len=v["max_len"],
        batch_size=v["regen_batch"], device=v["device"], dtype=v["dtype"], out=v["out"], force=True)),
    "vocab": StageCall(("vocab", "build"), vocab_stage.run_build, lambda v: build(
        vocab_stage.BuildConfig, data=[v["data"]], size=v["draft_vocab"], target=v["target"],
        out=f"{v['out']}/vocab.safetensors", force=True)),
    "capture": StageCall(("capture",), capture_stage.run_capture, lambda v: build(
        capture_stage.CaptureConfig, target=v["target"], data=v["data"], device=v["device"], dtype=v["dtype"],
        out=v["out"], force=True)),
    "train": StageCall(("train",), train_stage.train, lambda v: build(
        train_stage.TrainConfig, target=v["target"], capture=[v["capture"]], vocab=f"{v['vocab']}/vocab.safetensors",
        epochs=v["train_epochs"], max_steps=v["train_max_steps"], ttt=v["ttt"], batch_tokens=v["batch_tokens"],
        max_len=v["max_len"], device=v["device"], dtype=v["dtype"], aux_gain="rms", optimizer=v["optimizer"],
        time_budget=v["time_budget"], out=v["out"], force=True)),
    "bench": StageCall(("bench",), bench_stage.run, lambda v: build(
        bench_stage.BenchConfig, target=v["target"], drafter=[f"{v['train']}/final"], prompts=["builtin-eval"],
        data=v["data"], limit=v["bench_prompts"], max_new_tokens=v["bench_new_tokens"], tree=v["tree"],
        draft_cutoff=v["draft_cutoff"], baselines="plain,pld", methods=DEFAULT_METHODS, device=v["device"],
        dtype=v["bench_dtype"], out=v["out"], force=True)),
}


@dataclass(frozen=True)
class QuickstartConfig:
    budget: str = arg("small: a trained drafter within a 19.5-minute deadline on a CPU; medium: about 4,000 "
                      "prompts, 3 epochs; large: sized for a GPU (docs/usage.md describes the plans)", "small",
                      choices=tuple(PLANS))
    target: str = arg("the target (for tests and other targets; default the built-in one)", targets.DEFAULT_TARGET,
                      cli=False)
    out: Path = arg("work directory (reused by reruns)", Path("eyas-quickstart"))
    device: str = arg("where every stage runs: cpu, cuda, cuda:N or auto (cuda when present, else cpu); the "
                      "dtype follows it (bf16 on CUDA)", "auto")
    json: bool = arg("print a machine-readable JSON summary", False)


def register(sub) -> None:
    p = command(sub, "quickstart", QuickstartConfig, run, help="the whole pipeline on the built-in target, end to end",
                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=targets.DEFAULT_TARGET, help=argparse.SUPPRESS)  # for tests / other targets


# ---------------------------------------------------------------- pipeline


@functools.cache
def code_fingerprint() -> str:
    """Hash of eyas's own files (modules and shipped data). A stage's output depends on the code
    that made it, and the version string is not bumped for every change, so an upgraded or edited
    eyas reruns the stages instead of reusing what older code made."""
    return files_hash(Path(__file__).resolve().parent.parent)


def files_hash(root: Path) -> str:
    """sha256 of every file under `root` (relative path and bytes), caches of compiled Python excluded."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def stage_key(stage: str, config: dict, fingerprint: str) -> str:
    """Content hash of a stage: its config as JSON (inputs are hashed dirs), the target fingerprint
    and eyas's code (`code_fingerprint`)."""
    blob = json.dumps({"stage": stage, "config": config, "target": fingerprint, "eyas": code_fingerprint()})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def run_stage(stage: str, cfg, quiet: bool) -> None:
    """One stage's function called with its config; its stdout goes to stderr under --json. A
    stage fails by raising EyasError; a non-zero exit code is a failure too."""
    with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
        code = CALLS[stage].run(cfg)
    if code:
        raise EyasError(f"exit code {code}")


# regeneration batch (`data prepare --batch-size`): the CLI's default on a CPU; a GPU decodes a
# wide batch in about the time of a narrow one
REGEN_BATCH = {"cpu": data_stage.REGEN_BATCH, "cuda": 256}
# The bench tree where the bench decodes in fp32 on a CPU, instead of a plan's wider one: there a 24-token
# verification costs about twice a 1-token one (docs/results/quickstart-plans.md)
FP32_CPU_TREE = "4,5,16"


# minutes of the train stage outside its optimizer loop (loading, the aux gain, the last evaluation,
# saving, plots), which --time-budget does not count
TRAIN_STAGE_OVERHEAD = 0.7


def train_budget(deadline: float, elapsed: float, bench_minutes: float) -> float:
    """Minutes of --time-budget for the train stage: what the deadline leaves after the minutes
    elapsed, the train stage's own overhead and the bench stage's planned minutes. Never under 2
    minutes: a run already late still trains a drafter worth benching. The bench's minutes are not
    scaled by the pace of the stages before it: batched regeneration and capture do not predict
    one-token decoding (docs/cpu-performance.md, "Measurements behind the code's constants")."""
    return max(2.0, deadline - elapsed - TRAIN_STAGE_OVERHEAD - bench_minutes)


def _on_this_machine(plan: Plan, dev) -> tuple[Plan, dict, tuple[float, ...]]:
    """(the plan to run, the values the stage configs are built from, ETA factors per stage) on
    `dev`. The concrete device and dtypes go into every config, hence into the stage hashes."""
    dtype = targets.fast_dtype(str(dev)) if plan.dtype == "auto" else plan.dtype
    # the bench decodes in fp32 on a CPU without AMX even where training runs in bf16 (targets.decode_dtype)
    bench_dtype = targets.decode_dtype(str(dev)) if plan.dtype == "auto" else plan.dtype
    log.info("dtype: %s on %s", dtype, dev)
    fp32_cpu = dtype == "fp32" and dev.type == "cpu"
    # plan.minutes were measured in bf16 (CPUs with AMX or AVX512-BF16); where auto picks fp32 (no native bf16) the
    # stages take longer (FP32_CPU_SLOWDOWN), unless the plan has a variant sized for such a CPU
    slow = FP32_CPU_SLOWDOWN if fp32_cpu else (1.0,) * len(FP32_CPU_SLOWDOWN)
    if fp32_cpu and plan.fp32_cpu is not None:
        plan, slow = plan.fp32_cpu, (1.0,) * len(FP32_CPU_SLOWDOWN)
        log.info("fp32 on a CPU: the plan sized for it (%d prompts, %d epochs, %d-token draft vocabulary)",
                 plan.prompts, plan.train_epochs, plan.draft_vocab)
    values = {**asdict(plan), "device": str(dev), "regen_batch": REGEN_BATCH[dev.type], "dtype": dtype,
              "bench_dtype": bench_dtype, "draft_cutoff": default_cutoff(dev, targets.parse_dtype(bench_dtype)),
              "time_budget": None}
    if bench_dtype == "fp32" and dev.type == "cpu":
        values["tree"] = FP32_CPU_TREE
    return plan, values, slow


def run_pipeline(target: str, out: Path, plan: Plan, quiet: bool = False,
                 runner: Callable[[str, object, bool], None] = run_stage, device: str = "cpu") -> dict:
    """Run (or reuse) every stage on `device`; returns {stages: [...], bench: summary or None}."""
    dev = targets.parse_device(device)
    out = Path(out).resolve()
    (out / ".done").mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tdir = targets.resolve(target)
    fp = targets.fingerprint(tdir)
    plan, values, slow = _on_this_machine(plan, dev)
    values["target"] = str(tdir)
    rows = [{"stage": "target", "status": "ok", "seconds": round(time.perf_counter() - t_start, 1), "dir": str(tdir)}]
    remaining = [m * f for m, f in zip(plan.minutes[1:], slow)]  # CPU minutes: no estimate on a GPU
    planned = dict(zip(STAGES[1:], remaining))
    timed = plan.deadline is not None and dev.type == "cpu"
    for i, stage in enumerate(STAGES[1:], start=2):
        call = CALLS[stage]
        hashed = to_json(call.config({**values, "out": "OUT"}))
        if stage == "train" and timed:  # the hash names the deadline, not the minutes it got (they depend on the hour)
            hashed["time_budget"] = f"deadline-{plan.deadline}"
        key = stage_key(stage, hashed, fp)
        sdir = out / f"{stage}-{key}"
        marker = out / ".done" / f"{stage}-{key}.json"
        values[stage] = str(sdir)
        eta = sum(remaining)
        remaining.pop(0)
        if marker.is_file() and sdir.is_dir():  # a stage directory deleted by hand is built again
            rows.append({"stage": stage, "status": "reused", "seconds": 0.0, "dir": str(sdir)})
            log.info("[%d/%d] %s: reused %s", i, len(STAGES), stage, sdir)
            continue
        elapsed = (time.perf_counter() - t_start) / 60
        budget = None
        if stage == "train" and timed:
            budget = round(train_budget(plan.deadline, elapsed, planned["bench"]), 2)
            log.info("train: --time-budget %.1f min aims the run at %.1f min (elapsed %.1f, %.1f kept for "
                     "the bench)", budget, plan.deadline, elapsed, planned["bench"])
        cfg = call.config({**values, "out": str(sdir), "time_budget": budget})
        argv = to_argv(call.words, cfg)
        command = " ".join(argv)
        if timed:  # only training gives way to the deadline
            eta = max(min(eta, plan.deadline - elapsed), sum(planned[s] for s in STAGES[i - 1:] if s != "train"))
        left = f"about {eta:.0f} min left" if dev.type == "cpu" else "no estimate on a GPU"
        log.info("[%d/%d] %s (elapsed %.1f min, %s): eyas %s", i, len(STAGES), stage, elapsed, left, command)
        sdir.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            runner(stage, cfg, quiet)
        except EyasError as e:
            raise type(e)(f"quickstart: stage {stage} failed: {e} (the stage's command: `eyas {command}`; "
                          "finished stages are reused when quickstart is rerun)") from e
        secs = time.perf_counter() - t0
        write_json_atomic(marker, {"stage": stage, "command": ["eyas", *argv],
                                   "config": to_json(cfg), "seconds": secs, "key": key,
                                   "eyas_code": code_fingerprint()})
        rows.append({"stage": stage, "status": "ran", "seconds": round(secs, 1), "dir": str(sdir)})
    bench, gap = _bench_summary(Path(values["bench"]))
    return {"stages": rows, "bench": bench, "draft_cutoff": values["draft_cutoff"], "first_draft_gap": gap,
            "report": str(Path(values["bench"]) / "report.md"), "seconds": round(time.perf_counter() - t_start, 1)}


def _bench_summary(bdir: Path) -> tuple[dict | None, dict | None]:
    """(per-method figures, the chain's first-draft gap) from the bench stage's report.json."""
    f = bdir / "report.json"
    if not f.is_file():
        return None, None
    s = json.loads(f.read_text())["summary"]
    keep = ("tokens_per_s", "speedup", "acceptance_length", "step_cost", "time_split")
    return ({m: {k: st.get(k) for k in keep} for m, st in s["methods"].items()},
            (s.get("first_draft_gap") or {}).get("chain"))


def table(result: dict) -> str:
    lines = [f"{'stage':9s} {'status':7s} {'seconds':>8s}  directory"]
    lines += [f"{r['stage']:9s} {r['status']:7s} {r['seconds']:8.1f}  {r['dir']}" for r in result["stages"]]
    if result["bench"]:
        lines += ["", *method_rows(result["bench"], result.get("draft_cutoff"))]
    g = result.get("first_draft_gap")
    if g and g["val_acc_0"] is not None:
        lines += ["", f"chain first draft: validation acc_0 {g['val_acc_0']:.2f}, on the bench prompts "
                  f"{g['tf_all']:.2f} (teacher-forced), {g['tf_at_steps']:.2f} at step starts, "
                  f"served {g['served_first']:.2f} (report.md explains the gap)"]
    lines += ["", f"total {result['seconds'] / 60:.1f} min; report: {result['report']}"]
    return "\n".join(lines)


def run(cfg: QuickstartConfig) -> int:
    result = run_pipeline(cfg.target, cfg.out, PLANS[cfg.budget], quiet=cfg.json, device=cfg.device)
    emit(cfg, result, table(result))
    return 0
