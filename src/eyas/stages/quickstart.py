"""`eyas quickstart`: the whole pipeline on the built-in default target, end to end —
fetch the target, prepare the built-in prompts with answers written by the target,
build the draft vocabulary, capture features, train, and bench on the eval split (never
trained on) — then print one summary table and where the report is.

Each stage runs through the public CLI (`eyas.cli.main`) into OUT/<stage>-<hash>, where the
hash covers the stage's argv (which names its inputs, themselves hashed directories), the
target's fingerprint and eyas's own code. A stage whose done-marker
(OUT/.done/<stage>-<hash>.json) exists is skipped, so a rerun only redoes what changed.
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
from eyas.errors import EyasError
from eyas.stages import data as data_stage
from eyas.stages.bench import DEFAULT_METHODS, default_cutoff, method_rows
from eyas.stages.common import add_json_flag, emit, write_json_atomic

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


# `small` where every stage runs in fp32 on a CPU without native bf16, sized to finish within 20
# minutes on a 2-core AVX2 EPYC: about half the prompts (48k supervised tokens, 3,263 distinct: a 4k
# draft vocabulary covers them all and halves the head's share of a step), shorter bench answers,
# and the training spent on optimizer steps rather than depth. Measured there on this plan's
# capture, ~7 min of training each (val of its eval split): 2048-token batches, 3 epochs, TTT 5:
# 122 steps, acc_0 0.29, simulated acceptance 1.41 (bench: chain 0.88x, tree 0.84x plain);
# 1024, 3 epochs, TTT 5: 240 steps, 0.35 / 1.60; 1024, 5 epochs, TTT 3: 400 steps, 0.43 / 1.76;
# 512, 5 epochs, TTT 3: 855 steps in 434 s, 0.44 / 1.80 (this plan).
# Tried on this plan since, none better on MT-bench + MBPP (`bench/RESULTS.md`, "data and training choices"): 46k
# tokens of answers not written by the target, half real public prompts, TTT 2 x 7 epochs, 256-token
# batches, weight decay 0.1, learning rate 5e-4 or 2e-3 instead of 1e-3. Validation at these tokens
# (2026-12-04): 256-token batches again, a loss on prompt positions too, feature noise: within 1.2%;
# the draft head frozen at the target's rows: 2% worse.
# Muon instead of AdamW (2026-12-04, the train stage of a fresh run of this plan rerun on its capture with the
# 8.4-min --time-budget that run gave it): 512-token batches 575 of 855 steps, val simulated acceptance
# 1.867 (acc_0 0.465) against AdamW's 1.798 (0.443) in all 855; 1024-token batches 394 of 400 steps, 1.882.
# Served on the 17 held-out prompts (48 tokens, cutoff 0, one run): chain / tree acceptance 1.96 / 2.47 (512),
# 1.96 / 2.40 (1024) against 1.89 / 2.39; on MT-bench + MBPP all three level (1.48-1.49 / 1.84-1.86).
FP32_CPU_SMALL = Plan(prompts=360, answer_tokens=160, eval_fraction=0.04, max_len=640, draft_vocab=4096,
                      train_epochs=5, train_max_steps=1500, ttt=3, batch_tokens=512, bench_prompts=10,
                      bench_new_tokens=48, minutes=(0.2, 5.2, 0.1, 2.6, 8.6, 2.7),  # 2026-12-01: 19.2 min
                      deadline=19.5, optimizer="muon")

PLANS = {
    # small, measured on this 2-core CPU (bf16, quiet machine): 200 prompts x 128 tokens, 3 epochs
    # TTT 3 took 5.3 min in all but trained only 51 s (tree acceptance 1.63). 440 prompts x 160
    # tokens, 6 epochs TTT 5 took 19.4 min (data 8.3, capture 0.7, train 9.1, bench 1.2; tree
    # acceptance 2.00); 5 epochs keep a margin under 20 minutes. With the length-windowed batch
    # plan (less padding, fewer steps per epoch) 5 epochs at 4096 batch tokens gave 110 steps and
    # tree acceptance 1.71 in 15.6 min; 2048 batch tokens: 215 steps in the same 5.6 min of
    # training, tree acceptance 1.87 (about 15.7 min in all). With eyas's own batched regeneration
    # (4.4x generate()'s tokens/s) 700 prompts took 14.4 min (data 4.1, capture 1.4, train 7.7 for
    # 345 steps, bench 1.2); tree acceptance 2.09, 1.19x plain.
    # 2026-12-01, on a slower day for the same kind of VM (transformers' generate() at half the
    # speed): 24.1 min (data 7.0, capture 1.1, train 12.9 for 395 steps, bench 2.6); with the
    # regeneration's prefill fix 23.3 min (data 6.3, capture 1.6, train 12.8, bench 2.6), the same
    # drafter (acc_0 0.49, tree acceptance 2.41, 1.58x plain bf16). The ETA uses the slow day's minutes.
    # Later that day, with the chunked training loss and regeneration batches of 128, on a faster hour
    # (the unchanged capture 1.0 min, not 1.6): 17.4 min (data 4.0, capture 1.0, train 10.3, bench 2.1).
    # That evening, with the cheaper target table and eyas.cpu.hostmem, on the slowest hour (plain decoding
    # 12.7 tok/s, not 24.3): 23.6 min (data 4.6, capture 1.3, train 14.2, bench 3.6), same data and drafter quality.
    # On a 2-core AVX2 EPYC (fp32, prepacked decoding) that plan took about 50 min (data 10.7,
    # capture 5.0, train 30.3 at 355 tok/s, bench 3.6), so there `small` runs FP32_CPU_SMALL.
    # Batch size, same capture and 5 epochs (2026-12-01 late evening, runs two at a time, one thread
    # each; val of the eval split): 2048 tokens, 400 steps, simulated acceptance 2.036 (seed 1: 2.055)
    # in 19.6 min; 1024, 797 steps, 2.121 in 19.3 min (this plan: the same tokens/s); 512, 1,688 steps,
    # 2.187 in 21.4 min (about 10% fewer tokens/s); 2048 for 7 epochs, 560 steps, 2.176 in 25.0 min.
    # The whole quickstart with it (and the bench's bf16 cutoff 0.05), fresh: 21.8 min (data 4.5, capture
    # 1.2, train 13.6 for 797 steps, bench 2.5), val 2.096, own bench tree 1.61x plain bf16.
    # 2026-12-02, to bring the default under 20 minutes on middling hours: TTT 4 instead of 5 (training
    # about 15% shorter; its steps 1.06x faster since that day's head + loss change) against 4 epochs
    # instead of 5 (about 20% shorter), both on that run's capture, one thread each, served in one process
    # (tree 4,5,16 at the bench's 0.05 cutoff; 20 MT-bench + MBPP / the 10 held-out built-in prompts):
    # TTT 5 x 5 epochs acceptance 1.86 / 2.26, TTT 4 x 5 epochs 1.84 / 2.16, TTT 5 x 4 epochs 1.78 / 2.09.
    # Fresh quickstart with TTT 4, same day: 20.2 min (data 4.9 at 349 tok/s, capture 1.4, train 11.2 for 797
    # steps at 963 tok/s, bench 2.7 of which 0.7 for transformers' generate(), since dropped from its
    # baselines); val acc_0 0.509; own bench tree 1.58x plain bf16 (acceptance 2.14), chain 1.44x (1.86).
    # Its data stage with bf16 decoding attention through SDPA (cpu.attention.gqa_attention), same hour,
    # one after the other: 6.0 -> 4.6 min (regeneration 286 -> 375 tok/s); the ETA scales 6.3 by that.
    # With `deadline` (same day): 17.0 min on a fast hour (train 9.9 of an 11.9-min budget: every step);
    # pinned to one core, about half the speed, 18.4 min (budget 6.4 min: 347 of 785 steps, val acc_0 0.40
    # instead of 0.48), where it would have taken about 26.
    # Muon instead of AdamW (2026-12-04, this plan's train argv on one capture, all 795 steps each): val
    # simulated acceptance 2.37 vs 2.10 on a 2-core Zen 4 CPU (bf16 Newton-Schulz: steps about 1.25x
    # longer), 2.36 vs 2.12 on an H200 (58 vs 46 s; Muon at step 400 ahead of AdamW at 600). Served in
    # one `eyas bench` (bf16, cutoff 0.05), Muon vs AdamW: the held-out built-in prompts tree 4,5,16
    # acceptance 2.52 vs 2.28 (1.73x vs 1.60x plain), chain 2.17 vs 1.97; MT-bench + MBPP tree 1.81 vs 1.74.
    "small": Plan(prompts=700, answer_tokens=160, eval_fraction=0.04, max_len=640, draft_vocab=8192,
                  train_epochs=5, train_max_steps=1600, ttt=4, batch_tokens=1024, bench_prompts=10,
                  bench_new_tokens=64, minutes=(0.2, 4.8, 0.1, 1.6, 11.6, 2.4), fp32_cpu=FP32_CPU_SMALL,
                  deadline=19.5, optimizer="muon"),
    # medium: both built-in sets, the generated prompts and the 2,474 public ones (MIT / Apache-2.0,
    # eyas/data/PUBLIC_PROMPTS.md), all answered by the target, 3 epochs in one cosine schedule at
    # 4096-token batches. Measured: 78.7 min (data 31.5, capture 7.0, train 36.1 for 741 steps, bench
    # 4.1); val acc_0 0.52; tree 6,6,24 acceptance 3.25 on its (code-only) eval prompts, but 2.30-2.41
    # on MT-bench + MBPP (MT-bench half 1.93, MBPP half 2.78 at 4,5,16). Earlier drafters reached 2.75-2.94
    # there, but their data held 70 other MT-bench questions and 767 other MBPP tasks: they lead on
    # the MBPP half (3.85-4.15) far more than on the MT-bench half (2.11-2.23). 2,000 extra chat prompts
    # written by the target itself (`--self-prompts`, 2 epochs over both at the same step count) left
    # the MT-bench half unchanged (1.92). The bench's wider tree (6,6,24) reports the higher
    # acceptance; it is not the faster one for this drafter (MT-bench + MBPP: 1.24x vs 1.34x at 4,5,16).
    # 2048-token batches instead of 4096 (same data, same 3 epochs, 1,432 steps instead of 738):
    # training 30 min instead of 36 (1,360 vs 1,130 tok/s), val simulated acceptance 2.31 vs 2.21,
    # MT-bench + MBPP tree 4,5,16 2.34 vs 2.30, chain 1.84 vs 1.78 (`bench/RESULTS.md`).
    # With --aux-gain rms (2026-11-30, data/vocab/capture reused): train 31.8 min, val simulated
    # acceptance 2.54 (acc_0 0.59); its own bench tree 6,6,24 2.70 (1.35x); MT-bench + MBPP tree
    # 4,5,16 2.53 (1.52x plain bf16), chain 1.89 (1.35x), prompt lookup 1.23x. In all about 75 min.
    # 1024-token batches instead of 2048 (2026-12-02, fresh data/vocab/capture of this plan, both trained
    # side by side at one thread each, 2,855 vs 1,432 steps): val simulated acceptance 2.69 vs 2.60 (acc_0
    # 0.626 vs 0.602; level until a quarter of training, the lead grows after); `eyas bench` on MT-bench +
    # MBPP (bf16, tree 4,5,16, cutoff 0.05): acceptance tree 2.39 vs 2.27, chain 1.97 vs 1.92; speedup
    # over plain 1.76x both in separate runs, 1.88x vs 1.72x paired prompt by prompt in one process.
    # Data ETA 24 min: 31.5 less the ~8 min the SDPA decoding attention and bounded batches saved on its
    # last two regeneration batches (721 -> 247 s, same day); the whole stage not rerun.
    # Muon instead of AdamW (2026-12-04, a 2-core Zen 4 CPU: this plan's fresh capture, its train argv twice side
    # by side, one thread each, --time-budget 40 both): Muon 1,296 steps, val simulated acceptance 2.568 (acc_0
    # 0.604) vs AdamW 1,600 steps 2.298 (0.545); Muon ahead at every evaluation, at equal steps (600: 2.19 vs
    # 1.85) and at equal time. Served in one `eyas bench` on 10 MT-bench + 10 MBPP (fp32, cutoff 0.1, 96 tokens):
    # tree 4,5,16 acceptance 1.80 vs 1.71 (1.54x vs 1.50x plain), chain 1.64 vs 1.57.
    # The whole plan end to end with Muon (2026-12-05, that Zen 4 CPU, fresh directory, nothing else running):
    # 101.7 min (data 26.8, vocab 0.0, capture 14.2, train 56.0 for all 2,862 steps, bench 4.7), peak RSS 9.6 GB;
    # val simulated acceptance 3.00 (acc_0 0.683). Own bench (20 held-out prompts, fp32, cutoff 0.1): tree 4,5,16
    # 1.87x plain (acceptance 2.31), chain 1.77x, prompt lookup 1.15x. MT-bench (2 per category) + MBPP, fp32:
    # tree 1.78x (2.20), chain 1.63x; tree 8,7,48 at cutoff 0: acceptance 3.16 at 0.91x. `minutes` are that run's,
    # but the bench's: that argv with tree+lookup added (the bench's third method since) took 5.5 min there.
    # Again with Muon's 3-step iteration (2026-12-05, stop 54, the same CPU on a faster hour: regeneration 650
    # tok/s, capture 2.8x faster with no change to it): 68.8 min (data 15.2, capture 5.1, train 43.1 for 2,853
    # steps at 953 tok/s, bench 5.4), val 3.05 (acc_0 0.690). `minutes` keep the slower run's figures.
    "medium": Plan(prompts=4000, answer_tokens=192, eval_fraction=0.04, max_len=1024, draft_vocab=8192,
                   train_epochs=3, train_max_steps=5000, ttt=5, batch_tokens=1024, bench_prompts=20,
                   bench_new_tokens=128, minutes=(0.2, 27, 0.1, 14, 56, 5.5), inputs=("builtin-public", "builtin"),
                   tree="6,6,24", optimizer="muon"),
    # large: sized for a GPU, where Muon's step costs milliseconds (5.5 ms for SmolLM2's drafter on an H200,
    # against steps of 8192 tokens) and trained the small plan's drafter better in less time (above)
    "large": Plan(prompts=4000, answer_tokens=256, eval_fraction=0.04, max_len=1024, draft_vocab=32000,
                  train_epochs=6, train_max_steps=10000, ttt=7, batch_tokens=8192, bench_prompts=40,
                  bench_new_tokens=128, minutes=(0.2, 45, 0.5, 10, 120, 25), inputs=("builtin-public", "builtin"),
                  tree="6,6,24", optimizer="muon"),
}

STAGES = ("target", "data", "vocab", "capture", "train", "bench")
# ETA factors per stage (data, vocab, capture, train, bench) for the plans' bf16/AMX minutes when
# the stages run in fp32 on a CPU without native bf16: the small plan on a 2-core AVX2 EPYC
# (2026-11-30; data and bench with prepacked weights): data 10.7, capture 5.0, train 30.3, bench 3.6 min
FP32_CPU_SLOWDOWN = (2.6, 1.0, 3.6, 3.9, 3.0)

# The per-stage argv, in one table: {placeholders} are filled from the plan and from the
# directories of earlier stages. Keep stage flags here only.
ARGV: dict[str, list[str]] = {
    "data": ["data", "prepare", "--target", "{target}", "--input", "{inputs}", "--regenerate",
             "--limit", "{prompts}", "--max-new-tokens", "{answer_tokens}", "--eval-fraction", "{eval_fraction}",
             "--max-len", "{max_len}", "--batch-size", "{regen_batch}", "--device", "{device}", "--dtype", "{dtype}",
             "--out", "{out}", "--force"],
    "vocab": ["vocab", "build", "--data", "{data}", "--size", "{draft_vocab}", "--target", "{target}",
              "--out", "{out}/vocab.safetensors", "--force"],
    "capture": ["capture", "--target", "{target}", "--data", "{data}", "--device", "{device}", "--dtype", "{dtype}",
                "--out", "{out}", "--force"],
    "train": ["train", "--target", "{target}", "--capture", "{capture}", "--vocab", "{vocab}/vocab.safetensors",
              "--epochs", "{train_epochs}", "--max-steps", "{train_max_steps}", "--ttt", "{ttt}",
              "--batch-tokens", "{batch_tokens}", "--max-len", "{max_len}", "--device", "{device}",
              "--dtype", "{dtype}", "--aux-gain", "rms", "--optimizer", "{optimizer}", "{time_budget}",
              "--out", "{out}", "--force"],
    # --aux-gain explicit: runs trained before it are not reused. {time_budget}: see train_budget.
    # --optimizer: each plan's own (Plan.optimizer), the one its minutes and steps were measured with
    "bench": ["bench", "--target", "{target}", "--drafter", "{train}/final", "--prompts", "builtin-eval",
              "--data", "{data}", "--limit", "{bench_prompts}", "--max-new-tokens", "{bench_new_tokens}",
              "--tree", "{tree}", "--draft-cutoff", "{draft_cutoff}", "--baselines", "plain,pld",
              "--methods", DEFAULT_METHODS,
              "--device", "{device}", "--dtype", "{bench_dtype}", "--out", "{out}", "--force"],
    # the cutoff and methods explicit: a changed default reruns the stage. Baselines plain and prompt lookup only:
    # transformers' generate() (`eyas bench`'s third default) took 40 of the small plan's 163 bench seconds
    # (2026-12-02) and is never the fastest plain decoding here (0.88-0.92x eyas's plain loop)
}


def register(sub) -> None:
    p = sub.add_parser("quickstart", help="the whole pipeline on the built-in target, end to end",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="small", choices=tuple(PLANS),
                   help="small: about 20 min on 2 CPU cores (700 generated prompts with native bf16; where the stages "
                   "run in fp32 on a CPU, a plan sized for that: 360 prompts): training gets what is left of 19.5 "
                   "min after the stages before it and the bench's estimate (at least 2 min), so a slow hour "
                   "trains fewer steps; "
                   "medium: ~100 min on a 2-core bf16 CPU (3,600 generated + public prompts, 3 epochs); large: the "
                   "same prompts, longer answers, 32k vocab, TTT 7, sized for a GPU")
    p.add_argument("--target", default=targets.DEFAULT_TARGET, help=argparse.SUPPRESS)  # for tests / other targets
    p.add_argument("--out", type=Path, default=Path("eyas-quickstart"), help="work directory (reused by reruns)")
    p.add_argument("--device", default="auto", help="where every stage runs: cpu, cuda, cuda:N or auto (cuda when "
                   "present, else cpu; default auto); the dtype follows it (bf16 on CUDA)")
    add_json_flag(p)
    p.set_defaults(func=run)


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


def stage_key(stage: str, argv: list[str], fingerprint: str) -> str:
    """Content hash of a stage: its argv (inputs are hashed dirs), the target fingerprint and
    eyas's code (`code_fingerprint`)."""
    blob = json.dumps({"stage": stage, "argv": argv, "target": fingerprint, "eyas": code_fingerprint()})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def fill(template: list[str], values: dict) -> list[str]:
    """Format each token; a token that is exactly one placeholder of a tuple value expands to its items."""
    out: list[str] = []
    for t in template:
        v = values.get(t[1:-1]) if t.startswith("{") and t.endswith("}") else None
        out += list(v) if isinstance(v, tuple) else [t.format(**values)]
    return out


