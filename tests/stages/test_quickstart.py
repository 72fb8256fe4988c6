"""`eyas quickstart`: content-hashed stage reuse (with a recording stub runner), the stage
configs against the real CLI, and the whole pipeline through the real stage functions on a tiny
target (`make demo` runs it on the built-in target)."""

from __future__ import annotations

import json
import pathlib

import pytest

from eyas.config import from_namespace, to_argv
from eyas.errors import EyasError
from eyas.stages import quickstart as qs
from eyas.stages.bench import CPU_BF16_CUTOFF, CPU_CUTOFF

PLAN = qs.Plan(prompts=4, answer_tokens=4, eval_fraction=0.5, max_len=64, draft_vocab=32, train_epochs=1,
               train_max_steps=1, ttt=2, batch_tokens=256, bench_prompts=1, bench_new_tokens=4, dtype="fp32")


class Recorder:
    """A stage runner that records (stage, config) and makes the stage's output directory."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple[str, object]] = []
        self.fail = fail

    def __call__(self, stage, cfg, quiet):
        self.calls.append((stage, cfg))
        if stage == self.fail:
            raise EyasError("boom")
        out = cfg.out.parent if stage == "vocab" else cfg.out  # vocab's --out is the file
        out.mkdir(parents=True, exist_ok=True)  # as every stage does
        if stage == "bench":
            summary = {"methods": {"plain": {"tokens_per_s": 10.0, "speedup": 1.0},
                                   "chain": {"tokens_per_s": 12.0, "speedup": 1.2, "acceptance_length": 2.0,
                                             "step_cost": {"total": 1.55, "target": 1.4, "drafter": 0.15},
                                             "time_split": {"target": 0.8, "drafter": 0.15, "overhead": 0.05}}},
                       "first_draft_gap": {"chain": {"val_acc_0": 0.6, "tf_all": 0.55, "tf_at_steps": 0.45,
                                                     "served_first": 0.45}}}
            (out / "report.json").write_text(json.dumps({"summary": summary}))

    def stages(self, start: int = 0) -> list[str]:
        return [stage for stage, _ in self.calls[start:]]

    def config(self, stage: str):
        return next(cfg for s, cfg in self.calls if s == stage)


def test_rerun_reuses_finished_stages(tiny_target, tmp_path):
    rec = Recorder()
    first = qs.run_pipeline(str(tiny_target), tmp_path, PLAN, runner=rec)
    assert rec.stages() == ["data", "vocab", "capture", "train", "bench"]
    assert [r["status"] for r in first["stages"]] == ["ok", "ran", "ran", "ran", "ran", "ran"]
    assert first["bench"]["chain"]["speedup"] == 1.2
    # every stage's inputs are the hashed directories of the stages before it
    assert rec.config("train").capture == [pathlib.Path(first["stages"][3]["dir"])]
    again = qs.run_pipeline(str(tiny_target), tmp_path, PLAN, runner=rec)
    assert len(rec.calls) == 5
    assert [r["status"] for r in again["stages"][1:]] == ["reused"] * 5
    # a changed vocab size reruns vocab and everything downstream, not data
    qs.run_pipeline(str(tiny_target), tmp_path, qs.Plan(**{**PLAN.__dict__, "draft_vocab": 16}), runner=rec)
    assert rec.stages(5) == ["vocab", "train", "bench"]  # capture does not read the vocab
    table = qs.table(again)  # bench's own method table (step cost, overhead) and the first-draft gap
    assert "served 0.45" in table
    chain_row = next(r for r in table.splitlines() if r.startswith("chain "))
    assert chain_row.split()[1:] == ["12.0", "1.20x", "2.00", "1.55x", "5%"]


def test_changed_eyas_code_reruns_every_stage(tiny_target, tmp_path, monkeypatch):
    """The stage hash covers eyas's own files: stages made by other code are not reused."""
    rec = Recorder()
    qs.run_pipeline(str(tiny_target), tmp_path, PLAN, runner=rec)
    monkeypatch.setattr(qs, "code_fingerprint", lambda: "other-code")
    again = qs.run_pipeline(str(tiny_target), tmp_path, PLAN, runner=rec)
    assert [r["status"] for r in again["stages"][1:]] == ["ran"] * 5
    assert rec.stages(5) == ["data", "vocab", "capture", "train", "bench"]
    marker = json.loads(next((tmp_path / ".done").glob("data-*.json")).read_text())
    assert "eyas_code" in marker  # says which code made the stage
    assert marker["command"][:3] == ["eyas", "data", "prepare"] and marker["config"]["regenerate"] is True


