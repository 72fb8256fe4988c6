"""`eyas train` end to end on a tiny target: overfitting, resume bit-identity, DDP
equivalence, vocabulary-mismatch refusal and --remap, divergence, bad input (exit 2)."""

from __future__ import annotations

import json
import math
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiny
from eyas.formats import features
from eyas.stages import trainer as training
from eyas.formats import capture as fcap
from eyas.cli import main
from eyas.formats.checkpoint import read_tensors

COMMON = ("--dtype", "fp32", "--batch-tokens", "4096", "--max-len", "96")


def _run(*argv) -> int:
    return main([str(a) for a in argv])


def _sharp_target(out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    tiny.build_target(out, tokenizer=tiny.build_tokenizer(), seed=1)
    m = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    m.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, tiny_target):
    """Prepared data (6 train + eval), a full-vocabulary and a partial vocab, and a capture."""
    root = tmp_path_factory.mktemp("train")
    lines = tiny.corpus(40, seed=3)
    chats = root / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(0, 40, 2):
            msg = [{"role": "user", "content": lines[i]},
                   {"role": "assistant", "content": lines[i + 1] + " " + lines[(i + 7) % 40]}]
            f.write(json.dumps({"messages": msg}) + "\n")
    os.environ["EYAS_NO_PROGRESS"] = "1"
    p = {"root": root, "target": tiny_target}
    assert _run("data", "prepare", "--target", tiny_target, "--input", chats, "--out", root / "data",
                "--eval-fraction", "0.3", "--limit", "12") == 0
    assert _run("vocab", "build", "--data", root / "data", "--size", "100", "--out", root / "vocab.safetensors") == 0
    V = len(tiny.build_tokenizer())
    assert _run("vocab", "build", "--data", root / "data", "--size", V, "--out", root / "full.safetensors") == 0
    assert _run("capture", "--target", tiny_target, "--data", root / "data", "--out", root / "cap",
                "--dtype", "fp32") == 0
    # A small repeated set with no eval split (eval falls back to train) and the final-norm
    # state among the aux layers, so a tiny drafter can fit the target exactly.
    # Its target has a sharper head, so top-1 is well defined at most positions.
    sharp = _sharp_target(root / "sharp")
    assert _run("data", "prepare", "--target", sharp, "--input", chats, "--out", root / "data0",
                "--eval-fraction", "0", "--limit", "6") == 0
    assert _run("capture", "--target", sharp, "--data", root / "data0", "--out", root / "cap0",
                "--dtype", "fp32", "--layers", "2,3,4") == 0
    p.update(cap0=root / "cap0", sharp=sharp)
    p.update(data=root / "data", vocab=root / "vocab.safetensors", full=root / "full.safetensors", cap=root / "cap")
    return p


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(ck: Path) -> dict[str, torch.Tensor]:
    return read_tensors(ck / "model.safetensors")


def test_overfit_small_repeated_set(pipe, tmp_path, eyas_cli):
    run = tmp_path / "run"
    code, out, err = eyas_cli("train", "--target", pipe["sharp"], "--capture", pipe["cap0"], "--vocab", pipe["full"],
                              "--out", run, "--ttt", "1", "--epochs", "30", "--lr", "1e-2", "--eval-every", "15",
                              "--warmup-ratio", "0.05", "--json", *COMMON)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["acc_0"] > 0.9, summary
    ev = [m for m in _metrics(run) if m["kind"] == "eval"]
    assert [m["step"] for m in ev] == [15, 30] and ev[-1]["acc_0"] == summary["acc_0"]
    for name in ("final", "best", "plots/curves.png", "run.json", "checkpoints/step-30/train_state.pt"):
        assert (run / name).exists(), name