def run_stage_cli(argv: list[str], quiet: bool) -> int:
    """One stage through the public CLI; its stdout goes to stderr under --json."""
    from eyas.cli import main

    with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
        return main(argv)


# regeneration batch (`data prepare --batch-size`): the CLI's default on a CPU; a GPU decodes a
# wide batch in about the time of a narrow one
REGEN_BATCH = {"cpu": data_stage.REGEN_BATCH, "cuda": 256}
# The bench tree where the bench decodes in fp32 on a CPU, instead of a plan's wider one: there a 24-token
# verification costs about 1.8x a 1-token one. The GPU-trained medium drafter on its 20 held-out
# prompts (AVX2 EPYC, 2026-11-30, two runs in a row): tree 4,5,16 1.17x plain (acceptance 2.53),
# 6,6,24 1.05x (2.71); chain 1.22x / 1.20x. On an H200 a 24-token forward cost 1.07x a 1-token one.
FP32_CPU_TREE = "4,5,16"


# minutes of the train stage outside its optimizer loop (loading, the aux gain, the last evaluation,
# saving, plots), which --time-budget does not count
TRAIN_STAGE_OVERHEAD = 0.7


def train_budget(deadline: float, elapsed: float, bench_minutes: float) -> float:
    """Minutes of --time-budget for the train stage: what the deadline leaves after the minutes
    elapsed, the train stage's own overhead and the bench stage's planned minutes. Never under 2
    minutes: a run already late still trains a drafter worth benching. The bench's minutes are not
    scaled by the pace of the stages before it: batched regeneration and capture do not predict
    one-token decoding (a Zen 4 CPU without AMX ran the data stage at 1.8x its planned minutes and
    the bench at 0.67x; a slow hour of an AMX CPU ran the data stage on plan and the bench at 1.5x)."""
    return max(2.0, deadline - elapsed - TRAIN_STAGE_OVERHEAD - bench_minutes)