def test_code_fingerprint_follows_the_files(tmp_path):
    """The fingerprint reads the package's files: a copy hashes the same, an edited module changes it."""
    import shutil

    pkg = tmp_path / "eyas"
    shutil.copytree(pathlib.Path(qs.__file__).resolve().parent.parent, pkg)
    before = qs.files_hash(pkg)
    assert before == qs.code_fingerprint()  # compiled-Python caches in the copy do not count
    (pkg / "stages" / "trainer.py").write_text((pkg / "stages" / "trainer.py").read_text() + "\n# edited\n")
    assert qs.files_hash(pkg) != before


def test_failed_stage_is_an_error_and_not_marked_done(tiny_target, tmp_path):
    with pytest.raises(EyasError, match="stage capture failed"):
        qs.run_pipeline(str(tiny_target), tmp_path, PLAN, runner=Recorder(fail="capture"))
    rec = Recorder()
    res = qs.run_pipeline(str(tiny_target), tmp_path, PLAN, runner=rec)
    assert rec.stages() == ["capture", "train", "bench"]
    assert [r["status"] for r in res["stages"][1:3]] == ["reused", "reused"]


def test_a_stage_returning_a_nonzero_code_is_a_failure(monkeypatch):
    from dataclasses import replace

    monkeypatch.setitem(qs.CALLS, "data", replace(qs.CALLS["data"], run=lambda cfg: 1))
    with pytest.raises(EyasError, match="exit code 1"):
        qs.run_stage("data", None, quiet=True)


def test_stage_configs_are_what_their_printed_commands_parse_to(tiny_target, tmp_path):
    """Each stage's config, written as the command line the quickstart logs and records, parses
    with the real CLI back to the same config: the printed command reruns the stage exactly."""
    from eyas.cli import build_parser

    parser = build_parser()
    rec = Recorder()
    qs.run_pipeline(str(tiny_target), tmp_path, qs.Plan(**{**PLAN.__dict__, "deadline": 20.0}), runner=rec)
    assert rec.config("train").time_budget is not None  # the timed flag too
    for stage, cfg in rec.calls:
        argv = to_argv(qs.CALLS[stage].words, cfg)
        assert from_namespace(type(cfg), parser.parse_args(argv)) == cfg, stage
    marker = json.loads(next((tmp_path / ".done").glob("train-*.json")).read_text())
    assert marker["command"] == ["eyas", *to_argv(("train",), rec.config("train"))]


class TimedRecorder(Recorder):
    """A runner on a fake clock (quickstart's `time`): each stage takes `minutes[stage]`."""

    def __init__(self, minutes: dict):
        super().__init__()
        self.minutes, self.t = minutes, 0.0

    def perf_counter(self) -> float:
        return self.t

    def __call__(self, stage, cfg, quiet):
        self.t += 60 * self.minutes.get(stage, 0.0)
        return super().__call__(stage, cfg, quiet)


