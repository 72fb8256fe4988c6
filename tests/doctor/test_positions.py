"""The drafter's positions against the context served (doctor/positions.py): vLLM takes a drafter's
max_position_embeddings as its length limit and drafts nothing past it, in every layout it serves;
the fix the doctor prints (`eyas convert --max-positions`) restores the field."""

from __future__ import annotations

import json
import shutil

import pytest

from eyas.formats import engines

from tiny import train_tiny_drafter  # noqa: E402


@pytest.fixture(scope="module")
def exports(tiny_target, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("positions")
    d, _ = train_tiny_drafter(tiny_target, steps=5, head_from_target=True)
    out = {"root": root, "max": d.cfg.max_position_embeddings}
    for fmt in ("vllm", "speculators"):
        (root / fmt).mkdir()
        meta = {"drafter_config": d.cfg.to_dict(), "trained_positions": 40}
        engines.write_layout(d.cfg, d.trainable_state_dict(), fmt, root / fmt, target=tiny_target, meta=meta)
        out[fmt] = root / fmt
    return out


def short(exports: dict, fmt: str, n: int) -> object:
    dst = exports["root"] / f"{fmt}-p{n}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(exports[fmt], dst)
    c = json.loads((dst / "config.json").read_text())
    (c.get("transformer_layer_config") or c)["max_position_embeddings"] = n
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def doctor(eyas_cli, *args) -> tuple[int, list[dict]]:
    code, out, err = eyas_cli("doctor", *map(str, args), "--json")
    assert code in (0, 1), err
    return code, [f for f in json.loads(out)["findings"] if f["id"] == "EYAS-POSITIONS-SHORT"]


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_short_field_is_an_error_and_the_fix_restores_it(exports, eyas_cli, tiny_target, tmp_path, fmt):
    ck = short(exports, fmt, 16)
    code, found = doctor(eyas_cli, ck, "--engine", "vllm", "--target", tiny_target)
    err = [f for f in found if f["severity"] == "error"]
    assert code == 1 and err and err[0]["evidence"] == {"max_position_embeddings": 16, "served": exports["max"]}
    argv = [str(tmp_path / "fixed") if a == "OUT" else a for a in err[0]["command"]]
    assert eyas_cli(*argv, "--target", str(tiny_target))[0] == 0
    code, found = doctor(eyas_cli, tmp_path / "fixed", "--engine", "vllm", "--target", tiny_target)
    assert not [f for f in found if f["severity"] == "error"]


def test_served_context_decides(exports, eyas_cli, tiny_target):
    ck = short(exports, "vllm", 16)
    code, found = doctor(eyas_cli, ck, "--engine", "vllm", "--target", tiny_target, "--max-model-len", 16)
    assert not [f for f in found if f["severity"] == "error"]  # served within the field: drafting never stops
    code, found = doctor(eyas_cli, ck, "--engine", "vllm")  # no target: the length eyas.json recorded at training
    assert code == 1 and [f for f in found if f["severity"] == "error"]


def test_trained_length_below_the_context_is_a_warning(exports, eyas_cli, tiny_target):
    code, found = doctor(eyas_cli, exports["vllm"], "--engine", "vllm", "--target", tiny_target)
    assert code == 0 and [f["severity"] for f in found] == ["warning"] and found[0]["evidence"]["trained_positions"] == 40
