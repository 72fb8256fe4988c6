"""eyas doctor: every failure class is built from a healthy trained tiny drafter and must be
reported with its id; healthy checkpoints of every format give no errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas import targets
from eyas.core import vocab as core_vocab
from eyas.core.drafter import DrafterConfig, Eagle3Drafter
from eyas.formats.checkpoint import save_checkpoint

from tiny import AUX, N_DRAFT, train_tiny_drafter  # noqa: E402
PROMPT_FILE_LINES = ["the model token draft", "python code function return", "math two plus three equals",
                     "the cat and the dog", "explain the speculative decoding", "write a story about a river"]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def healthy(tiny_target, tmp_path_factory) -> dict:
    """{'eyas': dir, 'sglang': dir, 'vllm': dir, 'speculators': dir, 'drafter': Eagle3Drafter}."""
    from eyas.formats import engines

    root = tmp_path_factory.mktemp("doctor")
    d, _ = train_tiny_drafter(tiny_target)
    out = {"drafter": d, "root": root}
    save_checkpoint(root / "eyas", d, {"aux_layer_ids_hf": AUX})
    out["eyas"] = root / "eyas"
    for fmt in ("sglang", "vllm", "speculators", "eagle"):
        (root / fmt).mkdir()
        engines.write_layout(d.cfg, d.trainable_state_dict(), fmt, root / fmt, target=tiny_target)
        out[fmt] = root / fmt
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPT_FILE_LINES))
    out["prompts"] = prompts
    return out


def variant(healthy: dict, src: str, name: str, tensors=None, config=None, drop_meta: bool = False) -> Path:
    """Copy healthy[src] to a new dir and edit its tensors / config.json."""
    dst = healthy["root"] / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(healthy[src], dst)
    if tensors is not None:
        sd = load_file(dst / "model.safetensors")
        sd = tensors(sd) or sd
        save_file({k: v.contiguous() for k, v in sd.items()}, dst / "model.safetensors")
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        c = config(c) or c
        (dst / "config.json").write_text(json.dumps(c))
    if drop_meta:
        (dst / "eyas.json").unlink(missing_ok=True)
    return dst


def doctor(eyas_cli, *args):
    code, out, err = eyas_cli("doctor", *map(str, args), "--json")
    assert code in (0, 1), (code, err)
    rep = json.loads(out)
    return code, rep


def ids_of(rep: dict, severity: str | None = None, engine="*") -> set[str]:
    return {f["id"] for f in rep["findings"]
            if (severity is None or f["severity"] == severity) and (engine == "*" or f["engine"] == engine)}


# ---------------------------------------------------------------- healthy


@pytest.mark.parametrize("fmt", ["eyas", "sglang", "vllm", "speculators", "eagle"])
def test_healthy_formats_have_no_errors(healthy, eyas_cli, tiny_target, fmt):
    code, rep = doctor(eyas_cli, healthy[fmt], "--target", tiny_target)
    assert code == 0, [f for f in rep["findings"] if f["severity"] == "error"]
    assert rep["layout"] == fmt
    assert "EYAS-LMHEAD-UNTRAINED" not in ids_of(rep)


def test_human_output_and_exit_codes(healthy, eyas_cli, tmp_path):
    code, out, err = eyas_cli("doctor", healthy["sglang"])
    assert code == 0 and "eyas doctor:" in out and "error(s)" in out
    code, out, err = eyas_cli("doctor", tmp_path / "nope")
    assert code == 2 and "no such checkpoint" in err
    code, out, err = eyas_cli("doctor", healthy["sglang"], "--prompts", healthy["prompts"])
    assert code == 2 and "--target" in err


# ---------------------------------------------------------------- static failure classes


def test_layers0_under_sglang_is_skipped(healthy, eyas_cli):
    ck = variant(healthy, "sglang", "sg_layers0", tensors=lambda sd: {
        (k.replace("midlayer.", "layers.0.") if k.startswith("midlayer.") else k): v for k, v in sd.items()})
    code, rep = doctor(eyas_cli, ck, "--engine", "sglang")
    assert code == 1
    assert {"EYAS-KEYS-SKIPPED", "EYAS-KEYS-MISSING"} <= ids_of(rep, "error", "sglang")


def test_d2t_absolute(healthy, eyas_cli):
    def absolute(sd):
        sd["d2t"] = torch.arange(sd["d2t"].numel()) + sd["d2t"]
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "abs", tensors=absolute))
    assert code == 1 and "EYAS-D2T-ABSOLUTE" in ids_of(rep, "error")

    def absolute_shuffled(sd):  # absolute ids in another order: t2d marks d2t's own values
        absolute(sd)
        sd["d2t"] = sd["d2t"][torch.randperm(sd["d2t"].numel(), generator=torch.Generator().manual_seed(2))]
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "abs_shuffled", tensors=absolute_shuffled))
    assert code == 1 and "EYAS-D2T-ABSOLUTE" in ids_of(rep, "error") and "EYAS-D2T-UNSORTED" not in ids_of(rep)


def test_d2t_missing_and_zero(healthy, eyas_cli):
    def drop(sd):
        del sd["d2t"]
    code, rep = doctor(eyas_cli, variant(healthy, "vllm", "nod2t", tensors=drop))
    assert code == 1 and "EYAS-D2T-MISSING" in ids_of(rep, "error")

    def zero(sd):
        sd["d2t"] = torch.zeros_like(sd["d2t"])
        sd.pop("t2d", None)
    code, rep = doctor(eyas_cli, variant(healthy, "vllm", "zerod2t", tensors=zero))
    assert "EYAS-D2T-ZERO" in ids_of(rep)


def test_d2t_in_another_order_is_served_as_is(healthy, eyas_cli, tiny_target):
    """Engines only add the offsets: a map listing its ids in another order, with the head rows in
    that order, drafts the same tokens. Doctor says so (info, exit 0) and measures the same acceptance."""
    def shuffle(sd):
        n = sd["d2t"].numel()
        p = torch.randperm(n, generator=torch.Generator().manual_seed(1))
        sd["d2t"] = (torch.arange(n) + sd["d2t"])[p] - torch.arange(n)
        sd["lm_head.weight"] = sd["lm_head.weight"][p]
    args = ("--target", tiny_target, "--prompts", healthy["prompts"], "--engine", "sglang", "--num-prompts", 4,
            "--new-tokens", 16, "--steps", 3)
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "unsorted", tensors=shuffle), *args)
    assert code == 0 and "EYAS-D2T-UNSORTED" in ids_of(rep, "info"), [f for f in rep["findings"]
                                                                      if f["severity"] != "info"]
    _, base = doctor(eyas_cli, healthy["sglang"], *args)
    got, want = (r["measurements"]["dynamic"]["paths"] for r in (rep, base))
    assert want["sglang"]["accept_len"] > 1.2
    assert got["sglang"]["accept_len"] == pytest.approx(want["sglang"]["accept_len"])
    assert got["eyas reference"]["accept_len"] == pytest.approx(want["eyas reference"]["accept_len"])


def test_t2d_inconsistent(healthy, eyas_cli):
    def flip(sd):
        t = sd["t2d"].clone()
        t[int(torch.nonzero(t)[0])] = False
        t[int(torch.nonzero(~t)[-1])] = True
        sd["t2d"] = t
    code, rep = doctor(eyas_cli, variant(healthy, "speculators", "t2d", tensors=flip))
    assert code == 1 and "EYAS-T2D-MISMATCH" in ids_of(rep, "error")


def test_nonfinite_and_shape_and_config(healthy, eyas_cli):
    def nan(sd):
        sd["fc.weight"][0, 0] = float("nan")
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "nan", tensors=nan))
    assert "EYAS-NONFINITE" in ids_of(rep, "error")
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "cfg", config=lambda c: c.update(draft_vocab_size=99)))
    assert code == 1 and {"EYAS-CONFIG-MISMATCH", "EYAS-SHAPE-MISMATCH"} & ids_of(rep, "error")

    def narrow_fc(sd):
        sd["fc.weight"] = sd["fc.weight"][:, :128].clone()
    code, rep = doctor(eyas_cli, variant(healthy, "vllm", "fc2", tensors=narrow_fc))
    assert "EYAS-SHAPE-MISMATCH" in ids_of(rep, "error") or "EYAS-ENGINE-REFUSES" in ids_of(rep, "error")


def test_lm_head_untrained(healthy, eyas_cli):
    def fresh(sd):
        torch.manual_seed(3)
        sd["lm_head.weight"] = torch.nn.Linear(sd["lm_head.weight"].shape[1], sd["lm_head.weight"].shape[0],
                                               bias=False).weight.detach().clone()
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "head", tensors=fresh))
    assert code == 1 and "EYAS-LMHEAD-UNTRAINED" in ids_of(rep, "error")

    def normal(sd):
        sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"]) * 0.02
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "head2", tensors=normal))
    assert "EYAS-LMHEAD-UNTRAINED" in ids_of(rep, "error")


def test_embed_random(healthy, eyas_cli, tiny_target):
    def rand(sd):
        sd["embed_tokens.weight"] = torch.randn_like(sd["embed_tokens.weight"]) * 0.02
    ck = variant(healthy, "speculators", "emb", tensors=rand)
    code, rep = doctor(eyas_cli, ck, "--target", tiny_target)
    assert code == 1 and "EYAS-EMBED-RANDOM" in ids_of(rep, "error")


def test_aux_convention_and_off_by_one(healthy, eyas_cli, tiny_target):
    # SGLang config holding HF indices (not minus one): SGLang captures one layer later.
    ck = variant(healthy, "sglang", "aux_hf", config=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=AUX))
    code, rep = doctor(eyas_cli, ck, "--engine", "sglang")
    assert code == 1 and "EYAS-AUX-OFF-BY-ONE" in ids_of(rep, "error", "sglang")
    # The healthy export writes [0, 1, 2]: first id not 1, so SGLang versions disagree.
    code, rep = doctor(eyas_cli, healthy["sglang"], "--engine", "sglang")
    assert code == 0 and "EYAS-AUX-VERSION-DEPENDENT" in ids_of(rep, "warning", "sglang")


def test_aux_ids_missing(healthy, eyas_cli, tiny_target):
    ck = variant(healthy, "vllm", "noaux", config=lambda c: c.pop("eagle_aux_hidden_state_layer_ids") and None)
    code, rep = doctor(eyas_cli, ck, "--engine", "vllm", "--target", tiny_target)
    assert code == 1 and "EYAS-AUX-IDS-MISSING" in ids_of(rep, "error", "vllm")


def test_aux_out_of_range(healthy, eyas_cli, tiny_target):
    ck = variant(healthy, "vllm", "aux9", config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]),
                 drop_meta=True)
    code, rep = doctor(eyas_cli, ck, "--engine", "vllm", "--target", tiny_target)
    assert code == 1 and "EYAS-AUX-IDS-OUT-OF-RANGE" in ids_of(rep, "error")


def test_aux_final_norm_id_is_out_of_range(healthy, eyas_cli, tiny_target):
    """HF index L (4 here) is the final-norm output: no engine layer takes it as input."""
    ck = variant(healthy, "vllm", "aux4", config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4]),
                 drop_meta=True)
    code, rep = doctor(eyas_cli, ck, "--engine", "vllm", "--target", tiny_target)
    assert code == 1 and "EYAS-AUX-IDS-OUT-OF-RANGE" in ids_of(rep, "error")


def test_use_aux_off_is_fc_bypass(healthy, eyas_cli):
    ck = variant(healthy, "sglang", "noaux_use", config=lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    code, rep = doctor(eyas_cli, ck, "--engine", "sglang")
    assert code == 1 and "EYAS-FC-BYPASS" in ids_of(rep, "error", "sglang")


def test_arch_unsupported(healthy, eyas_cli, tiny_targets):
    code, rep = doctor(eyas_cli, healthy["sglang"], "--target", tiny_targets["gemma"])
    assert "EYAS-ARCH-UNSUPPORTED" in ids_of(rep, "warning")


def test_vocab_size_mismatch(healthy, eyas_cli, tiny_target, tmp_path):
    import tiny

    other = tiny.build_target(tmp_path / "big", hidden=32, layers=2, tokenizer=tiny.build_tokenizer(300))
    code, rep = doctor(eyas_cli, healthy["sglang"], "--target", other)
    assert code == 1 and "EYAS-VOCAB-SIZE" in ids_of(rep, "error")


def test_vocab_against(healthy, eyas_cli, tmp_path):
    from eyas.formats.vocab import VocabMap, save_vocab

    d = healthy["drafter"]
    V = d.cfg.vocab_size
    ids = torch.arange(V - N_DRAFT, V)  # a different vocabulary of the same size
    save_vocab(tmp_path / "v.safetensors", VocabMap(core_vocab.d2t_from_ids(ids), core_vocab.t2d_from_ids(ids, V)))
    code, rep = doctor(eyas_cli, healthy["sglang"], "--against", tmp_path / "v.safetensors")
    assert code == 1 and "EYAS-VOCAB-MISMATCH" in ids_of(rep, "error")
    f = next(f for f in rep["findings"] if f["id"] == "EYAS-VOCAB-MISMATCH")
    assert "same_position" in f["evidence"] and "eyas vocab remap" in f["fix"]
    code, rep = doctor(eyas_cli, healthy["sglang"], "--against", healthy["eyas"])
    assert code == 0


# ---------------------------------------------------------------- dynamic


def test_dynamic_healthy_and_recommendation(healthy, eyas_cli, tiny_target):
    code, rep = doctor(eyas_cli, healthy["sglang"], "--target", tiny_target,
                       "--prompts", healthy["prompts"], healthy["prompts"],  # several files after one flag
                       "--num-prompts", 4, "--new-tokens", 16, "--steps", 3, "--device", "auto")  # cuda where present
    assert code == 0, [f for f in rep["findings"] if f["severity"] == "error"]
    dyn = rep["measurements"]["dynamic"]
    ref = dyn["paths"]["eyas reference"]
    assert ref["accept_len"] > 1.2 and abs(dyn["paths"]["sglang"]["accept_len"] - ref["accept_len"]) < 1e-6
    assert "--speculative-num-steps" in dyn["recommendation"]["sglang"]
    assert "num_speculative_tokens" in dyn["recommendation"]["vllm"]
    assert dyn["decode"]["sglang"]["accept_len"] > 1.0  # real chain decoding through eyas.runtime


def test_dynamic_locates_off_by_one_without_metadata(healthy, eyas_cli, tiny_target):
    # A foreign SGLang checkpoint (no eyas.json) whose ids were written as HF indices.
    ck = variant(healthy, "sglang", "dyn_aux", config=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=AUX), drop_meta=True)
    code, rep = doctor(eyas_cli, ck, "--target", tiny_target, "--prompts", healthy["prompts"], "--engine", "sglang",
                       "--num-prompts", 4, "--new-tokens", 16, "--steps", 3)
    assert code == 1 and "EYAS-AUX-OFF-BY-ONE" in ids_of(rep, "error")


def test_dynamic_locates_fc_bypass(healthy, eyas_cli, tiny_target):
    ck = variant(healthy, "sglang", "dyn_fc", config=lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    code, rep = doctor(eyas_cli, ck, "--target", tiny_target, "--prompts", healthy["prompts"], "--engine", "sglang",
                       "--num-prompts", 4, "--new-tokens", 16, "--steps", 3)
    dyn = [f for f in rep["findings"] if f["id"] == "EYAS-FC-BYPASS" and f["message"].startswith("dynamic")]
    assert dyn and dyn[0]["evidence"]["restored_accept_len"] > dyn[0]["evidence"]["accept_len"]


def test_untrained_decoder_and_dtype_and_invalid_d2t(healthy, eyas_cli):
    fresh = Eagle3Drafter(healthy["drafter"].cfg).trainable_state_dict()

    def untrained(sd):
        for k, v in fresh.items():
            if k.startswith("midlayer.") or k == "norm.weight":
                sd[k] = v.clone()
        sd["fc.weight"] = sd["fc.weight"].to(torch.bfloat16)
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "untrained", tensors=untrained))
    assert "EYAS-WEIGHTS-UNTRAINED" in ids_of(rep, "warning")
    assert any(f["id"] == "EYAS-DTYPE" and f["severity"] == "warning" for f in rep["findings"])

    def dup(sd):
        d = sd["d2t"].clone()
        d[5] = d[4] - 1  # draft ids 4 and 5 map to the same target id
        sd["d2t"] = d
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "dup", tensors=dup))
    assert code == 1 and "EYAS-D2T-INVALID" in ids_of(rep, "error")


def test_missing_draft_vocab_size_and_unknown_layout(healthy, eyas_cli, tmp_path):
    code, rep = doctor(eyas_cli, variant(healthy, "sglang", "nodvs", config=lambda c: c.pop("draft_vocab_size") and None))
    assert "EYAS-CONFIG-MISSING" in ids_of(rep)
    (tmp_path / "x").mkdir()
    save_file({"w": torch.zeros(2)}, tmp_path / "x" / "model.safetensors")
    code, out, err = eyas_cli("doctor", tmp_path / "x", "--json")
    assert code == 1 and "EYAS-LAYOUT-UNKNOWN" in out


def test_vocab_against_data(healthy, eyas_cli, tmp_path):
    from eyas.formats.data import Sample, write_prepared

    V = healthy["drafter"].cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    rare = torch.nonzero(~healthy["drafter"].t2d).flatten()  # ids outside the draft vocabulary
    samples = []
    for i in range(6):
        ids = rare[torch.randint(0, rare.numel(), (40,), generator=g)].tolist()
        samples.append(Sample(f"s{i}", "t", "chat", [], [1] + ids, [0] + [1] * 40))
    man = {"target": "tiny", "target_fingerprint": "x", "tokenizer_fingerprint": "x", "chat_template_sha256": "x",
           "max_len": 64, "regenerated": False, "counts": {"train": 6, "eval": 0}, "sources": [], "provenance": {}}
    (tmp_path / "data").mkdir()
    write_prepared(tmp_path / "data", man, {"train": samples, "eval": []})
    code, rep = doctor(eyas_cli, healthy["sglang"], "--data", tmp_path / "data")
    assert code == 1 and {"EYAS-VOCAB-COVERAGE", "EYAS-VOCAB-MISMATCH"} <= ids_of(rep)
    cov = rep["measurements"]["vocab_vs_data"]
    assert cov["coverage_checkpoint"] < 0.05 and cov["estimated_step_acceptance_loss"] > 0.5
    assert V == healthy["drafter"].t2d.numel()


@pytest.mark.slow
def test_untrained_drafter_for_real_target(builtin_target, eyas_cli, tmp_path):
    """A freshly initialised SmolLM2-sized drafter in SGLang layout: the doctor calls it untrained."""
    from eyas.formats import engines

    tcfg = targets.load_config(builtin_target)
    L = tcfg.num_hidden_layers
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(tcfg, 4096, targets.default_aux_layers(L)))
    ids = torch.arange(0, 8192, 2)
    d.d2t.copy_(core_vocab.d2t_from_ids(ids))
    d.t2d.copy_(core_vocab.t2d_from_ids(ids, tcfg.vocab_size))
    (tmp_path / "sg").mkdir()
    engines.write_layout(d.cfg, d.trainable_state_dict(), "sglang", tmp_path / "sg")
    code, rep = doctor(eyas_cli, tmp_path / "sg", "--target", builtin_target)
    assert code == 1
    assert {"EYAS-LMHEAD-UNTRAINED"} <= ids_of(rep, "error")
    assert "EYAS-WEIGHTS-UNTRAINED" in ids_of(rep, "warning")
    assert "EYAS-ARCH-SUPPORTED" in ids_of(rep)
    assert "EYAS-AUX-VERSION-DEPENDENT" not in ids_of(rep)  # default ids: first SGLang id is 1


# ---------------------------------------------------------------- sharded weights


def _shard(src: Path, dst: Path, with_index: bool = True) -> Path:
    """`src` with its model.safetensors split the way Hugging Face saves large models:
    model-0000i-of-00002.safetensors (+ model.safetensors.index.json)."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    keys = sorted(sd)
    parts = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    wmap = {}
    for i, part in enumerate(parts, 1):
        name = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, dst / name)
        wmap.update({k: name for k in part})
    if with_index:
        total = sum(v.numel() * v.element_size() for v in sd.values())
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}))
    return dst