def test_deadline_gives_train_the_minutes_left(tiny_target, tmp_path, monkeypatch):
    """With a deadline on a CPU the train stage's --time-budget is the deadline less the minutes
    elapsed, its own overhead and the bench's planned minutes, however fast the stages before it
    ran; that number depends on the hour, the stage's hash does not (a rerun reuses the trained stage)."""
    # bf16: no fp32-on-a-CPU factors on the planned minutes; data + capture planned 6 min, bench 1
    plan = qs.Plan(**{**PLAN.__dict__, "minutes": (0, 4, 0, 2, 8, 1), "deadline": 20.0, "dtype": "bf16"})
    budgets, train_dirs = [], []
    runs = (("slow", 6.0, 3.0), ("fast", 2.0, 1.0), ("slower", 8.0, 4.6), ("late", 15.0, 4.0))
    for name, data_min, capture_min in runs:
        rec = TimedRecorder({"data": data_min, "capture": capture_min})
        monkeypatch.setattr(qs, "time", rec)
        result = qs.run_pipeline(str(tiny_target), tmp_path / name, plan, runner=rec)
        budgets.append(rec.config("train").time_budget)
        train_dirs.append(pathlib.Path(result["stages"][4]["dir"]).name)
        again = qs.run_pipeline(str(tiny_target), tmp_path / name, plan, runner=rec)
        assert [r["status"] for r in again["stages"][1:]] == ["reused"] * 5
    over = qs.TRAIN_STAGE_OVERHEAD
    # the bench keeps its planned minute whatever the pace before; the late run gets the 2-minute floor
    assert budgets == pytest.approx([20 - 9 - over - 1, 20 - 3 - over - 1, 20 - 12.6 - over - 1, 2.0], abs=0.01)
    # the train stage made again in the same work directory, its inputs reused: another budget, the
    # same stage directory
    for marker in (tmp_path / "slow" / ".done").glob("*.json"):
        if marker.name.startswith(("train-", "bench-")):
            marker.unlink()
    rec = TimedRecorder({})
    monkeypatch.setattr(qs, "time", rec)
    result = qs.run_pipeline(str(tiny_target), tmp_path / "slow", plan, runner=rec)
    assert rec.stages() == ["train", "bench"]
    assert rec.config("train").time_budget == pytest.approx(20 - over - 1)
    assert pathlib.Path(result["stages"][4]["dir"]).name == train_dirs[0]
    rec = Recorder()  # no deadline: every planned step, no flag
    qs.run_pipeline(str(tiny_target), tmp_path / "plain", PLAN, runner=rec)
    assert rec.config("train").time_budget is None


def test_plan_inputs_become_the_data_stage_inputs(tiny_target, tmp_path):
    for budget, inputs in (("medium", ["builtin-public", "builtin"]), ("small", ["builtin"])):
        rec = Recorder()
        plan = qs.Plan(**{**PLAN.__dict__, "inputs": qs.PLANS[budget].inputs})
        qs.run_pipeline(str(tiny_target), tmp_path / budget, plan, runner=rec)
        data = rec.config("data")
        assert data.input == inputs and data.regenerate


def test_auto_dtype_resolves_into_every_stage_config(tiny_target, tmp_path, monkeypatch, caplog):
    """The plan's `auto` becomes the machine's concrete dtype in each config (hence in the stage hashes),
    and the printed ETA uses the per-stage fp32 factors."""
    import logging

    from eyas import targets

    monkeypatch.setattr(targets, "fast_dtype", lambda device="cpu": "fp32")
    monkeypatch.setattr(targets, "decode_dtype", lambda device="cpu": "fp32")
    rec = Recorder()
    minutes = (0.0, 10.0, 0.0, 10.0, 10.0, 10.0)
    with caplog.at_level(logging.INFO, logger="eyas.stages.quickstart"):
        qs.run_pipeline(str(tiny_target), tmp_path, qs.Plan(**{**PLAN.__dict__, "dtype": "auto", "minutes": minutes,
                                                                   "tree": "6,6,24"}),
                        runner=rec)
    with_dtype = [cfg for _, cfg in rec.calls if hasattr(cfg, "dtype")]
    assert len(with_dtype) == 4 and all(cfg.dtype == "fp32" for cfg in with_dtype)
    assert all(cfg.device == "cpu" for cfg in with_dtype)  # every stage on the one device
    assert rec.config("bench").tree == qs.FP32_CPU_TREE  # fp32 on a CPU: the narrower tree
    eta = sum(m * f for m, f in zip(minutes[1:], qs.FP32_CPU_SLOWDOWN))
    assert f"about {eta:.0f} min left" in caplog.text and eta > sum(minutes)


