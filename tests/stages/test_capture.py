"""Hidden-state capture: equality with a direct forward, wrapped targets, resume after a
kill, split + merge, damaged shards, the speculators layout and imports, bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tiny
from eyas import targets
from eyas.errors import EyasError
from eyas.formats import capture as fcap
from eyas.stages import capture as scap


def make_prepared(out: Path, tok, target: Path, n_train: int, n_eval: int, seed: int = 0) -> Path:
    """A prepared-data directory per INTERFACES.md (manifest + train/eval JSONL)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = tiny.corpus(2 * (n_train + n_eval), seed=seed)
    rows = []
    for k in range(n_train + n_eval):
        msgs = [{"role": "user", "content": lines[2 * k]}, {"role": "assistant", "content": lines[2 * k + 1]}]
        prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs, tokenize=False)
        p_ids, ids = tok(prompt)["input_ids"], tok(full)["input_ids"]
        rows.append({"id": f"s{k}", "source": "tiny", "category": "chat", "messages": msgs, "input_ids": ids,
                     "loss_mask": [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))})
    for split, part in (("train", rows[:n_train]), ("eval", rows[n_train:])):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    manifest = {"format": "eyas.prepared", "version": 1, "target": str(target),
                "target_fingerprint": targets.fingerprint(target), "tokenizer_fingerprint": "tinytok",
                "chat_template_sha256": "x", "max_len": 512, "regenerated": False,
                "counts": {"train": n_train, "eval": n_eval}, "sources": ["tiny"], "provenance": {}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target, tiny_tokenizer):
    return make_prepared(tmp_path_factory.mktemp("cdata"), tiny_tokenizer, tiny_target, 10, 4)


def _capture(cli, target, data, out, *extra):
    code, stdout, err = cli("capture", "--target", target, "--data", data, "--out", out, "--dtype", "fp32",
                            "--batch-tokens", 200, *extra)
    assert code == 0, err
    return stdout


def _reference(model, ids, layer_ids):
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layer_ids], -1), hs[-1][0]