def _merged(ckpt: Path) -> dict:
    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_sharded_drafter_reads_like_one_file(healthy, eyas_cli, tiny_target, tmp_path, fmt):
    """doctor, import, vocab compare and remap read a drafter saved in shards exactly as the same
    drafter in one file; remap writes the shards back with only the vocabulary tensors changed."""
    from eyas.formats import engines
    from eyas.formats import vocab as fvocab

    one = healthy[fmt]
    sh = _shard(one, tmp_path / "sharded", with_index=fmt == "sglang")
    (code_a, a), (code_b, b) = doctor(eyas_cli, one, "--target", tiny_target), \
        doctor(eyas_cli, sh, "--target", tiny_target)
    assert code_a == code_b == 0 and b["layout"] == a["layout"] == fmt
    assert sorted(f["id"] for f in a["findings"]) == sorted(f["id"] for f in b["findings"])
    ca, sa, _ = engines.import_checkpoint(one, target=tiny_target)
    cb, sb, _ = engines.import_checkpoint(sh, target=tiny_target)
    assert ca == cb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    code, out, err = eyas_cli("vocab", "compare", one, sh, "--json")
    assert code == 0, err
    assert json.loads(out)["overlap"] == int(sa["d2t"].numel())

    V = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    ids = torch.arange(0, V, 3)[: sa["d2t"].numel()]
    fvocab.save_vocab(tmp_path / "to.safetensors", fvocab.VocabMap(core_vocab.d2t_from_ids(ids),
                                                                  core_vocab.t2d_from_ids(ids, V)))
    for src, out in ((one, tmp_path / "r1"), (sh, tmp_path / "r2")):
        code, _, err = eyas_cli("vocab", "remap", "--drafter", src, "--to", tmp_path / "to.safetensors",
                                "--target", tiny_target, "--out", out)
        assert code == 0, err
    r1, r2, before = _merged(tmp_path / "r1"), _merged(tmp_path / "r2"), _merged(sh)
    assert r1.keys() == r2.keys() and all(torch.equal(r1[k], r2[k]) for k in r1)
    assert sorted(p.name for p in (tmp_path / "r2").glob("*.safetensors")) == \
        sorted(p.name for p in sh.glob("*.safetensors"))
    changed = {k for k in before if not torch.equal(before[k], r2[k])}
    assert changed <= {"d2t", "t2d", "lm_head.weight"} and "d2t" in changed
    assert torch.equal(core_vocab.target_ids(r2["d2t"]), ids)


