"""Kill and resume (issue 8.2): SIGKILL `data prepare --regenerate`, `capture` and `train` at
seeded random points, check after every kill that whatever is in the output directory is
either complete and valid or rejected/invisible to the readers, rerun to completion and
compare with an uninterrupted run (bit-identical on CPU, fp32).

Files that legitimately differ between runs and are ignored: capture `provenance.json`;
prepared `manifest.json` `provenance` block and the `generation` timing/resume counters
(seconds, tokens_per_s, batches_generated, batches_reused, new_tokens); train `metrics.jsonl` (tokens/s), `run.json` and
each checkpoint's `eyas.json` (provenance: argv includes --resume), `plots/`, `tb/`,
and `train_state.pt` is compared by content (optimizer/scheduler/RNG tensors), not bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.errors import EyasError
from tests.robustness.killer import artifact_hash, kill_points, run, run_and_kill

STARTUP_S = 3.0
LEFTOVERS: dict[str, list] = {}  # hidden temp entries a killed run left in its output (checked below)  # python + torch import before any output can exist


def _kill_cycle(argv, ref_wall: float, seed: int, n: int, check) -> list:
    """Kill at n seeded points in (STARTUP_S*0.8, ref_wall), checking what each kill left with
    `check() -> "absent" | "rejected" | "valid"`. A cycle whose kills all came before the command
    wrote anything has checked nothing: it is killed once more late in its run (each rerun resumes),
    and at least one kill must have left something for the check to judge."""
    outcomes = []
    for t in kill_points(seed, n, min(STARTUP_S * 0.8, ref_wall * 0.3), ref_wall * 0.95):
        code = run_and_kill(argv, t)
        outcomes.append((round(t, 2), code, check()))
    if all(o[2] == "absent" for o in outcomes):
        code = run_and_kill(argv, ref_wall * 0.9)
        outcomes.append((round(ref_wall * 0.9, 2), code, check()))
    assert any(o[2] != "absent" for o in outcomes), f"no kill left anything to check: {outcomes}"
    return outcomes


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
    r, wall = run(argv(ref))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    outcomes = _kill_cycle(argv(out), wall, seed=11, n=3, check=lambda: _check_prepared(out))
    if out.exists():  # a kill after the rename: the command is complete; rerun needs --force
        pass
    else:
        r2, _ = run(argv(out))
        assert r2.returncode == 0, (outcomes, r2.stderr)
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
    r, wall = run(argv(ref))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    outcomes = _kill_cycle(argv(out), wall, seed=12, n=3, check=lambda: _check_capture(out))
    r2, _ = run(argv(out))
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


def test_kill_train(healthy, tmp_path):
    def argv(out):
        return ["train", "--target", healthy["target"], "--capture", healthy["cap"], "--vocab", healthy["vocab"],
                "--out", out, "--ttt", "2", "--max-steps", "4", "--eval-every", "1", "--dtype", "fp32",
                "--batch-tokens", "128", "--keep-last", "10", "--resume"]

    ref = tmp_path / "ref"
    r, wall = run(argv(ref))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    outcomes = _kill_cycle(argv(out), wall, seed=13, n=3, check=lambda: _check_run(out))
    r2, _ = run(argv(out))
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
