"""`eyas bench` on the tiny target: report files, greedy identity gate, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from eyas import targets
from eyas.cpu import prepack
from eyas.stages import bench
from eyas.core.drafter import DrafterConfig, Eagle3Drafter
from eyas.formats.checkpoint import save_checkpoint


pytestmark = pytest.mark.usefixtures("one_thread")


def make_drafter(target_dir, out, seed: int = 0):
    """A random drafter over 64 random draft ids of the tiny target."""
    model, _ = targets.load(target_dir)
    tcfg = model.config
    torch.manual_seed(seed)
    ids = torch.randperm(tcfg.vocab_size)[:64].sort().values
    d = Eagle3Drafter(DrafterConfig.from_target(tcfg, 64, targets.default_aux_layers(tcfg.num_hidden_layers)))
    d.d2t.copy_(ids - torch.arange(64))
    d.t2d.zero_()
    d.t2d[ids] = True
    save_checkpoint(out, d, {"test": True})
    return out


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    return make_drafter(tiny_target, tmp_path_factory.mktemp("ckpt") / "drafter")


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts_math.jsonl"
    rows = [{"question": "two plus three equals"}, {"question": "write a story about the cat"},
            {"question": "explain the model"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


def test_bench_writes_report(eyas_cli, tiny_target, drafter_dir, prompt_file, tmp_path):
    out = tmp_path / "rep"
    code, stdout, err = eyas_cli("bench", "--target", tiny_target, "--drafter", drafter_dir, "--prompts", prompt_file,
                                 "--max-new-tokens", "12", "--k", "3", "--tree", "2,3,6", "--limit", "2",
                                 "--out", out, "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["greedy_mismatches"] == 0
    assert set(summary["methods"]) == {"plain", "hf", "pld", "chain", "tree", "tree+lookup"}  # the defaults
    assert summary["mismatches_vs_plain"]["tree+lookup"] == 0
    assert summary["mismatches_vs_plain"]["hf"] == 0
    packable = prepack.supported(torch.float32, "cpu")  # target and drafter linears prepacked (fp32 CPU)
    assert (summary["prepacked_linears"] > 0) == packable
    assert summary["drafter_weights"] == ("fp16" if prepack.fp16_supported("cpu") else "float32")
    for m in ("chain", "tree"):
        st = summary["methods"][m]
        assert st["acceptance_length"] >= 1.0 and len(st["acceptance_by_position"]) >= 1
        # step cost in plain steps: speedup = tokens per verification step / step cost, recomputed
        # here from the raw walls and counts; the target's and drafter's parts fit inside the total
        plain, sc = summary["methods"]["plain"], st["step_cost"]
        per_step = (st["wall_s"] / st["verify_steps"]) / (plain["wall_s"] / plain["tokens"])
        assert abs(sc["total"] - per_step) < 1e-6 * per_step
        assert abs(st["speedup"] - st["tokens"] / st["verify_steps"] / sc["total"]) < 1e-2 * st["speedup"]
        assert 0 < sc["target"] and 0 < sc["drafter"] and sc["target"] + sc["drafter"] <= sc["total"] + 1e-9
    assert "step_cost" not in summary["methods"]["plain"] and "step_cost" not in summary["methods"]["pld"]
    for f in ("report.json", "report.md", "acceptance_by_position.png", "speedup.png"):
        assert (out / f).is_file(), f
    rep = json.loads((out / "report.json").read_text())
    assert len(rep["per_prompt"]) == 2 and "math" in rep["by_category"]
    gap = rep["summary"]["first_draft_gap"]  # no metrics.jsonl next to this checkpoint: no val figure
    assert set(gap) == {"chain", "tree", "tree+lookup"} and gap["chain"]["val_acc_0"] is None
    md = (out / "report.md").read_text()
    assert "First-draft acceptance" in md  # a random drafter under the fp32 cutoff may propose nothing
    assert gap["chain"]["agreement"] == (1.0 if gap["chain"]["proposed"] > 0 else None), gap
    assert "step cost (target + drafter)" in md
    assert f"{summary['prepacked_linears']} linear layers prepacked" in md
    assert summary["draft_cutoff"] == bench.CPU_CUTOFF and f"draft cutoff {bench.CPU_CUTOFF}" in md  # fp32 CPU default


def test_default_draft_cutoff_only_where_verification_costs():
    assert bench.default_cutoff(torch.device("cpu"), torch.float32) == bench.CPU_CUTOFF > 0
    assert 0 < bench.default_cutoff(torch.device("cpu"), torch.bfloat16) == bench.CPU_BF16_CUTOFF < bench.CPU_CUTOFF
    assert bench.default_cutoff(torch.device("cpu"), torch.float16) == 0.0  # not measured
    assert bench.default_cutoff(torch.device("cuda"), torch.float32) == 0.0
    assert bench.default_cutoff(torch.device("cuda"), torch.bfloat16) == 0.0
    assert bench.default_cutoff(torch.device("cpu"), torch.bfloat16, engine="vllm") == 0.0
    assert bench.default_cutoff(torch.device("cpu"), torch.float32, engine="sglang") == 0.0  # as the engine drafts


def test_bench_baselines_only_and_bad_input(eyas_cli, tiny_target, prompt_file, tmp_path):
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", prompt_file, "--baselines", "plain",
                            "--max-new-tokens", "4", "--limit", "1", "--out", tmp_path / "b")
    assert code == 0, err
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", "builtin-eval", "--out", tmp_path / "c")
    assert code == 2 and "--data" in err
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", prompt_file, "--tree", "x",
                            "--out", tmp_path / "d")
    assert code == 2 and "--tree" in err
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", prompt_file, "--draft-cutoff", "1",
                            "--out", tmp_path / "f")
    assert code == 2 and err.count("\n") == 1 and "--draft-cutoff 1.0: must lie in [0, 1)" in err
    assert not (tmp_path / "f").exists()
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", "builtin-evl", "--out", tmp_path / "e")
    assert code == 2 and err.count("\n") == 1 and "--prompts builtin-evl: unknown file type" in err
    assert "`builtin-eval`" in err and "--input" not in err
    for flag, value in (("--baselines", "plain,hf,hf"), ("--methods", "chain,tree,chain")):
        code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", prompt_file, flag, value,
                                "--out", tmp_path / "g")
        assert code == 2 and err.count("\n") == 1 and "named twice" in err, (flag, err)
        assert not (tmp_path / "g").exists()
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", prompt_file, "--engine", "vllm",
                            "--methods", "chain,tree+lookup", "--out", tmp_path / "h")
    assert code == 2 and err.count("\n") == 1 and "vllm serves the drafter without a prompt-lookup branch" in err
    assert not (tmp_path / "h").exists()


def test_bench_engine_emulation_and_sampling(eyas_cli, tiny_target, drafter_dir, prompt_file, tmp_path):
    code, stdout, err = eyas_cli("bench", "--target", tiny_target, "--drafter", drafter_dir, "--prompts", prompt_file,
                                 "--engine", "sglang", "--baselines", "plain",
                                 "--temperature", "0.8", "--top-p", "0.9", "--max-new-tokens", "8", "--limit", "1",
                                 "--no-prepack", "--out", tmp_path / "e", "--json")
    assert code == 0, err
    s = json.loads(stdout)
    assert s["engine"] == "sglang" and s["greedy_mismatches"] is None and s["prepacked_linears"] == 0
    assert s["draft_cutoff"] == 0.0 and set(s["methods"]) == {"plain", "chain", "tree"}  # what the engine serves
    assert s["methods"]["chain"]["tokens"] > 0 and s["methods"]["tree"]["tokens"] > 0


def test_bench_engine_with_a_drafter_of_another_target_exits_2(eyas_cli, tiny_target, tiny_tokenizer, prompt_file,
                                                                tmp_path):
    import tiny

    other = tiny.build_target(tmp_path / "t32", hidden=32, tokenizer=tiny_tokenizer)
    ckpt = make_drafter(other, tmp_path / "d32")
    for engine in ("eyas", "sglang", "vllm"):
        code, _, err = eyas_cli("bench", "--target", tiny_target, "--drafter", ckpt, "--prompts", prompt_file,
                                "--engine", engine, "--baselines", "plain", "--max-new-tokens", "4", "--limit", "1",
                                "--out", tmp_path / engine)
        assert code == 2 and err.count("\n") == 1, (engine, err)
        assert "target_hidden_size" in err and "pass the drafter trained for this target" in err, (engine, err)


def test_bench_runs_several_drafters_side_by_side(eyas_cli, tiny_target, drafter_dir, prompt_file, tmp_path):
    from tiny import train_tiny_drafter

    other = tmp_path / "run2" / "final"  # a trained drafter beside a random one: they must not mix
    save_checkpoint(other, train_tiny_drafter(tiny_target)[0], {"test": True})
    flags = ("--max-new-tokens", "10", "--k", "3", "--tree", "2,3,6", "--limit", "2", "--baselines", "plain", "--json")
    code, stdout, err = eyas_cli("bench", "--target", tiny_target, "--drafter", drafter_dir, other,
                                 "--prompts", prompt_file, "--out", tmp_path / "both", *flags)
    assert code == 0, err
    both = json.loads(stdout)
    runs = [f"{m}@{n}" for n in ("drafter", "run2") for m in ("chain", "tree", "tree+lookup")]
    assert list(both["methods"]) == ["plain", *runs]
    assert both["drafters"] == {"drafter": str(drafter_dir), "run2": str(other)} and both["greedy_mismatches"] == 0
    assert set(both["first_draft_gap"]) == set(runs)
    md = (tmp_path / "both" / "report.md").read_text()
    assert f"run2 = `{other}`" in md and "| tree@run2 |" in md
    for name, path in both["drafters"].items():  # each pair runs exactly as that drafter alone (fp32: same steps)
        code, stdout, err = eyas_cli("bench", "--target", tiny_target, "--drafter", path, "--prompts", prompt_file,
                                     "--out", tmp_path / f"alone_{name}", *flags)
        assert code == 0, err
        alone = json.loads(stdout)
        for m in ("chain", "tree", "tree+lookup"):
            assert alone["methods"][m]["acceptance_by_position"] == both["methods"][f"{m}@{name}"]["acceptance_by_position"]
            assert alone["methods"][m]["verify_steps"] == both["methods"][f"{m}@{name}"]["verify_steps"]
    assert both["methods"]["tree@drafter"]["acceptance_by_position"] != both["methods"]["tree@run2"]["acceptance_by_position"]


def test_drafter_names_are_short_and_unique(tmp_path):
    names = bench.drafter_names
    assert names([str(tmp_path / "runA" / "final"), str(tmp_path / "runB" / "final")]) == ["runA", "runB"]
    assert names([str(tmp_path / "r" / "final"), str(tmp_path / "r" / "best")]) == ["r", "r/best"]
    x, y, z = tmp_path / "x" / "a", tmp_path / "y" / "a", tmp_path / "z" / "a-1"
    assert names([str(x), str(y), str(z)]) == ["x/a", "y/a", "a-1"]
    with pytest.raises(bench.EyasError, match="same checkpoint"):
        names([str(x), str(tmp_path / "x" / ".." / "x" / "a")])


def test_bench_repeats_end_to_end(eyas_cli, tiny_target, drafter_dir, prompt_file, tmp_path):
    out = tmp_path / "rep"
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--drafter", drafter_dir, "--prompts", prompt_file,
                            "--max-new-tokens", "6", "--limit", "1", "--baselines", "plain", "--methods", "chain",
                            "--repeats", "2", "--out", out)
    assert code == 0, err
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["repeats"] == 2 and rep["summary"]["greedy_mismatches"] == 0
    for m in ("plain", "chain"):
        row = rep["per_prompt"][0][m]
        assert len(row["wall_s_runs"]) == 2 and row["wall_s"] == min(row["wall_s_runs"])  # lower middle of two
    assert "times per prompt" in (out / "report.md").read_text()


def test_limit_spreads_over_categories_in_file_order():
    from eyas.stages.bench import spread

    items = [(f"c{i}", "code", "x") for i in range(5)] + [("m0", "math", "x"), ("m1", "math", "x"), ("w0", "writing", "x")]
    assert [i for i, _, _ in spread(items, 5)] == ["c0", "m0", "w0", "c1", "m1"]
    assert spread(items, None) == items and spread(items, 50) == items


def test_repeats_keep_the_median_run_and_rotate_the_order(monkeypatch):
    from eyas import runtime

    walls = iter([9.0, 9.0,  # warm-up, one per method
                  5.0, 1.0, 3.0, 2.0, 100.0, 4.0,  # prompt 0: repeat 0 plain, chain; 1 chain, plain; 2 plain, chain
                  1.0, 1.0, 1.0, 1.0, 1.0, 1.0,  # prompt 1
                  1.0, 1.0])  # the repeats-1 call: warm-up, one run
    calls = []

    def fake(method, model, tr, dr, prompt, s, device):
        calls.append(method)
        return {"tokens": [1, 2], "wall_s": next(walls), "target_s": 0.0, "drafter_s": 0.0, "accepted": [1]}

    monkeypatch.setattr(bench, "run_one", fake)
    prompts = [{"ids": torch.tensor([1])}, {"ids": torch.tensor([2])}]
    res = bench.bench_loop(["plain", "chain"], None, {"plain": (None, None), "chain": (None, None)}, prompts, runtime.DecodeSettings(), "cpu", repeats=3)
    assert calls[2:8] == ["plain", "chain", "chain", "plain", "plain", "chain"]
    assert res["plain"][0]["wall_s"] == 5.0 and res["plain"][0]["wall_s_runs"] == [5.0, 2.0, 100.0]
    assert res["chain"][0]["wall_s"] == 3.0 and res["chain"][0]["wall_s_runs"] == [1.0, 3.0, 4.0]
    assert len(res["plain"]) == len(res["chain"]) == 2
    one = bench.bench_loop(["plain"], None, {"plain": (None, None)}, prompts[:1], runtime.DecodeSettings(), "cpu")
    assert "wall_s_runs" not in one["plain"][0]  # repeats 1: every run kept as it was


@pytest.mark.parametrize("flags,needle", [
    (("--k", "0"), "--k 0"), (("--max-new-tokens", "-4"), "--max-new-tokens -4"), (("--threads", "-2"), "--threads"),
    (("--limit", "0"), "--limit 0"), (("--temperature", "nan"), "--temperature nan"),
    (("--temperature", "-1"), "--temperature"), (("--temperature", "0.7", "--top-p", "0"), "--top-p"),
    (("--top-p", "2"), "--top-p"), (("--max-new-tokens", "100000"), "positions"), (("--repeats", "0"), "--repeats 0"),
])
def test_bench_refuses_numbers_it_cannot_run(eyas_cli, tiny_target, prompt_file, tmp_path, flags, needle):
    code, _, err = eyas_cli("bench", "--target", tiny_target, "--prompts", prompt_file, "--baselines", "plain",
                            *flags, "--out", tmp_path / "o")
    assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_bench_names_a_drafter_of_another_target(eyas_cli, tiny_targets, drafter_dir, prompt_file, tmp_path):
    """A drafter for a 259-id target against a 300-id one: one line naming both sizes, no traceback."""
    import tiny

    other = tiny.build_target(tmp_path / "t300", tokenizer=tiny.build_tokenizer(300))
    code, _, err = eyas_cli("bench", "--target", other, "--drafter", drafter_dir, "--prompts", prompt_file,
                            "--out", tmp_path / "o")
    assert code == 2 and err.count("\n") == 1 and "vocab_size" in err and "Traceback" not in err, err
    code, _, err = eyas_cli("bench", "--target", tiny_targets["llama"], "--drafter", drafter_dir / "model.safetensors",
                            "--prompts", prompt_file, "--out", tmp_path / "o")
    assert code == 2 and "not a checkpoint directory" in err, err


def test_method_stats_and_step_cost_from_known_steps():
    """Acceptance length = mean of (accepted + 1) over verification steps, pooled over prompts;
    position i = share of steps that accepted more than i drafts; step cost in plain-step units."""
    method_stats, step_cost = bench.method_stats, bench.step_cost
    rs = [{"tokens": list(range(9)), "wall_s": 3.0, "target_s": 2.0, "drafter_s": 0.5, "accepted": [4, 0, 2]},
          {"tokens": list(range(3)), "wall_s": 1.0, "target_s": 0.5, "drafter_s": 0.25, "accepted": [1]}]
    st = method_stats(rs)
    assert st["verify_steps"] == 4 and st["acceptance_length"] == (5 + 1 + 3 + 2) / 4
    assert st["acceptance_by_position"] == [3 / 4, 2 / 4, 1 / 4, 1 / 4]
    assert st["tokens_per_s"] == 12 / 4.0
    assert st["time_split"] == {"target": 2.5 / 4, "drafter": 0.75 / 4, "overhead": 0.75 / 4}
    plain = method_stats([{"tokens": list(range(10)), "wall_s": 2.0, "target_s": 2.0, "drafter_s": 0.0,
                           "accepted": []}])
    assert "acceptance_length" not in plain
    step_cost(st, plain)  # one step: 4.0 s / 4 steps = 1.0 s; one plain token: 0.2 s
    assert st["step_cost"]["total"] == pytest.approx(5.0)
    assert st["step_cost"]["target"] == pytest.approx(5.0 * 2.5 / 4)


def test_every_command_takes_a_training_run_for_its_drafter(eyas_cli, tiny_target, drafter_dir, prompt_file,
                                                            tmp_path):
    """A run directory stands for its best/ (else final/) in bench, export and vocab remap alike
    (formats.checkpoint.resolve_drafter); a directory with neither is one clear error."""
    import shutil

    from eyas.formats.checkpoint import resolve_drafter

    run = tmp_path / "run"
    shutil.copytree(drafter_dir, run / "final")
    assert resolve_drafter(run) == (run / "final", "final/ of the run")
    shutil.copytree(drafter_dir, run / "best")
    assert resolve_drafter(run) == (run / "best", "best/ of the run")
    assert resolve_drafter(run / "final")[0] == run / "final"
    code, out, err = eyas_cli("bench", "--target", tiny_target, "--drafter", run, "--prompts", prompt_file,
                              "--max-new-tokens", "4", "--k", "2", "--limit", "1", "--methods", "chain",
                              "--baselines", "plain", "--out", tmp_path / "rep", "--json")
    assert code == 0, err
    assert json.loads(out)["drafter"] == str(run / "best")
    code, _, err = eyas_cli("export", run, "--to", "sglang", "--target", tiny_target, "--out", tmp_path / "sg")
    assert code == 0, err
    (tmp_path / "empty").mkdir()
    for argv in (("bench", "--target", tiny_target, "--drafter", tmp_path / "empty", "--prompts", prompt_file,
                  "--out", tmp_path / "rep2"),
                 ("export", tmp_path / "empty", "--to", "vllm", "--out", tmp_path / "x")):
        code, _, err = eyas_cli(*argv)
        assert code == 2 and "no drafter checkpoint here or in best/ or final/" in err, err
