"""Kill and resume (issue 8.2): SIGKILL `data prepare --regenerate`, `capture` and `train` at
seeded points of their progress, check after every kill that whatever is in the output directory
is either complete and valid or rejected/invisible to the readers, rerun to completion and
compare with an uninterrupted run (bit-identical on CPU, fp32).

Each kill is triggered by an observed event (`killer.run_until`), not by the clock: a new line in
the regeneration work file, a shard or checkpoint under its final name, or the temporary file or
directory of one being written. The events of one test come in the order the work reaches them,
so every rerun resumes and is killed further along; which batch, shard or step is seeded.

Files that legitimately differ between runs and are ignored: capture `provenance.json`;
prepared `manifest.json` `provenance` block and the `generation` timing/resume counters
(seconds, tokens_per_s, batches_generated, batches_reused, new_tokens); train `metrics.jsonl` (tokens/s), `run.json` and
each checkpoint's `eyas.json` (provenance: argv includes --resume), `plots/`, `tb/`,
and `train_state.pt` is compared by content (optimizer/scheduler/RNG tensors), not bytes."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.errors import EyasError
from eyas.formats.capture import shard_name
from tests.robustness.killer import artifact_hash, run, run_until


def _kill_cycle(argv, kills: list[tuple[str, Callable[[], bool]]], check) -> list:
    """Run `argv` once per (what, event) of `kills`, SIGKILLed as soon as `event()` holds, and
    judge what each kill left with `check() -> "absent" | "rejected" | "valid"`. At least one
    kill must have left something for the check to judge."""
    outcomes = []
    for what, event in kills:
        code = run_until(argv, event, what)
        outcomes.append((what, code, check()))
    assert any(o[2] != "absent" for o in outcomes), f"no kill left anything to check: {outcomes}"
    return outcomes


def _lines(f: Path) -> int:
    """Complete (newline-terminated) lines of f; 0 when it does not exist."""
    try:
        return f.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


# ---------------------------------------------------------------- data prepare --regenerate


def _check_prepared(out: Path) -> str:
    """The output appears whole (renamed at the end); before that the resumable state is the work
    file beside it, whose complete lines must each be a finished batch."""
    from eyas.formats.data import read_manifest, read_samples

    work = out.with_name(out.name + ".partial") / "batches.jsonl"
    if not out.exists():
        if not work.is_file():
            return "absent"
        lines = work.read_text(encoding="utf-8").split("\n")
        for line in lines[:-1]:  # the last, unterminated one may be torn by the kill
            assert "batch" in json.loads(line), line[:80]
        return "valid"
    try:
        m = read_manifest(out)
    except EyasError:
        return "rejected"
    for split in ("train", "eval"):  # a visible manifest must come with complete samples
        assert len(read_samples(out, split)) == m["counts"][split]
    return "valid"


def _prepared_view(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    m.pop("provenance", None)
    # wall time and what this invocation generated (a resumed run generates only the rest)
    for k in ("seconds", "tokens_per_s", "batches_generated", "batches_reused", "new_tokens"):
        (m.get("generation") or {}).pop(k, None)
    return {"manifest": m, **{n: (out / n).read_bytes() for n in ("train.jsonl", "eval.jsonl")}}


def test_kill_prepare_regenerate(healthy, tmp_path):
    def argv(out):
        return ["data", "prepare", "--target", healthy["target"], "--input", healthy["qa"], "--out", out,
                "--regenerate", "--limit", "8", "--max-new-tokens", "12", "--batch-size", "2", "--temperature", "0.7",
                "--seed", "3", "--eval-fraction", "0.25"]

    ref = tmp_path / "ref"
    r = run(argv(ref))
    assert r.returncode == 0, r.stderr
    n = json.loads((ref / "manifest.json").read_text())["generation"]["batches_generated"]
    k = random.Random(11).randint(1, n - 1)
    out = tmp_path / "run"
    work = out.with_name(out.name + ".partial") / "batches.jsonl"
    kills = [("the work file created", work.exists),  # before any batch is done
             (f"batch {k} of {n} appended", lambda: _lines(work) >= k),  # generating batch k + 1
             # while the output is written under its temporary name (or just after the rename)
             ("the output being written", lambda: any(tmp_path.glob(".run.tmp.*")) or out.exists())]
    outcomes = _kill_cycle(argv(out), kills, check=lambda: _check_prepared(out))
    if out.exists():  # a kill after the rename: the command is complete; rerun needs --force
        pass
    else:
        r2 = run(argv(out))
        assert r2.returncode == 0, (outcomes, r2.stderr)
        assert not list(tmp_path.glob(".run.tmp.*")), "the rerun left a killed run's temporary output beside it"
    assert _prepared_view(out) == _prepared_view(ref), outcomes
    assert not (tmp_path / "run.partial").exists()


# ---------------------------------------------------------------- capture


def _check_capture(out: Path) -> str:
    from eyas.formats.capture import CaptureReader

    shards = list(out.glob("shard-*.safetensors")) if out.exists() else []
    if not shards and not (out / "manifest.json").exists():
        return "absent"
    for f in shards:  # a shard under its final name is complete
        load_file(f)
    try:
        reader = CaptureReader(out)
    except EyasError:
        return "rejected"  # no manifest yet: readers refuse the directory
    reader.validate()
    return "valid"


def test_kill_capture(healthy, tmp_path):
    def argv(out):
        return ["capture", "--target", healthy["target"], "--data", healthy["prep"], "--out", out, "--dtype", "fp32",
                "--batch-tokens", "300", "--shard-mb", "0.05"]

    ref = tmp_path / "ref"
    r = run(argv(ref))
    assert r.returncode == 0, r.stderr
    n = len(list(ref.glob("shard-*.safetensors")))
    j, k = sorted(random.Random(12).sample(range(n - 1), 2))
    out = tmp_path / "run"

    def shard(i: int, tmp: bool = False) -> Path:
        return out / (f".{shard_name(i)}.tmp" if tmp else shard_name(i))

    kills = [(f"shard {j} being written", lambda: shard(j, tmp=True).exists() or shard(j).exists()),
             (f"shard {k} of {n} written", lambda: shard(k).exists()),  # capturing shard k + 1
             ("the last shard written", lambda: shard(n - 1).exists())]  # the manifest is next
    outcomes = _kill_cycle(argv(out), kills, check=lambda: _check_capture(out))
    r2 = run(argv(out))
    assert r2.returncode == 0, (outcomes, r2.stderr)
    ignore = ("provenance.json",)
    assert artifact_hash(out, ignore) == artifact_hash(ref, ignore), outcomes


# ---------------------------------------------------------------- train


def _check_run(out: Path) -> str:
    from eyas.formats.checkpoint import load_checkpoint
    from eyas.stages.trainer import checkpoint_steps

    steps = checkpoint_steps(out) if out.exists() else []
    done = [n for n in ("final", "best") if (out / n).exists()]
    if not steps and not done:
        return "absent"
    for s in steps:  # complete step checkpoints must load
        load_checkpoint(out / "checkpoints" / f"step-{s}")
        torch.load(out / "checkpoints" / f"step-{s}" / "train_state.pt", weights_only=True)
    for name in done:
        load_checkpoint(out / name)
    return "valid"


def _state_equal(a: Path, b: Path) -> None:
    sa = torch.load(a, weights_only=True)
    sb = torch.load(b, weights_only=True)
    for k in ("step", "epoch", "batch_in_epoch", "best"):
        assert sa[k] == sb[k], k
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
        for k in pa:
            assert torch.equal(torch.as_tensor(pa[k]), torch.as_tensor(pb[k])), k


STEPS = 4  # a checkpoint after every step (--eval-every 1)


def test_kill_train(healthy, tmp_path):
    def argv(out):
        return ["train", "--target", healthy["target"], "--capture", healthy["cap"], "--vocab", healthy["vocab"],
                "--out", out, "--ttt", "2", "--max-steps", STEPS, "--eval-every", "1", "--dtype", "fp32",
                "--batch-tokens", "128", "--keep-last", "10", "--resume"]

    ref = tmp_path / "ref"
    r = run(argv(ref))
    assert r.returncode == 0, r.stderr
    a, b = sorted(random.Random(13).sample(range(1, STEPS), 2))
    out = tmp_path / "run"
    ck = out / "checkpoints"
    kills = [  # save_checkpoint writes .step-A.tmp.*, renames it to step-A, then train_state.pt goes in
        (f"checkpoint step-{a} being saved", lambda: any(ck.glob(f".step-{a}.tmp.*")) or (ck / f"step-{a}").exists()),
        (f"checkpoint step-{b} complete", lambda: (ck / f"step-{b}" / "train_state.pt").exists()),
        ("the final checkpoint being saved", lambda: any(out.glob(".final.tmp.*")) or (out / "final").exists())]
    outcomes = _kill_cycle(argv(out), kills, check=lambda: _check_run(out))
    r2 = run(argv(out))
    assert r2.returncode == 0, (outcomes, r2.stderr)
    ignore = ("metrics.jsonl", "run.json", "eyas.json", "plots", "tb/", "train_state.pt")
    got = artifact_hash(out, ignore)
    assert {k: v for k, v in got.items() if "/." not in "/" + k} == artifact_hash(ref, ignore), outcomes
    for s in (out / "checkpoints").iterdir():
        _state_equal(s / "train_state.pt", ref / "checkpoints" / s.name / "train_state.pt")



def test_resume_sweeps_temp_checkpoint_dirs(healthy, tmp_path, cli):
    import shutil

    from tests.robustness.conftest import TRAIN_ARGS

    out = shutil.copytree(healthy["run"], tmp_path / "run")
    junk = out / "checkpoints" / ".step-3.tmp.killed"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\x00" * 100)  # half a checkpoint, as a kill leaves it
    code, _, err = cli("train", "--target", healthy["target"], "--capture", healthy["cap"], "--vocab", healthy["vocab"],
                       "--out", out, *TRAIN_ARGS, "--resume")  # the healthy run's own settings
    assert code == 0, err
    left = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not left, f"temp checkpoint dirs left after resume: {left}"


def test_resume_restores_best_moved_aside_by_a_kill(tmp_path):
    """Killed between moving RUN/best aside and moving the new one in: the old one comes back
    (it is the last complete best); an .old beside a finished checkpoint is removed."""
    from eyas.formats.checkpoint import sweep_partial

    run = tmp_path / "run"
    (run / ".best.old").mkdir(parents=True)
    (run / ".best.old" / "model.safetensors").write_bytes(b"best")
    (run / "final").mkdir()
    (run / ".final.old").mkdir()
    assert sweep_partial(run) == [".best.old", ".final.old"]
    assert (run / "best" / "model.safetensors").read_bytes() == b"best"
    assert sorted(p.name for p in run.iterdir()) == ["best", "final"]