@pytest.mark.parametrize("stored_argmax", [True, False], ids=["capture", "imported-features"])
def test_resume_is_bit_identical(pipe, tmp_path, eyas_cli, monkeypatch, stored_argmax):
    # without a stored argmax (imported features) epoch 0 computes it and later epochs reuse it from
    # memory; a resume inside a later epoch starts with none kept and must compute the same
    if not stored_argmax:
        monkeypatch.setattr(fcap, "ARGMAX_KEY", "not_in_this_manifest")
    args = ("--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"], "--ttt", "2",
            "--epochs", "3", "--max-steps", "9", "--eval-every", "2", "--batch-tokens", "300", "--max-len", "96",
            "--dtype", "fp32", "--keep-last", "3")
    assert eyas_cli("train", "--out", tmp_path / "a", *args)[0] == 0
    assert sorted(training.checkpoint_steps(tmp_path / "a")) == [6, 8, 9]  # --keep-last 3 pruned steps 2 and 4

    def kill(step):
        if step == 7:
            raise KeyboardInterrupt

    monkeypatch.setattr(training, "STEP_HOOKS", [kill])
    code, _, err = eyas_cli("train", "--out", tmp_path / "b", *args)
    assert code == 130, err
    assert sorted(training.checkpoint_steps(tmp_path / "b")) == [2, 4, 6]
    resumed = torch.load(tmp_path / "b" / "checkpoints" / "step-6" / training.STATE_FILE, weights_only=True)
    assert resumed["epoch"] >= 1  # inside a later epoch: the uninterrupted run reuses epoch 0's argmax there
    code, out, err = eyas_cli("train", "--out", tmp_path / "b", *args)
    assert code == 2 and "--resume" in err  # never silently overwrites a run
    monkeypatch.setattr(training, "STEP_HOOKS", [])
    measured = json.loads((tmp_path / "b" / "run.json").read_text())["init"]["aux_gain"]

    def no_measuring(*a, **k):
        raise AssertionError("a resume takes the aux gain from its checkpoint")

    monkeypatch.setattr(training, "aux_rms", no_measuring)
    code, out, err = eyas_cli("train", "--out", tmp_path / "b", "--resume", "--json", *args)
    assert code == 0, err
    assert json.loads(out)["resumed_from"] == 6
    assert json.loads((tmp_path / "b" / "run.json").read_text())["init"]["aux_gain"] == measured
    state = torch.load(tmp_path / "b" / "checkpoints" / "step-8" / training.STATE_FILE, weights_only=True)
    assert state["aux_gain"].min() > 1  # the gained path was resumed (tiny aux channels: RMS ~0.02)
    wa, wb = _weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    steps_b = [m["step"] for m in _metrics(tmp_path / "b") if m["kind"] == "eval"]
    assert steps_b == [2, 4, 6, 8, 9]
    evals = [m for m in _metrics(tmp_path / "a") if m["kind"] == "eval"]
    for s in (6, 8, 9):  # each state knows its own step's score, so a resume never demotes RUN/best
        st = torch.load(tmp_path / "a" / "checkpoints" / f"step-{s}" / training.STATE_FILE, weights_only=True)
        assert st["best"] == max(m["accept_len"] for m in evals if m["step"] <= s), s


class StepClock:
    """training's `time` module for a test: a clock that moves only when a step ends (1 s each)."""

    def __init__(self, kill_at: int | None = None):
        self.t, self.kill_at = 0.0, kill_at

    def perf_counter(self) -> float:
        return self.t

    def hook(self, step: int) -> None:
        self.t += 1.0
        if step == self.kill_at:
            raise KeyboardInterrupt


def test_time_budget_ends_the_schedule_and_survives_resume(pipe, tmp_path, eyas_cli, monkeypatch):
    """--time-budget: the schedule follows the time spent when it is further along than the steps,
    training stops when the budget is spent (evaluated and saved as final), and a run killed and
    resumed ends bit-identical to an uninterrupted one (its seconds, evaluations included, are in the
    checkpoint). A budget never reached changes nothing."""
    args = ("--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"], "--ttt", "2",
            "--epochs", "10", "--eval-every", "2", "--batch-tokens", "300", "--max-len", "96", "--dtype", "fp32",
            "--keep-last", "3", "--warmup-ratio", "0", "--json")
    timed = (*args, "--time-budget", "0.1")  # 6 s of the clock
    evaluate = training.Trainer.evaluate

    def slow_evaluate(self):  # an evaluation takes 0.5 s of whatever clock training reads
        training.time.t += 0.5
        return evaluate(self)

    monkeypatch.setattr(training.Trainer, "evaluate", slow_evaluate)
    clock = StepClock()
    monkeypatch.setattr(training, "time", clock)
    monkeypatch.setattr(training, "STEP_HOOKS", [clock.hook])
    code, out, err = eyas_cli("train", "--out", tmp_path / "a", *timed)
    assert code == 0, err
    s = json.loads(out)
    # step k starts at (k - 1) s + 0.5 s per evaluation before it: step 6 would start at 6.0 s
    assert s["step"] == 5 and s["stopped_by_time"] and s["steps_planned"] > 20, s
    assert (tmp_path / "a" / "final" / "model.safetensors").is_file()
    state = torch.load(tmp_path / "a" / "checkpoints" / "step-5" / training.STATE_FILE, weights_only=True)
    assert state["train_seconds"] == 6.5  # with the last evaluation
    # the lr for step 6 was set at step 5, when 5 of the 6 s were spent (the steps alone: 4 of 40+);
    # warmup (1 step) is the same share of the time as of the steps
    share = 1 / s["steps_planned"]
    t = (5 / 6 - share) / (1 - share)
    assert state["scheduler"]["_last_lr"][0] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * t)))

    clock = StepClock(kill_at=5)
    monkeypatch.setattr(training, "time", clock)
    monkeypatch.setattr(training, "STEP_HOOKS", [clock.hook])
    assert eyas_cli("train", "--out", tmp_path / "b", *timed)[0] == 130
    clock2 = StepClock()
    clock2.t = clock.t  # the wall clock went on while the run was down
    monkeypatch.setattr(training, "time", clock2)
    monkeypatch.setattr(training, "STEP_HOOKS", [clock2.hook])
    code, out, err = eyas_cli("train", "--out", tmp_path / "b", "--resume", *timed)
    assert code == 0, err
    assert json.loads(out)["resumed_from"] == 4 and json.loads(out)["step"] == 5
    wa, wb = _weights(tmp_path / "a" / "final"), _weights(tmp_path / "b" / "final")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k

    # a budget the run never reaches: the same weights as no budget at all
    for name, extra in (("c", ("--time-budget", "100")), ("d", ())):
        clock = StepClock()
        monkeypatch.setattr(training, "time", clock)
        monkeypatch.setattr(training, "STEP_HOOKS", [clock.hook])
        assert eyas_cli("train", "--out", tmp_path / name, *args, "--max-steps", "8", *extra)[0] == 0
    wc, wd = _weights(tmp_path / "c" / "final"), _weights(tmp_path / "d" / "final")
    for k in wc:
        assert torch.equal(wc[k], wd[k]), k
    code, _, err = eyas_cli("train", "--out", tmp_path / "e", *args, "--time-budget", "0")
    assert code == 2 and "--time-budget" in err and not (tmp_path / "e").exists()


