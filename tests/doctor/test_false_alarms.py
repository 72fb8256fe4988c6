"""No false alarms on healthy exports, however weak: a barely trained drafter's variants differ by
noise, which the doctor must call inconclusive (exit 0), never an error (doctor/dynamic.py
`paired`: decisive and significant over the positions counted). The sweep over more seeds and
training lengths is bench/doctor_false_alarms.py."""

from __future__ import annotations

import json

import pytest

from eyas.formats import engines

from tiny import train_tiny_drafter  # noqa: E402

PROMPTS = ["the model token draft", "python code function return", "math two plus three equals",
           "the cat and the dog"]


@pytest.mark.parametrize("seed,steps", [(1, 1), (2, 10)])
def test_healthy_export_has_no_error_with_or_without_prompts(tiny_target, tmp_path, eyas_cli, seed, steps):
    d, _ = train_tiny_drafter(tiny_target, steps=steps, seed=seed, head_from_target=True)  # as eyas train
    out = tmp_path / "vllm"
    out.mkdir()
    engines.write_layout(d.cfg, d.trainable_state_dict(), "vllm", out, target=tiny_target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    for extra in ((), ("--prompts", prompts, "--num-prompts", 4, "--new-tokens", 16, "--steps", 3)):
        code, o, err = eyas_cli("doctor", out, "--engine", "vllm", "--target", tiny_target, *map(str, extra), "--json")
        rep = json.loads(o)
        errors = [(f["id"], f["message"]) for f in rep["findings"] if f["severity"] == "error"]
        assert code == 0 and not errors, errors