def test_sharded_drafter_missing_shard_exits_2(healthy, eyas_cli, tmp_path):
    sh = _shard(healthy["sglang"], tmp_path / "sharded")
    (sh / "model-00002-of-00002.safetensors").unlink()
    for args in (("doctor", sh), ("vocab", "compare", sh, healthy["sglang"])):
        code, out, err = eyas_cli(*args)
        assert code == 2 and err.count("\n") <= 1, err
        assert "model.safetensors.index.json" in err and "model-00002-of-00002.safetensors" in err


# ---------------------------------------------------------------- one reading of a checkpoint (issue 57)


def test_failed_engine_reading_is_an_error_not_a_fallback(healthy, eyas_cli):
    """The doctor reads through eyas.formats.engines; when that strict reading fails for an engine,
    the failure is an error carrying the reader's message (no lenient second reading)."""
    def drop(c):
        del c["transformer_layer_config"]
    ck = variant(healthy, "speculators", "no_layer_cfg", config=drop)
    code, rep = doctor(eyas_cli, ck, "--engine", "vllm")
    refuses = [f for f in rep["findings"] if f["id"] == "EYAS-ENGINE-REFUSES" and f["engine"] == "vllm"]
    assert code == 1 and refuses and refuses[0]["severity"] == "error"
    assert "missing" in refuses[0]["message"] and "hidden_size" in refuses[0]["message"], refuses[0]["message"]