def test_aux_gain_checkpoints_serve_what_training_evaluated(pipe, tmp_path, eyas_cli):
    """Training runs fc on gained aux features (on this tiny target the aux channels have RMS
    ~0.02, gains 32-64); its final checkpoint has the gain folded into fc.weight. Evaluating
    that checkpoint again, as a plain drafter (--aux-gain off) and re-gained (--init-from
    keeps its function), gives the metrics the training run computed with its own weights."""
    base = ("--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"], "--ttt", "2",
            "--json", *COMMON)
    code, out, err = eyas_cli("train", "--out", tmp_path / "run", "--max-steps", "4", "--lr", "3e-3", *base)
    assert code == 0, err
    trained = json.loads(out)
    gain = json.loads((tmp_path / "run" / "run.json").read_text())["init"]["aux_gain"]
    assert gain["gain_min"] >= 16 and gain["tokens"] > 0
    for mode in ("off", "rms"):
        code, out, err = eyas_cli("train", "--out", tmp_path / mode, "--init-from", tmp_path / "run" / "final",
                                  "--max-steps", "0", "--aux-gain", mode, *base)
        assert code == 0, err
        again = json.loads(out)
        assert again["positions"] == trained["positions"]
        assert again["loss"] == pytest.approx(trained["loss"], rel=1e-6, abs=0), mode
        assert [again[f"acc_{i}"] for i in range(2)] == [trained[f"acc_{i}"] for i in range(2)]


def test_align_topk_trains_and_is_part_of_the_run(pipe, tmp_path, eyas_cli):
    base = ("--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"], "--ttt", "3",
            "--max-steps", "2", "--eval-every", "1", *COMMON)
    code, out, err = eyas_cli("train", "--out", tmp_path / "r", "--align-topk", "4", *base)
    assert code == 0, err
    assert json.loads((tmp_path / "r" / "run.json").read_text())["train_config"]["align_topk"] == 4
    code, _, err = eyas_cli("train", "--out", tmp_path / "r", "--resume", *base)  # resumed without it: refused
    assert code == 2 and "align_topk" in err


def test_captured_and_cached_target_argmax_equal_recomputed(pipe, tmp_path, eyas_cli, monkeypatch):
    # `eyas capture` stores the target's full-vocabulary argmax, so every table, from the first
    # step on, is built with it passed in (and without a capture holding it, epochs 2+ pass the
    # cached one); every such table must equal the one built from scratch.
    from eyas.core import ttt

    real, reused, calls = ttt.target_table, [], []

    def checked(last, mask, lm_head, target_ids, t2d, chunk=1024, argmax=None, **transform):
        tab = real(last, mask, lm_head, target_ids, t2d, chunk, argmax, **transform)
        calls.append(argmax is not None)
        if argmax is not None:
            ref = real(last, mask, lm_head, target_ids, t2d, chunk,  # from scratch: the whole head
                       **{k: v for k, v in transform.items() if k != "rows"})
            assert torch.equal(tab.argmax, ref.argmax) and torch.equal(tab.probs, ref.probs)
            assert torch.equal(tab.in_vocab, ref.in_vocab) and torch.equal(tab.index, ref.index)
            reused.append(int(argmax.numel()))
        return tab

    monkeypatch.setattr(training.ttt, "target_table", checked)
    code, _, err = eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                            "--out", tmp_path / "run", "--ttt", "2", "--epochs", "3", "--batch-tokens", "300",
                            "--eval-every", "3", "--dtype", "fp32", "--max-len", "96")
    assert code == 0, err
    assert calls and all(calls) and sum(reused) > 0  # the capture's argmax, from the first step
    # a capture without it (as imported features are): epoch 1 computes it, epochs 2+ reuse it
    calls.clear()
    monkeypatch.setattr(fcap, "ARGMAX_KEY", "not_in_this_manifest")  # the reader then never reads `argmax`
    code, _, err = eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                            "--out", tmp_path / "run2", "--ttt", "2", "--epochs", "3", "--batch-tokens", "300",
                            "--eval-every", "3", "--dtype", "fp32", "--max-len", "96")
    assert code == 0, err
    assert any(calls) and not all(calls)