def test_capture_equals_direct_forward(eyas_cli, tmp_path, prepared, tiny_target):
    out = tmp_path / "cap"
    _capture(eyas_cli, tiny_target, prepared, out, "--json")
    r = fcap.CaptureReader(out)
    assert len(r) == 14 and len(r.split_indices("train")) == 10 and len(r.split_indices("eval")) == 4
    assert r.layer_ids == [2, 2, 1] and r.hidden_size == 64 and r.dtype == torch.float32
    assert r.manifest["last_state"] == "post_final_norm" and r.target_fingerprint == targets.fingerprint(tiny_target)
    model, _ = targets.load(tiny_target)
    _, recs = fcap.read_prepared(prepared)
    for i in (0, 5, 13):
        t = r[i]
        assert t["input_ids"].tolist() == recs[i].input_ids and t["loss_mask"].tolist() == recs[i].loss_mask
        aux, last = _reference(model, recs[i].input_ids, r.layer_ids)
        torch.testing.assert_close(t["aux"], aux, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(t["last"], last, atol=1e-5, rtol=1e-5)
        logits = model(torch.tensor([recs[i].input_ids])).logits[0]
        assert torch.allclose(model.lm_head(t["last"]), logits, atol=1e-4)
        # the target's own argmax where the next token is supervised, -1 elsewhere
        sup = torch.tensor(recs[i].loss_mask[1:] + [0], dtype=torch.bool)
        assert sup.any() and not sup.all()
        assert torch.equal(t["argmax"][sup], logits.argmax(-1)[sup]) and bool((t["argmax"][~sup] == -1).all())
    assert r.manifest[fcap.ARGMAX_KEY] is True
    assert r.validate(prepared)["samples"] == 14


def test_wrapped_target_and_missing_layers(tmp_path, prepared, tiny_target):
    model, _ = targets.load(tiny_target)

    class Wrapper(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.language_model = lm

    _, recs = fcap.read_prepared(prepared)
    recs = recs[:3]
    common = {"target": "wrapped", "target_fingerprint": "w", "data": "d", "data_fingerprint": "d",
              "layer_ids": [1, 2, 3], "hidden_size": 64, "num_layers": 4, "dtype": "fp32",
              "last_state": fcap.LAST_STATE, "shard_mb": 1.0}
    cfg = scap.CaptureConfig("wrapped", prepared, tmp_path / "w", shard_mb=1.0)
    scap.capture_records(Wrapper(model), recs, common, cfg)
    r = fcap.CaptureReader(tmp_path / "w")
    aux, last = _reference(model, recs[2].input_ids, [1, 2, 3])
    torch.testing.assert_close(r[2]["aux"], aux, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r[2]["last"], last, atol=1e-5, rtol=1e-5)
    assert r.manifest[fcap.ARGMAX_KEY] and int(r[2]["argmax"].max()) >= 0  # the head found inside the wrapper
    with pytest.raises(EyasError, match="language_model.model.layers"):
        scap.capture_records(torch.nn.Linear(2, 2), recs, common, scap.CaptureConfig("x", prepared, tmp_path / "x"))


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.name != "provenance.json"}


def test_kill_and_resume_is_byte_identical(eyas_cli, tmp_path, prepared, tiny_target, monkeypatch):
    ref = tmp_path / "ref"
    _capture(eyas_cli, tiny_target, prepared, ref, "--shard-mb", "0.1")
    n_shards = len(fcap.read_manifest(ref)["shards"])
    assert n_shards >= 3
    real, calls = fcap.write_shard, []

    def dying(root, k, tensors, meta):
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after two shards
        calls.append(k)
        return real(root, k, tensors, meta)

    monkeypatch.setattr(fcap, "write_shard", dying)
    out = tmp_path / "killed"
    code, _, err = eyas_cli("capture", "--target", tiny_target, "--data", prepared, "--out", out, "--dtype", "fp32",
                            "--batch-tokens", 200, "--shard-mb", "0.1")
    assert code == 130 and not (out / "manifest.json").exists()
    (out / ".shard-00002.safetensors.tmp").write_bytes(b"partial")  # a half-written temp file
    monkeypatch.setattr(fcap, "write_shard", real)
    stdout = _capture(eyas_cli, tiny_target, prepared, out, "--shard-mb", "0.1", "--json")
    assert json.loads(stdout)["skipped_shards"] == 2
    assert _files(out).keys() - {".shard-00002.safetensors.tmp"} == _files(ref).keys()
    for name, blob in _files(ref).items():
        assert _files(out)[name] == blob, name


def test_split_and_merge_equal_single_run(eyas_cli, tmp_path, prepared, tiny_target):
    ref = tmp_path / "ref"
    _capture(eyas_cli, tiny_target, prepared, ref, "--shard-mb", "0.1")
    parts = []
    for i in range(2):
        parts.append(tmp_path / f"p{i}")
        _capture(eyas_cli, tiny_target, prepared, parts[-1], "--shard-mb", "0.1", "--shard-index", i, "--num-shards", 2)
        assert fcap.read_manifest(parts[-1])["part"] == {"index": i, "count": 2}
    code, _, err = eyas_cli("capture", "merge", parts[0], "--out", tmp_path / "m")
    assert code == 2 and "each of 0..1" in err
    code, _, err = eyas_cli("capture", "merge", *parts, "--out", tmp_path / "m")
    assert code == 0, err
    assert _files(tmp_path / "m") == _files(ref)
    # Bad input leaves every directory as it was: --out onto a part, and a damaged part under --force.
    before = {p: _files(p) for p in (*parts, tmp_path / "m")}
    code, _, err = eyas_cli("capture", "merge", *parts, "--out", parts[0], "--force")
    assert code == 2 and "replacing it would delete that input" in err, err
    shard = next(parts[1].glob("shard-*.safetensors"))
    blob = bytearray(shard.read_bytes())
    blob[-10] ^= 0xFF
    shard.write_bytes(bytes(blob))
    before[parts[1]] = _files(parts[1])
    code, _, err = eyas_cli("capture", "merge", *parts, "--out", tmp_path / "m", "--force")
    assert code == 2 and "corrupted or truncated" in err, err
    assert {p: _files(p) for p in before} == before
    assert not list(tmp_path.glob(".m.tmp*"))


def test_damaged_shards_are_named(eyas_cli, tmp_path, prepared, tiny_target):
    out = tmp_path / "cap"
    _capture(eyas_cli, tiny_target, prepared, out, "--shard-mb", "0.1")
    shard = out / "shard-00001.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-10] ^= 0xFF
    shard.write_bytes(bytes(blob))
    r = fcap.CaptureReader(out)
    i = next(k for k, s in enumerate(r.samples) if s["shard"] == shard.name)
    with pytest.raises(EyasError, match=f"{shard}.*corrupted or truncated.*rerun"):
        r[i]
    r[0]  # other shards still read
    shard.write_bytes(bytes(blob[: len(blob) // 2]))
    with pytest.raises(EyasError, match=str(shard)):
        fcap.CaptureReader(out).validate()
    with pytest.raises(EyasError, match=str(shard)):
        fcap.CaptureReader(out, verify=False)[i]  # truncated: safetensors itself refuses it
    m = json.loads((out / "manifest.json").read_text())
    m["shards"][0]["file"] = "../escape.safetensors"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EyasError, match="leaves the capture directory"):
        fcap.CaptureReader(out)


def test_bad_inputs_exit_2(eyas_cli, tmp_path, prepared, tiny_target, monkeypatch):
    code, _, err = eyas_cli("capture", "--target", tiny_target, "--out", tmp_path / "o")
    assert code == 2 and "--data" in err
    code, _, err = eyas_cli("capture", "--target", tiny_target, "--data", prepared, "--out", tmp_path / "o",
                            "--layers", "2,9")
    assert code == 2 and "--layers" in err
    code, _, err = eyas_cli("capture", "--target", tmp_path / "nodir", "--data", prepared, "--out", tmp_path / "o")
    assert code == 2 and "no such directory" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("mine")
    code, _, err = eyas_cli("capture", "--target", tiny_target, "--data", prepared, "--out", foreign)
    assert code == 2 and "--force" in err and (foreign / "x.txt").exists()

    class Tiny:
        total, free = 10**12, 1000
    monkeypatch.setattr(scap.shutil, "disk_usage", lambda p: Tiny)
    code, _, err = eyas_cli("capture", "--target", tiny_target, "--data", prepared, "--out", tmp_path / "o2")
    assert code == 2 and "GB free" in err and "--force" in err


def test_speculators_layout_and_imports(eyas_cli, tmp_path, prepared, tiny_target):
    out = tmp_path / "cap"
    _capture(eyas_cli, tiny_target, prepared, out, "--format", "speculators", "--layers", "1,2,3")
    r = fcap.CaptureReader(out)
    spec = out / "speculators"
    info = json.loads((spec / "eyas_speculators.json").read_text())
    assert int(14 * info["train_data_ratio"]) == 10 and info["layer_ids"] == [1, 2, 3]
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(max_len=512, datapath=spec, on_missing="raise", train_ratio=info["train_data_ratio"],
                      split="val", hidden_states_dtype=torch.float32)
    assert len(ds) == 4
    model, _ = targets.load(tiny_target)
    norm = targets.find_decoder_stack(model).norm
    for j, i in enumerate(r.split_indices("eval")):
        got, want = ds[j], r[i]
        assert torch.equal(got["hidden_states"], want["aux"]) and torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        with torch.no_grad():  # speculators stores the pre-norm last state and applies the norm itself
            torch.testing.assert_close(norm(got["verifier_last_hidden_states"]), want["last"])
    # layers and split come back from what the export recorded (the layers were taken as the
    # default [2, 2, 1] of this 4-layer target, silently, and every sample marked train)
    code, _, err = eyas_cli("capture", "import", spec, "--from", "speculators", "--target", tiny_target,
                            "--out", tmp_path / "imp")
    assert code == 0, err
    back = fcap.CaptureReader(tmp_path / "imp")
    assert len(back) == 14 and back.split_indices("eval") == r.split_indices("eval")
    assert back.layer_ids == r.layer_ids == [1, 2, 3]
    code, _, err = eyas_cli("capture", "import", spec, "--from", "speculators", "--target", tiny_target,
                            "--layers", "0,1,2", "--out", tmp_path / "imp4")
    assert code == 2 and "records that these features hold layers [1, 2, 3]" in err
    narrow = tiny.build_target(tmp_path / "narrow", hidden=32, layers=4, tokenizer=tiny.build_tokenizer())
    code, _, err = eyas_cli("capture", "import", spec, "--from", "speculators", "--target", narrow,
                            "--out", tmp_path / "imp5")
    assert code == 2 and "hidden size" in err and "Traceback" not in err and not (tmp_path / "imp5").exists()
    for i in (0, 13):
        assert torch.equal(back[i]["aux"], r[i]["aux"]) and torch.equal(back[i]["loss_mask"], r[i]["loss_mask"])
        torch.testing.assert_close(back[i]["last"], r[i]["last"])
    sf = tmp_path / "specforge" / "rows_0-5000"
    sf.mkdir(parents=True)
    for i in range(len(r)):
        t = r[i]
        torch.save({"input_ids": t["input_ids"], "loss_mask": t["loss_mask"], "aux_hidden_state": t["aux"][None],
                    "hidden_state": t["last"][None]}, sf / f"data_{i}.ckpt")
    code, _, err = eyas_cli("capture", "import", sf.parent, "--from", "specforge", "--target", tiny_target,
                            "--out", tmp_path / "imp2")
    assert code == 0, err
    back = fcap.CaptureReader(tmp_path / "imp2")
    assert all(torch.equal(back[i]["last"], r[i]["last"]) and torch.equal(back[i]["aux"], r[i]["aux"])
               for i in range(len(r)))
    code, _, err = eyas_cli("capture", "import", sf.parent, "--from", "specforge", "--target", tiny_target,
                            "--layers", "1,2", "--out", tmp_path / "imp3")
    assert code == 2 and "--layers" in err


def test_validate_command(eyas_cli, tmp_path, prepared, tiny_target, tiny_tokenizer):
    out = tmp_path / "cap"
    _capture(eyas_cli, tiny_target, prepared, out, "--shard-mb", "0.1")
    code, stdout, err = eyas_cli("capture", "validate", out, "--data", prepared, "--json")
    assert code == 0, err
    assert json.loads(stdout)["samples"] == 14
    other = make_prepared(tmp_path / "other", tiny_tokenizer, tiny_target, 10, 4, seed=5)
    code, _, err = eyas_cli("capture", "validate", out, "--data", other)
    assert code == 2 and "does not match the prepared data" in err
    assert f"made from --data {Path(prepared).resolve()}" in err  # names the directory it was made from
    # A NaN written into a shard whose manifest hash was updated to match: the values are checked too.
    from safetensors.torch import load_file, save_file

    shard = out / "shard-00001.safetensors"
    t = load_file(shard)
    t["aux"][3, 5] = float("nan")
    save_file(t, shard)
    m = json.loads((out / "manifest.json").read_text())
    next(s for s in m["shards"] if s["file"] == shard.name)["sha256"] = fcap.sha256_file(shard)
    (out / "manifest.json").write_text(json.dumps(m))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = eyas_cli("capture", "validate", out)
    assert code == 2 and str(shard) in err and "NaN/inf" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    code, _, err = eyas_cli("capture", "validate", tmp_path / "nothing")
    assert code == 2 and "nothing" in err
