"""The doctor decides which vocabulary map a drafter's lm_head was trained with (the seeds' two
vocabulary traps): d2t broken beside a right t2d, and maps of a foreign vocabulary consistent with
each other. The fix it prints (`eyas vocab repair`) is applied and must give back the healthy maps.

The drafter here starts its head from the target's rows of its draft ids, as `eyas train` does
(stages/train.py), and is then trained a little, so its rows have moved off those rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.core import vocab as core_vocab
from eyas.formats import engines
from eyas.formats import vocab as fvocab
from eyas.formats.target_weights import target_head

from tiny import train_tiny_drafter  # noqa: E402


@pytest.fixture(scope="module")
def export(tiny_target, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("head_vocab")
    d, _ = train_tiny_drafter(tiny_target, steps=5)
    ids = core_vocab.target_ids(d.d2t)
    with torch.no_grad():  # as eyas train initialises it, then moved a little (training)
        g = torch.Generator().manual_seed(1)
        rows = target_head(tiny_target)[ids].float()
        rows = rows + 0.3 * rows.std() * torch.randn(rows.shape, generator=g)
        # trained heads spread their row norms (frequent vs rare tokens); a tiny random target's rows do not
        d.lm_head.weight.copy_(rows * (0.3 + 2 * torch.rand(len(ids), 1, generator=g)))
    vocab = root / "vocab.safetensors"
    fvocab.save_vocab(vocab, fvocab.VocabMap(d.d2t.clone(), d.t2d.clone(), {}))
    (root / "vllm").mkdir()
    meta = {"vocab": str(vocab), "vocab_fingerprint": fvocab.vocab_fingerprint(d.d2t, d.cfg.vocab_size)}  # as train
    engines.write_layout(d.cfg, d.trainable_state_dict(), "vllm", root / "vllm", target=tiny_target, meta=meta)
    V = d.cfg.vocab_size
    others = torch.tensor(sorted(set(range(V)) - set(ids.tolist())))
    # another vocabulary of the same size: every id the head's lacks, the rest drawn from the head's,
    # so that few positions agree (the seeds' case: 0 of 1,024)
    pool = torch.cat([others, ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(3))]])
    foreign = torch.sort(pool[:len(ids)]).values
    assert float((foreign == ids).float().mean()) < 0.2
    return {"root": root, "vllm": root / "vllm", "vocab": vocab, "ids": ids, "foreign": foreign, "V": V}


def mutate(export: dict, name: str, d2t=None, t2d=None, keep_record: bool = False) -> Path:
    dst = export["root"] / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(export["vllm"], dst)
    sd = load_file(dst / "model.safetensors")
    if d2t is not None:
        sd["d2t"] = d2t
    if t2d is not None:
        sd["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in sd.items()}, dst / "model.safetensors")
    meta = json.loads((dst / "eyas.json").read_text())
    if not keep_record:
        meta.pop("vocab_fingerprint", None)
        meta.pop("vocab", None)
    (dst / "eyas.json").write_text(json.dumps(meta))
    return dst


def doctor(eyas_cli, *args) -> tuple[int, dict]:
    code, out, err = eyas_cli("doctor", *map(str, args), "--engine", "vllm", "--json")
    assert code in (0, 1), (code, err)
    return code, json.loads(out)


def found(rep: dict, fid: str) -> dict | None:
    return next((f for f in rep["findings"] if f["id"] == fid), None)


def apply_fix(eyas_cli, finding: dict, out: Path) -> Path:
    argv = [str(out) if a == "OUT" else a for a in finding["command"]]
    code, _, err = eyas_cli(*argv)
    assert code == 0, err
    return out


def wrong_d2t(export: dict) -> torch.Tensor:
    """Valid, distinct ids that are not the vocabulary (the foreign one), as offsets."""
    return core_vocab.d2t_from_ids(export["foreign"])


def test_healthy_head_follows_d2t(export, eyas_cli, tiny_target):
    code, rep = doctor(eyas_cli, export["vllm"], "--target", tiny_target)
    assert code == 0, [f for f in rep["findings"] if f["severity"] == "error"]
    f = found(rep, "EYAS-HEAD-MATCH")
    assert f and f["severity"] == "info" and f["evidence"]["agree"]["d2t"] >= 0.5


def test_d2t_broken_t2d_right_is_decided_by_the_head_and_repaired(export, eyas_cli, tiny_target, tmp_path):
    ck = mutate(export, "d2t_wrong", d2t=wrong_d2t(export))
    code, rep = doctor(eyas_cli, ck)  # without the target: both readings named, --target decides
    t2d = found(rep, "EYAS-T2D-MISMATCH")
    assert code == 0 and t2d["severity"] == "warning" and "--target" in t2d["fix"] and "broken" in t2d["message"]
    code, rep = doctor(eyas_cli, ck, "--target", tiny_target)
    f = found(rep, "EYAS-D2T-WRONG-IDS")
    assert code == 1 and f and f["severity"] == "error" and found(rep, "EYAS-T2D-MISMATCH") is None
    assert f["command"][:2] == ["vocab", "repair"] and "t2d" in f["command"]
    fixed = apply_fix(eyas_cli, f, tmp_path / "fixed")
    assert torch.equal(load_file(fixed / "model.safetensors")["d2t"], load_file(export["vllm"] / "model.safetensors")["d2t"])
    assert torch.equal(load_file(fixed / "model.safetensors")["lm_head.weight"],
                       load_file(ck / "model.safetensors")["lm_head.weight"])  # rows unmoved
    code, rep = doctor(eyas_cli, fixed, "--target", tiny_target)
    assert code == 0, [f for f in rep["findings"] if f["severity"] == "error"]


@pytest.mark.parametrize("kind", ["zeros", "missing"])
def test_d2t_zero_or_missing_beside_a_right_t2d(export, eyas_cli, tiny_target, kind):
    n = len(export["ids"])
    ck = mutate(export, f"d2t_{kind}", d2t=torch.zeros(n, dtype=torch.long) if kind == "zeros" else None)
    if kind == "missing":
        sd = load_file(ck / "model.safetensors")
        sd.pop("d2t")
        save_file(sd, ck / "model.safetensors")
    code, rep = doctor(eyas_cli, ck, "--target", tiny_target)
    f = found(rep, "EYAS-D2T-WRONG-IDS")
    assert code == 1 and f and "t2d" in f["command"]


@pytest.mark.parametrize("nested", [False, True])
def test_recorded_vocabulary_decides_without_the_target(export, eyas_cli, nested):
    ck = mutate(export, f"d2t_wrong_recorded{nested}", d2t=wrong_d2t(export), keep_record=True)
    if nested:  # `eyas export` keeps the checkpoint's eyas.json under "trained"
        meta = json.loads((ck / "eyas.json").read_text())
        (ck / "eyas.json").write_text(json.dumps({"trained": {k: meta.pop(k) for k in ("vocab", "vocab_fingerprint")},
                                                  **meta}))
    code, rep = doctor(eyas_cli, ck)
    assert code == 1 and found(rep, "EYAS-D2T-WRONG-IDS")["severity"] == "error"


def test_consistent_foreign_vocabulary(export, eyas_cli, tiny_target, tmp_path):
    ids = export["foreign"]
    ck = mutate(export, "foreign", d2t=core_vocab.d2t_from_ids(ids), t2d=core_vocab.t2d_from_ids(ids, export["V"]))
    code, rep = doctor(eyas_cli, ck, "--target", tiny_target)
    f = found(rep, "EYAS-HEAD-VOCAB-MISMATCH")
    assert code == 1 and f and f["command"] is None and "vocab build" in f["fix"]  # no vocabulary at hand
    code, rep = doctor(eyas_cli, ck, "--target", tiny_target, "--against", export["vocab"])
    f = found(rep, "EYAS-HEAD-VOCAB-MISMATCH")
    assert code == 1 and str(export["vocab"]) in f["command"]
    fixed = apply_fix(eyas_cli, f, tmp_path / "fixed")
    code, rep = doctor(eyas_cli, fixed, "--target", tiny_target)
    assert code == 0, [f for f in rep["findings"] if f["severity"] == "error"]
