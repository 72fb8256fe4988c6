"""`dtype="auto"` from Python: each stage function resolves its own config with its own rule (the
command line adds nothing), and its records hold the dtype it ran with."""

from __future__ import annotations

import json
import os

import pytest

import tiny
from eyas import targets
from eyas.config import build
from eyas.stages import bench, capture, data, train
from eyas.stages import vocab as vocab_stage

pytestmark = pytest.mark.usefixtures("one_thread")


def _chats(path, n: int = 8):
    lines = tiny.corpus(2 * n, seed=5)
    rows = [{"messages": [{"role": "user", "content": lines[i]}, {"role": "assistant", "content": lines[i + 1]}]}
            for i in range(0, 2 * n, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_stage_resolves_auto_with_its_own_rule(tiny_target, tmp_path, monkeypatch):
    """A machine where training runs in bf16 but decoding is faster in fp32 (AVX512-BF16, no AMX):
    data, capture and train resolve `auto` by `targets.fast_dtype`, bench by `targets.decode_dtype`."""
    monkeypatch.setattr(targets, "fast_dtype", lambda device="cpu": "bf16")
    monkeypatch.setattr(targets, "decode_dtype", lambda device="cpu": "fp32")
    monkeypatch.setenv("EYAS_NO_PROGRESS", "1")
    chats = _chats(tmp_path / "chats.jsonl")

    assert data.run_prepare(build(data.PrepareConfig, target=str(tiny_target), input=[str(chats)],
                                  out=tmp_path / "data", eval_fraction=0.25, dtype="auto")) == 0
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["provenance"]["config"]["dtype"] == "bf16"
    assert manifest["provenance"]["config"]["out"] == str(tmp_path / "data")  # paths as strings

    assert capture.run_capture(capture.CaptureConfig(target=str(tiny_target), data=tmp_path / "data",
                                                     out=tmp_path / "cap", dtype="auto")) == 0
    assert json.loads((tmp_path / "cap" / "manifest.json").read_text())["dtype"] == "bf16"
    assert json.loads((tmp_path / "cap" / "provenance.json").read_text())["config"]["dtype"] == "bf16"

    assert vocab_stage.run_build(build(vocab_stage.BuildConfig, data=[tmp_path / "data"], size=64,
                                       out=tmp_path / "vocab.safetensors")) == 0
    assert train.train(build(train.TrainConfig, target=str(tiny_target), capture=[tmp_path / "cap"],
                             vocab=str(tmp_path / "vocab.safetensors"), out=tmp_path / "run", ttt=2, max_steps=1,
                             batch_tokens=1024, max_len=96, dtype="auto")) == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["train_config"]["dtype"] == "bf16" and run["provenance"]["config"]["dtype"] == "bf16"

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question": "two plus three equals"}) + "\n")
    assert bench.run(build(bench.BenchConfig, target=str(tiny_target), prompts=[str(prompts)], baselines="plain",
                           max_new_tokens=4, limit=1, out=tmp_path / "bench", dtype="auto")) == 0
    report = json.loads((tmp_path / "bench" / "report.json").read_text())
    assert report["summary"]["dtype"] == "fp32" and report["provenance"]["config"]["dtype"] == "fp32"
    assert os.path.isfile(tmp_path / "bench" / "report.md")