def run_pipeline(target: str, out: Path, plan: Plan, quiet: bool = False,
                 runner: Callable[[list[str], bool], int] = run_stage_cli, device: str = "cpu") -> dict:
    """Run (or reuse) every stage on `device`; returns {stages: [...], bench: summary or None}."""
    dev = targets.parse_device(device)
    out = Path(out).resolve()
    (out / ".done").mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tdir = targets.resolve(target)
    fp = targets.fingerprint(tdir)
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
    # the concrete device and dtype go into every argv, hence into the stage hashes
    values = {**asdict(plan), "target": str(tdir), "device": str(dev), "regen_batch": REGEN_BATCH[dev.type],
              "dtype": dtype, "bench_dtype": bench_dtype,
              "draft_cutoff": default_cutoff(dev, targets.parse_dtype(bench_dtype))}
    if bench_dtype == "fp32" and dev.type == "cpu":
        values["tree"] = FP32_CPU_TREE
    rows = [{"stage": "target", "status": "ok", "seconds": round(time.perf_counter() - t_start, 1), "dir": str(tdir)}]
    remaining = [m * f for m, f in zip(plan.minutes[1:], slow)]  # CPU minutes: no estimate on a GPU
    planned = dict(zip(STAGES[1:], remaining))
    timed = plan.deadline is not None and dev.type == "cpu"
    # a timed train stage's hash names the deadline, not the minutes it got (they depend on the hour)
    values["time_budget"] = ("--time-budget", f"deadline-{plan.deadline}") if timed else ()
    for i, stage in enumerate(STAGES[1:], start=2):
        argv_t = ARGV[stage]
        key = stage_key(stage, fill(argv_t, {**values, "out": "OUT"}), fp)
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
        if stage == "train" and timed:
            budget = train_budget(plan.deadline, elapsed, planned["bench"])
            log.info("train: --time-budget %.1f min aims the run at %.1f min (elapsed %.1f, %.1f kept for "
                     "the bench)", budget, plan.deadline, elapsed, planned["bench"])
            argv = fill(argv_t, {**values, "out": str(sdir), "time_budget": ("--time-budget", f"{budget:.2f}")})
        else:
            argv = fill(argv_t, {**values, "out": str(sdir)})
        if timed:  # only training gives way to the deadline
            eta = max(min(eta, plan.deadline - elapsed), sum(planned[s] for s in STAGES[i - 1:] if s != "train"))
        left = f"about {eta:.0f} min left" if dev.type == "cpu" else "no estimate on a GPU"
        log.info("[%d/%d] %s (elapsed %.1f min, %s): eyas %s", i, len(STAGES), stage, elapsed, left, " ".join(argv))
        sdir.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        code = runner(argv, quiet)
        if code != 0:
            raise EyasError(f"quickstart: stage {stage} failed (exit {code}); rerun `eyas {' '.join(argv)}` "
                            f"to see why, then rerun quickstart (finished stages are reused)")
        secs = time.perf_counter() - t0
        write_json_atomic(marker, {"stage": stage, "argv": argv, "seconds": secs, "key": key,
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


def run(args) -> int:
    result = run_pipeline(args.target, args.out, PLANS[args.budget], quiet=bool(args.json), device=args.device)
    emit(args, result, table(result))
    return 0