def test_ddp_two_processes_equal_one(pipe, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1", "TMPDIR": str(tmp_path)}  # torchrun's log dirs
    args = ["--target", str(pipe["target"]), "--capture", str(pipe["cap"]), "--vocab", str(pipe["vocab"]),
            "--ttt", "2", "--max-steps", "2", "--eval-every", "100", "--batch-tokens", "512", "--max-len", "96",
            "--dtype", "fp32", "--lr", "1e-3"]  # 512: the same batches for 1 and 2 processes (a lone leftover
    procs = []  # sample makes its own batch for 1 process but joins the previous one for 2)
    # two processes with a time budget they never reach: the budget's all-reduce runs every step, and
    # changes nothing
    # Muon (the default) under DDP; FSDP shards matrices, so it trains with AdamW, against AdamW in one process
    runs = ((1, tmp_path / "one", []), (2, tmp_path / "two", ["--time-budget", "100"]),
            (1, tmp_path / "one-adamw", ["--optimizer", "adamw"]),
            (2, tmp_path / "fsdp", ["--fsdp", "--optimizer", "adamw"]))
    for n, (procs_n, out, extra) in enumerate(runs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs_n), "--master-port",
               str(29500 + n + os.getpid() % 500 * 3), "-m", "eyas", "train", "--out", str(out), *args, *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-3000:]
    w1, w2, w3, w4 = (_weights(tmp_path / r / "final") for r in ("one", "two", "one-adamw", "fsdp"))
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-3, atol=5e-5)
        torch.testing.assert_close(w4[k], w3[k], rtol=1e-3, atol=5e-5)
    assert any(not torch.allclose(w1[k], w3[k]) for k in w1)  # the two optimizers did differ
    e1 = [m for m in _metrics(tmp_path / "one") if m["kind"] == "eval"][-1]
    e2 = [m for m in _metrics(tmp_path / "two") if m["kind"] == "eval"][-1]
    assert e1["positions"] == e2["positions"]
    assert e1["loss"] == pytest.approx(e2["loss"], rel=1e-4)
    # the logged training loss is the global batch's under every layout (not rank 0's share)
    t1, t2, t3, t4 = ([m["loss"] for m in _metrics(tmp_path / r) if m["kind"] == "train"]
                      for r in ("one", "two", "one-adamw", "fsdp"))
    assert t1 and t1 == pytest.approx(t2, rel=1e-4) and t3 == pytest.approx(t4, rel=1e-4)