def test_bench_decodes_in_the_decoding_dtype(tiny_target, tmp_path, monkeypatch):
    """Where training runs in bf16 but decoding is faster in fp32 (a CPU with AVX512-BF16 and no
    AMX), the data, capture and train stages get bf16 and the bench fp32, with fp32's draft
    cutoff and tree."""
    from eyas import targets

    monkeypatch.setattr(targets, "fast_dtype", lambda device="cpu": "bf16")
    monkeypatch.setattr(targets, "decode_dtype", lambda device="cpu": "fp32")
    rec = Recorder()
    qs.run_pipeline(str(tiny_target), tmp_path, qs.Plan(**{**PLAN.__dict__, "dtype": "auto", "tree": "6,6,24"}),
                    runner=rec)
    dtypes = {stage: cfg.dtype for stage, cfg in rec.calls if hasattr(cfg, "dtype")}
    assert dtypes == {"data": "bf16", "capture": "bf16", "train": "bf16", "bench": "fp32"}
    bench = rec.config("bench")
    assert bench.draft_cutoff == CPU_CUTOFF and bench.tree == qs.FP32_CPU_TREE


def test_fp32_cpus_run_the_plan_sized_for_them(tiny_target, tmp_path, monkeypatch, caplog):
    """Where the stages run in fp32 on a CPU, a plan with an `fp32_cpu` variant runs that variant
    (its own sizes in every config, its own minutes in the ETA, the bench's fp32 draft cutoff);
    with native bf16 it runs itself (the bf16 cutoff)."""
    import logging

    from eyas import targets

    small = qs.Plan(**{**PLAN.__dict__, "prompts": 3, "draft_vocab": 16, "minutes": (0, 1, 0, 1, 1, 1)})
    plan = qs.Plan(**{**PLAN.__dict__, "dtype": "auto", "minutes": (0, 9, 0, 9, 9, 9), "fp32_cpu": small})
    for fast, prompts, vocab, cutoff in (("fp32", 3, 16, CPU_CUTOFF), ("bf16", 4, 32, CPU_BF16_CUTOFF)):
        monkeypatch.setattr(targets, "fast_dtype", lambda device="cpu", fast=fast: fast)
        monkeypatch.setattr(targets, "decode_dtype", lambda device="cpu", fast=fast: fast)
        rec = Recorder()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eyas.stages.quickstart"):
            qs.run_pipeline(str(tiny_target), tmp_path / fast, plan, runner=rec)
        data = rec.config("data")
        assert data.limit == prompts and data.dtype == fast
        assert rec.config("vocab").size == vocab
        assert rec.config("bench").draft_cutoff == cutoff
        assert ("about 3 min left" if fast == "fp32" else "about 36 min left") in caplog.text
    assert qs.PLANS["small"].fp32_cpu is qs.FP32_CPU_SMALL


def test_whole_pipeline_on_a_tiny_target_then_reused(tiny_target, tmp_path):
    """Every stage through its real stage function on a tiny target (regenerated data, vocab, capture, one
    training step, the bench); a rerun reuses all of them; a stage directory deleted by hand is
    built again (with the stages after it reused: their inputs did not change)."""
    plan = qs.Plan(**{**PLAN.__dict__, "max_len": 512})  # the built-in prompts are long in the tiny tokenizer
    first = qs.run_pipeline(str(tiny_target), tmp_path, plan, quiet=True)
    assert [r["status"] for r in first["stages"]] == ["ok", "ran", "ran", "ran", "ran", "ran"]
    dirs = {r["stage"]: pathlib.Path(r["dir"]) for r in first["stages"][1:]}
    assert (dirs["train"] / "final" / "model.safetensors").is_file()
    report = json.loads((dirs["bench"] / "report.json").read_text())
    assert {"plain", "chain", "tree"} <= set(report["summary"]["methods"])
    assert first["bench"] is not None and pathlib.Path(first["report"]).is_file()
    again = qs.run_pipeline(str(tiny_target), tmp_path, plan, quiet=True)
    assert [r["status"] for r in again["stages"][1:]] == ["reused"] * 5
    import shutil

    shutil.rmtree(dirs["vocab"])
    third = qs.run_pipeline(str(tiny_target), tmp_path, plan, quiet=True)
    assert [r["status"] for r in third["stages"][1:]] == ["reused", "ran", "reused", "reused", "reused"]
    assert (dirs["vocab"] / "vocab.safetensors").is_file()
