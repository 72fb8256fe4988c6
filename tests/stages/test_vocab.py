"""Draft vocabulary: core invariants, file round trips, compare, remap, bad inputs (exit 2)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.core import vocab as core
from eyas.errors import EyasError
from eyas.formats import vocab as fvocab
from test_capture import make_prepared


def test_build_invariants_ties_and_padding():
    counts = torch.tensor([0, 5, 3, 5, 0, 1, 3, 0, 9, 0])
    d2t, t2d = core.build_from_counts(counts, 4)
    ids = core.target_ids(d2t)
    assert ids.tolist() == [1, 2, 3, 8]  # 8 (9), 1 and 3 (5 each), then 2 and 6 tie at 3: lower id 2
    assert torch.equal(torch.nonzero(t2d).flatten(), ids)
    core.check_maps(d2t, t2d, 10)


def test_tie_break_by_lower_id_and_padding_with_lowest_unused():
    counts = torch.tensor([0, 5, 3, 5, 0, 1, 3, 0, 9, 0])
    assert core.select_ids(counts, 4).tolist() == [1, 2, 3, 8]  # 2 and 6 tie at 3: keep 2
    assert core.select_ids(counts, 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 8]  # 6 used ids, padded with 0 and 4
    pad = core.select_ids(torch.tensor([0, 0, 7, 0, 0]), 3)
    assert pad.tolist() == [0, 1, 2]


def test_build_deterministic_and_vectorised_fast():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (2_000_000,), generator=g)
    mask = torch.randint(0, 2, (2_000_000,), generator=g)
    c1 = core.count_tokens(ids, mask, 49152)
    a = core.build_from_counts(c1, 32000)
    b = core.build_from_counts(core.count_tokens(ids, mask, 49152), 32000)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert int(c1.sum()) == int(mask.sum())
    core.check_maps(*a)


def test_size_errors():
    with pytest.raises(EyasError):
        core.build_from_counts(torch.ones(10, dtype=torch.long), 11)
    with pytest.raises(EyasError):
        core.count_tokens(torch.tensor([3, 12]), torch.tensor([1, 1]), 10)


@pytest.mark.parametrize("case,needle", [
    ("absolute", "absolute"), ("absolute_in_range", "absolute"), ("duplicate", "same target id"),
    ("range", "outside"), ("t2d", "inconsistent"), ("size", "target vocabulary has"),
])
def test_check_maps_rejects(case, needle):
    ids = torch.tensor([2, 5, 7, 9])
    d2t, t2d = core.d2t_from_ids(ids), core.t2d_from_ids(ids, 12)
    size = None
    if case == "absolute":
        d2t = ids.clone()  # arange + ids runs past V=12
    elif case == "absolute_in_range":
        ids = torch.tensor([0, 1, 2])
        d2t, t2d = ids.clone(), core.t2d_from_ids(ids, 12)
    elif case == "duplicate":
        d2t = torch.tensor([2, 4, 3, 6])  # targets 2, 5, 5, 9
    elif case == "range":
        d2t = torch.tensor([2, 4, 5, 20])
    elif case == "t2d":
        t2d[3] = True
    elif case == "size":
        size = 13
    with pytest.raises(EyasError, match=needle):
        core.check_maps(d2t, t2d, size)


def test_ascending_order_only_for_a_map_in_another_order():
    ids = torch.tensor([2, 5, 7, 9])
    t2d = core.t2d_from_ids(ids, 12)
    order = torch.tensor([2, 0, 3, 1])
    shuffled = ids[order]  # held as 7, 2, 9, 5
    p = core.ascending_order(shuffled - torch.arange(4), t2d)
    assert torch.equal(shuffled[p], ids)
    W = torch.randn(4, 3)  # row j belongs to target id shuffled[j]: after sorting, to ids[j]
    d2t, rows, moved = core.sort_map(shuffled - torch.arange(4), t2d, W)
    assert moved and torch.equal(d2t, core.d2t_from_ids(ids)) and torch.equal(rows, W[torch.argsort(shuffled)])
    core.check_maps(d2t, t2d)
    assert core.ascending_order(core.d2t_from_ids(ids), t2d) is None  # sorted already
    assert core.ascending_order(ids.clone(), t2d) is None  # absolute ids: check_maps names that fault
    assert core.ascending_order(torch.tensor([2, 4, 3, 6]), t2d) is None  # a duplicate target
    assert core.ascending_order(torch.tensor([9, 4, 5, 6]), t2d) is None  # targets 9, 5, 7, 9
    assert core.ascending_order(torch.tensor([20, 0, 1, 2]), t2d) is None  # target 20 outside 0..11
    assert core.ascending_order(torch.tensor([7.0, -2.0, 7.0, 2.0]), t2d) is None  # float offsets
    # absolute ids in another order: their targets 7, 3, 11, 8 are distinct and in range, but t2d marks
    # d2t's own values, so the map is not sorted and check_maps says what it is
    absolute = torch.tensor([7, 2, 9, 5])
    big = core.t2d_from_ids(ids, 20)
    assert core.ascending_order(absolute, big) is None
    with pytest.raises(EyasError, match="absolute"):
        core.check_maps(absolute, big)


def test_compare_known_answers_and_permutation():
    a = torch.tensor([1, 2, 3, 4])
    r = core.compare_maps(a, torch.tensor([1, 2, 5, 6]))
    assert (r["same_position"], r["overlap"], r["b_served_by_a"]) == (2, 2, 0.5)
    perm = core.compare_maps(a, torch.tensor([2, 1, 4, 3]))  # same set, other order
    assert perm["same_position"] == 0 and perm["overlap"] == 4 and perm["b_served_by_a"] == 1.0
    assert perm["permutation"] and not perm["identical"]
    assert core.compare_maps(a, a)["identical"]
    counts = torch.tensor([0, 1, 1, 1, 1, 6, 0])
    c = core.compare_maps(a, torch.tensor([1, 5]), counts)
    assert c["coverage_a"] == pytest.approx(0.4) and c["coverage_b"] == pytest.approx(0.7)


def test_remap_rows_preserves_shared_rows_and_logits():
    torch.manual_seed(0)
    old_ids, new_ids = torch.tensor([1, 3, 5, 7]), torch.tensor([0, 3, 4, 7, 9])
    w = torch.randn(4, 8)
    fb = torch.randn(5, 8)
    nw, n = core.remap_rows(w, old_ids, new_ids, fb)
    assert n == 2
    h = torch.randn(3, 8)
    old_logits, new_logits = h @ w.T, h @ nw.T
    assert torch.equal(new_logits[:, 1], old_logits[:, 1]) and torch.equal(new_logits[:, 3], old_logits[:, 3])
    assert torch.equal(nw[0], fb[0]) and torch.equal(nw[4], fb[4])
    z, _ = core.remap_rows(w, old_ids, new_ids, None)
    assert torch.count_nonzero(z[0]) == 0


def test_vocab_file_round_trip(tmp_path):
    ids = torch.tensor([0, 4, 6])
    vm = fvocab.VocabMap(core.d2t_from_ids(ids), core.t2d_from_ids(ids, 10), {"coverage": 0.5, "tokenizer_fingerprint": "ab"})
    fvocab.save_vocab(tmp_path / "v.safetensors", vm)
    back = fvocab.load_vocab(tmp_path / "v.safetensors", target_size=10)
    assert torch.equal(back.d2t, vm.d2t) and torch.equal(back.t2d, vm.t2d)
    assert back.target_ids.tolist() == [0, 4, 6] and back.draft_size == 3 and back.target_size == 10
    assert back.meta["coverage"] == 0.5 and back.meta["format"] == "eyas.vocab" and back.meta["target_vocab_size"] == 10
    with pytest.raises(EyasError, match="target vocabulary has"):
        fvocab.load_vocab(tmp_path / "v.safetensors", target_size=11)


def _bad_file(path, kind):
    ids = torch.tensor([2, 5, 7])
    d2t, t2d = core.d2t_from_ids(ids), core.t2d_from_ids(ids, 12)
    if kind == "absolute":
        d2t = ids.clone()
    elif kind == "t2d":
        t2d[0] = True
    save_file({"d2t": d2t, "t2d": t2d}, str(path))


@pytest.mark.parametrize("kind", ["absolute", "t2d"])
def test_load_vocab_names_file(tmp_path, kind):
    f = tmp_path / f"{kind}.safetensors"
    _bad_file(f, kind)
    with pytest.raises(EyasError, match=str(f)):
        fvocab.load_vocab(f)


def _fake_ckpt(d, ids, V, H, seed=0):
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    sd = {"d2t": core.d2t_from_ids(ids), "t2d": core.t2d_from_ids(ids, V),
          "lm_head.weight": torch.randn(len(ids), H, generator=g), "midlayer.mlp.up_proj.weight": torch.randn(4, H, generator=g)}
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"draft_vocab_size": len(ids), "hidden_size": H}))
    return d


# ---------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target, tiny_tokenizer):
    return make_prepared(tmp_path_factory.mktemp("vdata"), tiny_tokenizer, tiny_target, 12, 3)


def test_cli_build_compare(eyas_cli, tmp_path, prepared, tiny_target):
    code, out, err = eyas_cli("vocab", "build", "--data", prepared, "--size", 40, "--out", tmp_path / "a.safetensors",
                              "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["draft_size"] == 40 and 0 < s["coverage"] <= 1
    vm = fvocab.load_vocab(tmp_path / "a.safetensors")
    assert vm.meta["supervised_tokens"] == s["supervised_tokens"] and vm.meta["tokenizer_fingerprint"]
    code, out, err = eyas_cli("vocab", "build", "--data", prepared, "--size", 40, "--out", tmp_path / "b.safetensors")
    assert code == 0
    a, b = fvocab.load_vocab(tmp_path / "a.safetensors"), fvocab.load_vocab(tmp_path / "b.safetensors")
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d) and a.meta == b.meta
    eyas_cli("vocab", "build", "--data", prepared, "--size", 20, "--out", tmp_path / "c.safetensors")
    code, out, err = eyas_cli("vocab", "compare", tmp_path / "a.safetensors", tmp_path / "c.safetensors",
                              "--data", prepared, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["overlap"] == 20 and r["b_served_by_a"] == 1.0 and r["coverage_a"] >= r["coverage_b"]
    code, out, _ = eyas_cli("vocab", "compare", tmp_path / "a.safetensors", tmp_path / "c.safetensors")
    assert code == 0 and "permutation" in out


def test_cli_build_default_size_and_errors(eyas_cli, tmp_path, prepared, tiny_target):
    V = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    code, out, err = eyas_cli("vocab", "build", "--data", prepared, "--out", tmp_path / "d.safetensors", "--json")
    assert code == 0 and json.loads(out)["draft_size"] == min(32000, V)
    code, _, err = eyas_cli("vocab", "build", "--data", prepared, "--size", V + 1, "--out", tmp_path / "e.safetensors")
    assert code == 2 and "--size" in err
    code, _, err = eyas_cli("vocab", "build", "--data", tmp_path / "nope", "--out", tmp_path / "f.safetensors")
    assert code == 2 and "manifest.json" in err
    bad = tmp_path / "bad.safetensors"
    _bad_file(bad, "absolute")
    code, _, err = eyas_cli("vocab", "compare", bad, tmp_path / "d.safetensors")
    assert code == 2 and "absolute" in err and str(bad) in err
    # --force replaces an earlier vocabulary (d), never another file: not a data file of --data
    # (it replaced train.jsonl before) nor a symbolic link
    code, _, err = eyas_cli("vocab", "build", "--data", prepared, "--out", tmp_path / "d.safetensors", "--force")
    assert code == 0, err
    data_file = shutil.copytree(prepared, tmp_path / "data") / "train.jsonl"
    before = data_file.read_bytes()
    code, _, err = eyas_cli("vocab", "build", "--data", data_file.parent, "--out", data_file, "--force")
    assert code == 2 and "not a vocabulary file" in err and data_file.read_bytes() == before
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "d.safetensors")
    code, _, err = eyas_cli("vocab", "build", "--data", prepared, "--out", tmp_path / "link.safetensors", "--force")
    assert code == 2 and "symbolic link" in err and (tmp_path / "link.safetensors").is_symlink()


def test_cli_remap_carries_rows(eyas_cli, tmp_path, prepared, tiny_target):
    V = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    H = json.loads((tiny_target / "config.json").read_text())["hidden_size"]
    old_ids = torch.arange(0, 60, 2)
    src = _fake_ckpt(tmp_path / "ckpt", old_ids, V, H)
    new_ids = torch.arange(0, 45, 3)  # shares 0, 6, 12, ... with old
    fvocab.save_vocab(tmp_path / "new.safetensors",
                      fvocab.VocabMap(core.d2t_from_ids(new_ids), core.t2d_from_ids(new_ids, V)))
    code, out, err = eyas_cli("vocab", "remap", "--drafter", src, "--to", tmp_path / "new.safetensors",
                              "--target", tiny_target, "--out", tmp_path / "ckpt2", "--json")
    assert code == 0, err
    s = json.loads(out)
    shared = sorted(set(old_ids.tolist()) & set(new_ids.tolist()))
    assert s["carried"] == len(shared) and s["new_rows_from"] == "target lm_head"
    old, new = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "ckpt2" / "model.safetensors"))
    h = torch.randn(5, H)
    for t in shared:  # logits of shared tokens are exactly preserved
        i, j = old_ids.tolist().index(t), new_ids.tolist().index(t)
        a, b = old["lm_head.weight"][i].clone(), new["lm_head.weight"][j].clone()
        assert torch.equal(a, b) and torch.equal(h @ a, h @ b)
    assert torch.equal(new["midlayer.mlp.up_proj.weight"], old["midlayer.mlp.up_proj.weight"])
    assert json.loads((tmp_path / "ckpt2" / "config.json").read_text())["draft_vocab_size"] == len(new_ids)
    got = fvocab.read_checkpoint_vocab(tmp_path / "ckpt2")
    assert torch.equal(core.target_ids(got["d2t"]), new_ids)
    code, out, _ = eyas_cli("vocab", "compare", src, tmp_path / "ckpt2", "--json")
    assert code == 0 and json.loads(out)["overlap"] == len(shared)


def test_cli_remap_bad_inputs(eyas_cli, tmp_path, tiny_target):
    V = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    src = _fake_ckpt(tmp_path / "ckpt", torch.arange(10), V + 5, 16)
    ids = torch.arange(5)
    fvocab.save_vocab(tmp_path / "n.safetensors", fvocab.VocabMap(core.d2t_from_ids(ids), core.t2d_from_ids(ids, V)))
    code, _, err = eyas_cli("vocab", "remap", "--drafter", src, "--to", tmp_path / "n.safetensors",
                            "--target", tiny_target, "--out", tmp_path / "o")
    assert code == 2 and "target ids" in err
    code, _, err = eyas_cli("vocab", "remap", "--drafter", tmp_path / "none", "--to", tmp_path / "n.safetensors",
                            "--target", tiny_target, "--out", tmp_path / "o")
    assert code == 2 and "no such directory" in err  # formats.checkpoint.resolve_drafter, as every command
    # a vocabulary of the right size built on another tokenizer's data (train refuses it too)
    ok = _fake_ckpt(tmp_path / "ok", torch.arange(10), V, 16)
    fvocab.save_vocab(tmp_path / "tok.safetensors", fvocab.VocabMap(core.d2t_from_ids(ids), core.t2d_from_ids(ids, V),
                                                                    {"tokenizer_fingerprint": "0123456789abcdef"}))
    code, _, err = eyas_cli("vocab", "remap", "--drafter", ok, "--to", tmp_path / "tok.safetensors",
                            "--target", tiny_target, "--out", tmp_path / "o")
    assert code == 2 and "another tokenizer" in err and not (tmp_path / "o").exists()


def test_cli_build_from_several_data_dirs_adds_counts(eyas_cli, tmp_path, prepared):
    code, out, err = eyas_cli("vocab", "build", "--data", prepared, "--size", 40, "--out", tmp_path / "one", "--json")
    assert code == 0, err
    one = json.loads(out)
    code, out, err = eyas_cli("vocab", "build", "--data", prepared, prepared, "--size", 40, "--out", tmp_path / "two",
                              "--json")
    assert code == 0, err
    two = json.loads(out)
    assert two["supervised_tokens"] == 2 * one["supervised_tokens"]  # counts add; ranks unchanged
    a, b = fvocab.load_vocab(tmp_path / "one"), fvocab.load_vocab(tmp_path / "two")
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)


def test_compare_reads_a_speculators_drafter_without_head_or_maps(eyas_cli, tiny_target, tmp_path):
    """speculators may leave out lm_head (the verifier's is used) and, over the whole vocabulary,
    d2t/t2d: compare needs only the maps, identity in that case."""
    from transformers import AutoConfig

    from eyas.core.drafter import DrafterConfig, Eagle3Drafter
    from eyas.formats import engines
    from eyas.formats.checkpoint import save_checkpoint

    V = AutoConfig.from_pretrained(tiny_target).vocab_size
    d = Eagle3Drafter(DrafterConfig.from_target(AutoConfig.from_pretrained(tiny_target), V, [1, 2, 3]))
    d.t2d.fill_(True)
    save_checkpoint(tmp_path / "ey", d, {})
    (tmp_path / "sp").mkdir()
    engines.export_checkpoint(tmp_path / "ey", "speculators", tmp_path / "sp", target=tiny_target)
    w = load_file(tmp_path / "sp" / "model.safetensors")
    save_file({k: v for k, v in w.items() if k not in ("d2t", "t2d", "lm_head.weight")},
              str(tmp_path / "sp" / "model.safetensors"))
    ids = torch.arange(0, V, 2)
    fvocab.save_vocab(tmp_path / "half.safetensors", fvocab.VocabMap(core.d2t_from_ids(ids), core.t2d_from_ids(ids, V), {}))
    code, out, err = eyas_cli("vocab", "compare", tmp_path / "sp", tmp_path / "half.safetensors", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["size_a"] == V and s["size_b"] == ids.numel() and s["overlap"] == ids.numel(), s
    # remap: the head-less drafter scored with the verifier's rows; the remapped one carries exactly those
    code, out, err = eyas_cli("vocab", "remap", "--drafter", tmp_path / "sp", "--to", tmp_path / "half.safetensors",
                              "--target", tiny_target, "--out", tmp_path / "sp_half", "--json")
    assert code == 0, err
    assert json.loads(out)["head_added"] is True
    from eyas import targets

    head = targets.load(tiny_target)[0].lm_head.weight.detach().float()
    got = load_file(tmp_path / "sp_half" / "model.safetensors")
    assert torch.equal(got["lm_head.weight"], head[ids]) and torch.equal(core.target_ids(got["d2t"]), ids)
    h = torch.randn(3, head.shape[1])
    assert torch.equal(h @ got["lm_head.weight"].T, (h @ head.T)[:, ids])  # the same scores, restricted
    cfg, state, _ = engines.import_checkpoint(tmp_path / "sp_half", target=tiny_target)
    assert cfg.draft_vocab_size == ids.numel() and torch.equal(state["lm_head.weight"], head[ids])