def test_t2d_mismatch_grades_by_engines_that_read_it(healthy, eyas_cli):
    """vLLM and SGLang drop t2d on load (the engine tables say so): a stale t2d is a warning for them."""
    def first_n(sd):
        t = torch.zeros_like(sd["t2d"])
        t[: sd["d2t"].numel()] = True
        sd["t2d"] = t
    ck = variant(healthy, "vllm", "t2d_first_n", tensors=first_n)
    code, rep = doctor(eyas_cli, ck, "--engine", "vllm")
    assert code == 0 and "EYAS-T2D-MISMATCH" in ids_of(rep, "warning")
    code, rep = doctor(eyas_cli, ck, "--engine", "speculators")
    assert "EYAS-T2D-MISMATCH" in ids_of(rep, "error")


def test_arch_source_is_named(healthy, eyas_cli, tiny_target):
    from eyas.doctor.with_target import arch_support
    from eyas.serve.vllm_engine import unavailable

    ok, source = arch_support("vllm", "LlamaForCausalLM")
    assert ok and (("installed vLLM" in source) if unavailable() is None else source.startswith("stored list"))
    assert arch_support("sglang", "LlamaForCausalLM")[1].startswith("stored list")
    code, rep = doctor(eyas_cli, healthy["vllm"], "--engine", "vllm", "--target", tiny_target)
    arch = [f for f in rep["findings"] if f["id"].startswith("EYAS-ARCH")]
    assert arch and arch[0]["evidence"]["source"] == source  # in --json; the human line stays one short line