def test_fsdp_resume_restores_sharded_optimizer(pipe, tmp_path):
    """Under FSDP (2 processes, gloo) a run resumed from its step-2 checkpoint ends where the
    uninterrupted run ends: weights AND the sharded AdamW moments come back (restarting the
    optimizer would change every later update)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EYAS_NO_PROGRESS": "1", "TMPDIR": str(tmp_path)}  # torchrun's log dirs
    args = ["--target", str(pipe["target"]), "--capture", str(pipe["cap"]), "--vocab", str(pipe["vocab"]),
            "--ttt", "2", "--epochs", "3", "--max-steps", "5", "--eval-every", "2", "--batch-tokens", "400", "--max-len", "96",
            "--dtype", "fp32", "--lr", "1e-3", "--keep-last", "3", "--fsdp", "--optimizer", "adamw"]

    launches = iter(range(3))  # a fresh port per launch: a just-closed one may still be in TIME_WAIT

    def torchrun(*entry) -> subprocess.CompletedProcess:
        port = 30100 + os.getpid() % 400 * 3 + next(launches)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), *entry]
        return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)

    def train(out, *extra):
        p = torchrun("-m", "eyas", "train", "--out", str(out), *args, *extra)
        assert p.returncode == 0, p.stdout[-3000:]

    a, b = tmp_path / "a", tmp_path / "b"
    train(a)
    steps = sorted(training.checkpoint_steps(a))
    assert steps[0] == 2 and steps[-1] == 5
    state = torch.load(a / "checkpoints" / "step-2" / training.STATE_FILE, weights_only=True)
    assert state["optimizer_layout"] == "fqn" and state["optimizer"]["state"]  # the moments are saved
    shutil.copytree(a, b)  # b = a crashed right after its step-2 checkpoint
    for gone in [f"checkpoints/step-{s}" for s in steps[1:]] + ["final", "best"]:
        shutil.rmtree(b / gone)
    c = tmp_path / "c"
    shutil.copytree(b, c)
    # resumed by one process: its batch plan and global batch would differ, refused with the fix
    p = subprocess.run([sys.executable, "-m", "eyas", "train", "--out", str(c), *args, "--resume"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=240)
    assert p.returncode == 2 and "--nproc-per-node 2" in p.stderr and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert training.checkpoint_steps(c) == [2] and not (c / "final").exists()
    # ranks that read different run directories (a node whose copy lacks the newest checkpoint): every
    # rank refuses with the fix before loading anything, instead of hanging in collectives that part ways
    e, d = tmp_path / "e", shutil.copytree(b, tmp_path / "d")
    shutil.copytree(a, e)
    for gone in [f"checkpoints/step-{s}" for s in steps if s > 4] + ["final", "best"]:
        shutil.rmtree(e / gone)
    launcher = tmp_path / "per_rank_out.py"  # the same command, but each rank its own --out
    launcher.write_text("import os, sys\nfrom eyas.cli import main\n"
                        "sys.exit(main(['train', '--out', sys.argv[1 + int(os.environ['RANK'])], *sys.argv[3:]]))\n")
    p = torchrun(str(launcher), str(e), str(d), *args, "--resume")
    assert p.returncode != 0 and p.stdout.count("found different newest checkpoints") == 2, p.stdout[-3000:]
    assert "shared filesystem" in p.stdout
    assert sorted(training.checkpoint_steps(e)) == [2, 4] and training.checkpoint_steps(d) == [2]
    assert not (e / "final").exists() and not (d / "final").exists()
    train(b, "--resume")
    wa, wb = _weights(a / "final"), _weights(b / "final")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


def test_vocab_of_another_tokenizer_refused(pipe, tmp_path, eyas_cli):
    """Same target vocabulary size, different tokenizer: exit 2 before training, nothing written."""
    from eyas.formats.vocab import VocabMap, load_vocab, save_vocab

    vm = load_vocab(pipe["vocab"])
    assert vm.meta["tokenizer_fingerprint"]  # recorded by `eyas vocab build`
    other = tmp_path / "other.safetensors"
    save_vocab(other, VocabMap(vm.d2t, vm.t2d, {**vm.meta, "tokenizer_fingerprint": "0123456789abcdef"}))
    code, _, err = eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", other,
                            "--out", tmp_path / "r", "--max-steps", "1", *COMMON)
    assert code == 2 and "another tokenizer" in err and str(other) in err, err
    assert not (tmp_path / "r").exists()


def test_vocab_mismatch_refused_and_remap_keeps_accuracy(pipe, tmp_path, eyas_cli):
    from eyas.core import vocab as cv
    from eyas.formats.vocab import load_vocab, save_vocab, VocabMap

    # A drafter trained briefly on vocab A.
    a = tmp_path / "a"
    assert eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                    "--out", a, "--ttt", "1", "--max-steps", "4", "--lr", "1e-2", *COMMON)[0] == 0
    # Vocab B: A without its lowest id, so every row of A's head shifts by one position.
    vm = load_vocab(pipe["vocab"])
    ids = vm.target_ids[1:]
    b = tmp_path / "b.safetensors"
    save_vocab(b, VocabMap(cv.d2t_from_ids(ids), cv.t2d_from_ids(ids, vm.target_size)))
    base = ("--target", pipe["target"], "--capture", pipe["cap"], "--init-from", a / "final", "--max-steps", "0",
            "--ttt", "1", "--json", *COMMON)
    code, out, err = eyas_cli("train", "--vocab", b, "--out", tmp_path / "refused", *base)
    assert code == 2
    assert "vocabulary mismatch" in err and "same position 0/99" in err and "--remap" in err
    code, out, err = eyas_cli("train", "--vocab", "from-checkpoint", "--out", tmp_path / "orig", *base)
    assert code == 0, err
    orig = json.loads(out)
    code, out, err = eyas_cli("train", "--vocab", b, "--remap", "--out", tmp_path / "remapped", *base)
    assert code == 0, err
    remapped = json.loads(out)
    assert remapped["positions"] == orig["positions"]
    assert remapped["acc_0"] == pytest.approx(orig["acc_0"])
    w = _weights(tmp_path / "remapped" / "final")["lm_head.weight"]
    torch.testing.assert_close(w, _weights(a / "final")["lm_head.weight"][1:])


def test_nan_stops_with_step_named_and_keeps_last_good_checkpoint(pipe, tmp_path, eyas_cli, monkeypatch):
    real = features.TensorSource.batch
    done = {"step": 0}

    def poisoned(self, split, idxs):
        b = real(self, split, idxs)
        if split == "train" and done["step"] == 2:  # the batch of step 3
            b.aux[0, 0, 0] = float("nan")
        return b

    monkeypatch.setattr(features.TensorSource, "batch", poisoned)
    monkeypatch.setattr(training, "STEP_HOOKS", [lambda step: done.update(step=step)])
    run = tmp_path / "run"
    code, out, err = eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                              "--out", run, "--ttt", "2", "--max-steps", "5", "--eval-every", "2",
                              "--batch-tokens", "300", "--max-len", "96", "--dtype", "fp32")
    assert code == 2
    assert "non-finite loss at step 3" in err and "step-2" in err
    assert training.checkpoint_steps(run) == [2]
    assert not (run / "final").exists()


def test_drafter_flags_train_and_export_checks(pipe, tmp_path, eyas_cli):
    """--drafter-flags builds a speculators-style drafter (its flags land in the checkpoint and
    change the function); `eyas export` refuses an engine that would ignore them (SGLang)."""
    base = ("--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"], "--ttt", "2",
            "--max-steps", "2", "--batch-tokens", "300", "--max-len", "96", "--dtype", "fp32")
    run = tmp_path / "run"
    code, out, err = eyas_cli("train", "--out", run, "--drafter-flags", "norm_before_residual,norm_before_fc,norm_output",
                              "--json", *base)
    assert code == 0, err
    cfg = json.loads((run / "final" / "config.json").read_text())
    assert cfg["norm_before_residual"] and cfg["norm_before_fc"] and cfg["norm_output"] and not cfg["fc_norm"]
    assert "input_norm.weight" in _weights(run / "final")
    gain = json.loads((run / "run.json").read_text())["init"]["aux_gain"]
    assert gain.startswith("off")  # fc's input is normalised: a gain measured on raw features would not fold
    code, out, err = eyas_cli("export", run, "--to", "sglang", "--out", tmp_path / "sglang", "--target", pipe["target"])
    assert code == 1 and "norm_before_fc" in (out + err) and not (tmp_path / "sglang").exists()
    for engine in ("vllm", "speculators"):  # both implement the flags (tests/serve/test_serve_vllm.py serves them)
        code, out, err = eyas_cli("export", run, "--to", engine, "--out", tmp_path / engine, "--target", pipe["target"])
        assert code == 0, err
    for bad, needle in (("norm_after_fc", "unknown flag"), ("norm_before_fc,fc_norm", "exclude each other")):
        code, _, err = eyas_cli("train", "--out", tmp_path / "x", "--drafter-flags", bad, *base)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    code, _, err = eyas_cli("train", "--out", tmp_path / "x", "--drafter-flags", "norm_output",
                            "--init-from", run / "final", *base)
    assert code == 2 and "--init-from keeps" in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad,expect", [
    (("--ttt", "0"), "--ttt 0"),
    (("--lr", "-1"), "--lr -1"),
    (("--aux-gain", "max"), "invalid choice: 'max'"),
    (("--align-topk", "-1"), "--align-topk -1"),
    (("--vocab", "/nonexistent/vocab.safetensors"), "does not exist"),
    (("--max-len", "4"), "no training sample has a supervised token within the first --max-len 4"),
    (("--max-len", "4", "--online", "", "--data", "DATA"), "raise --max-len"),
])
def test_bad_arguments_exit_2(pipe, tmp_path, cli, bad, expect):
    argv = {"--target": str(pipe["target"]), "--capture": str(pipe["cap"]), "--vocab": str(pipe["vocab"]),
            "--out": str(tmp_path / "r")}
    argv.update(dict(zip(bad[::2], bad[1::2])))
    if "--online" in argv:  # a flag without a value; features from the prepared data instead
        argv.pop("--capture"), argv.pop("--online")
        argv["--data"] = str(pipe["data"])
    code, out, err = cli("train", *[x for kv in argv.items() for x in kv], *(["--online"] if "--online" in bad else []))
    assert code == 2 and expect in err, err
    assert "Traceback" not in err and not (tmp_path / "r").exists()


def test_wrong_capture_for_target_exit_2(pipe, tiny_targets, tmp_path, eyas_cli):
    other = tiny.build_target(tmp_path / "other", hidden=32, layers=2, tokenizer=tiny.build_tokenizer())
    code, out, err = eyas_cli("train", "--target", other, "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                              "--out", tmp_path / "r")
    assert code == 2 and "manifest.json" in err and str(other) in err
    assert "capture features from this target or pass the matching --target" in err  # the fix
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_incompatible_init_checkpoint_exit_2(pipe, tmp_path, eyas_cli):
    from eyas import targets
    from eyas.core.drafter import DrafterConfig, Eagle3Drafter
    from eyas.formats.checkpoint import save_checkpoint

    cfg = DrafterConfig.from_target(targets.load_config(pipe["target"]), 100, [1, 2, 3])
    d = Eagle3Drafter(cfg)
    d.t2d[:100] = True  # a valid map (d2t = 0: draft id i is target id i); only the aux layers differ
    save_checkpoint(tmp_path / "ck", d, {})
    code, out, err = eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                              "--init-from", tmp_path / "ck", "--out", tmp_path / "r")
    assert code == 2 and "aux layers [1, 2, 3]" in err


def test_online_matches_offline_features(pipe, tmp_path, eyas_cli):
    # --online computes the same features in-process: identical eval metrics at init.
    base = ("--target", pipe["target"], "--vocab", pipe["vocab"], "--max-steps", "0", "--ttt", "2", "--json",
            *COMMON)
    code, out, err = eyas_cli("train", "--capture", pipe["cap"], "--out", tmp_path / "off", *base)
    assert code == 0, err
    off = json.loads(out)
    code, out, err = eyas_cli("train", "--online", "--data", pipe["data"], "--out", tmp_path / "on", *base)
    assert code == 0, err
    on = json.loads(out)
    assert on["positions"] == off["positions"]
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-4)


def test_several_captures_are_trained_together(pipe, tmp_path, eyas_cli):
    # The same capture given twice: every split holds each sample twice, so the eval counts double.
    base = ("--target", pipe["target"], "--vocab", pipe["vocab"], "--max-steps", "0", "--ttt", "2", "--json",
            *COMMON)
    code, out, err = eyas_cli("train", "--capture", pipe["cap"], "--out", tmp_path / "one", *base)
    assert code == 0, err
    one = json.loads(out)
    code, out, err = eyas_cli("train", "--capture", pipe["cap"], pipe["cap"], "--out", tmp_path / "two", *base)
    assert code == 0, err
    two = json.loads(out)
    assert two["positions"] == 2 * one["positions"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_resume_names_a_damaged_checkpoint_and_the_way_back(pipe, tmp_path, eyas_cli):
    """A step checkpoint damaged on disk: --resume exits 2 naming it and saying to delete it; after
    that it resumes from the one before. A changed --vocab or other training data is named too."""
    import shutil

    run = tmp_path / "r"
    base = ("train", "--target", pipe["target"], "--capture", pipe["cap"], "--out", run, "--ttt", "1",
            "--eval-every", "1", "--max-steps", "2", "--epochs", "4", *COMMON)
    assert eyas_cli(*base, "--vocab", pipe["vocab"])[0] == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-1", "step-2"]
    newest = run / "checkpoints" / "step-2"
    (newest / "train_state.pt").write_bytes(b"not a pickle")
    code, _, err = eyas_cli(*base, "--vocab", pipe["vocab"], "--resume")
    assert code == 2 and str(newest / "train_state.pt") in err and f"delete {newest}" in err, err
    shutil.rmtree(newest)
    code, _, err = eyas_cli(*base, "--vocab", pipe["vocab"], "--resume")
    assert code == 0, err
    code, _, err = eyas_cli(*base, "--vocab", pipe["full"], "--resume")
    assert code == 2 and "draft head" in err and "--vocab" in err, err
    from eyas.formats.vocab import VocabMap, load_vocab, save_vocab

    vm = load_vocab(pipe["vocab"])  # the same size, one token swapped for one outside it
    ids = vm.target_ids.clone()
    ids[-1] = int((~vm.t2d).nonzero()[0])
    ids = ids.sort().values
    t2d = torch.zeros_like(vm.t2d)
    t2d[ids] = True
    save_vocab(tmp_path / "other.safetensors", VocabMap(ids - torch.arange(ids.numel()), t2d))
    code, _, err = eyas_cli(*base, "--vocab", tmp_path / "other.safetensors", "--resume")
    assert code == 2 and "another draft vocabulary" in err, err
    # other data (the data position would index other samples): refused; the same capture moved: resumes
    i = base.index("--capture")
    code, _, err = eyas_cli(*base[:i + 1], pipe["cap"], *base[i + 1:], "--vocab", pipe["vocab"], "--resume")
    assert code == 2 and "trained on other data" in err and "--capture" in err, err
    shutil.copytree(pipe["cap"], tmp_path / "moved")
    code, _, err = eyas_cli(*base[:i + 1], tmp_path / "moved", *base[i + 2:], "--vocab", pipe["vocab"], "--resume")
    assert code == 0, err


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_init_from_a_peer_layout_with_another_vocabulary(pipe, tmp_path, eyas_cli, layout):
    """--init-from a checkpoint in a peer's layout (SGLang `midlayer.*`, speculators `layers.0.*`)
    whose draft vocabulary differs from --vocab by one id (every head row one position off):
    refused without --remap (exit 2, nothing written), and with it the rows follow their tokens,
    so step-0 accuracy is the checkpoint's own. (The same token set in another order: the test
    after the next.)"""
    from eyas.core import vocab as cv
    from eyas.formats.vocab import VocabMap, load_vocab, save_vocab

    a = tmp_path / "a"
    assert eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                    "--out", a, "--ttt", "1", "--max-steps", "4", "--lr", "1e-2", *COMMON)[0] == 0
    ck = tmp_path / layout
    code, _, err = eyas_cli("export", a, "--to", layout, "--out", ck, "--target", pipe["target"])
    assert code == 0, err
    vm = load_vocab(pipe["vocab"])
    ids = vm.target_ids[1:]
    b = tmp_path / "b.safetensors"
    save_vocab(b, VocabMap(cv.d2t_from_ids(ids), cv.t2d_from_ids(ids, vm.target_size)))
    base = ("--target", pipe["target"], "--capture", pipe["cap"], "--init-from", ck, "--max-steps", "0",
            "--ttt", "1", "--json", *COMMON)
    code, out, err = eyas_cli("train", "--vocab", b, "--out", tmp_path / "refused", *base)
    assert code == 2 and "vocabulary mismatch" in err and "--remap" in err, err
    assert not (tmp_path / "refused").exists()
    code, out, err = eyas_cli("train", "--vocab", pipe["vocab"], "--out", tmp_path / "orig", *base)
    assert code == 0, err
    code, out2, err = eyas_cli("train", "--vocab", b, "--remap", "--out", tmp_path / "remapped", *base)
    assert code == 0, err
    orig, remapped = json.loads(out), json.loads(out2)
    assert remapped["acc_0"] == pytest.approx(orig["acc_0"]) and orig["acc_0"] > 0.05, (orig, remapped)
    w = _weights(tmp_path / "remapped" / "final")["lm_head.weight"]
    torch.testing.assert_close(w, _weights(tmp_path / "orig" / "final")["lm_head.weight"][1:])


def test_init_from_a_map_held_in_another_order(pipe, tmp_path, eyas_cli):
    """The issue's permutation case. Engines only add d2t's offsets, so an SGLang checkpoint may list
    its draft vocabulary in any order (say by frequency) and serve correctly. eyas keeps ids ascending:
    it sorts such a map on import and moves the lm_head rows with it, so --init-from with the data's
    own vocabulary starts from the checkpoint's step-0 accuracy. The control (rows shuffled, map left
    sorted: the silent mismatch) shows the permutation matters."""
    from safetensors.torch import load_file, save_file

    a = tmp_path / "a"
    assert eyas_cli("train", "--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"],
                    "--out", a, "--ttt", "1", "--max-steps", "4", "--lr", "1e-2", *COMMON)[0] == 0
    ck = tmp_path / "sglang"
    assert eyas_cli("export", a, "--to", "sglang", "--out", ck, "--target", pipe["target"])[0] == 0
    state = load_file(ck / "model.safetensors")
    N = state["d2t"].numel()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(N) + state["d2t"]

    def variant(name, d2t, head):
        shutil.copytree(ck, tmp_path / name)
        save_file({**state, "d2t": d2t.contiguous(), "lm_head.weight": head.contiguous()},
                  tmp_path / name / "model.safetensors")
        return tmp_path / name
    permuted = variant("permuted", ids[perm] - torch.arange(N), state["lm_head.weight"][perm])
    shuffled = variant("shuffled", state["d2t"], state["lm_head.weight"][perm])

    from eyas.formats.engines import engine_reading
    notes = engine_reading(permuted, "sglang").notes
    assert any("out of ascending order" in n for n in notes), notes
    code, out, err = eyas_cli("convert", permuted, "--to", "eyas", "--out", tmp_path / "conv", "--json")
    assert code == 0, err
    assert any("sorted them" in n for n in json.loads(out)["notes"]), out
    torch.testing.assert_close(_weights(tmp_path / "conv")["lm_head.weight"], _weights(a / "final")["lm_head.weight"])
    assert torch.equal(_weights(tmp_path / "conv")["d2t"], _weights(a / "final")["d2t"])

    base = ("--target", pipe["target"], "--capture", pipe["cap"], "--vocab", pipe["vocab"], "--max-steps", "0",
            "--ttt", "1", "--json", *COMMON)
    acc = {}
    for name, src in (("orig", ck), ("permuted", permuted), ("shuffled", shuffled)):
        code, out, err = eyas_cli("train", "--init-from", src, "--out", tmp_path / f"run_{name}", *base)
        assert code == 0, err
        acc[name] = json.loads(out)["acc_0"]
    assert acc["permuted"] == pytest.approx(acc["orig"]) and acc["orig"] > 0.05, acc
    assert acc["shuffled"] < 0.5 * acc["orig"], acc
    torch.testing.assert_close(_weights(tmp_path / "run_permuted" / "final")["lm_head.weight"],
                               _weights(tmp_path / "run_orig" / "final")["lm_head.weight"])
