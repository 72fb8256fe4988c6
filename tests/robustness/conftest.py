"""Healthy artifacts, built once per session by running the real commands on the tiny
target: prepared data, a vocabulary, an fp32 capture, a short training run, an export.
Every bad-input case derives its broken input from a copy of one of these."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

TRAIN_ARGS = ("--ttt", "2", "--max-steps", "2", "--eval-every", "1", "--dtype", "fp32", "--batch-tokens", "256",
              "--lr", "1e-3", "--seed", "0")


def qa_records(n: int = 12) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys {i + 2}. How many?",
             "answer": f"He has {2 * i + 2} apples because {i} plus {i + 2}.\n#### {2 * i + 2}"} for i in range(n)]


def call(*argv) -> tuple[int, str]:
    """Run the CLI in-process outside capsys (session fixtures); SystemExit becomes a code."""
    import contextlib
    import io

    from eyas.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _ok(*argv) -> None:
    code, err = call(*argv)
    assert code == 0, f"healthy `eyas {' '.join(map(str, argv))}` failed ({code}): {err[-2000:]}"


def strip_template(src: Path, dst: Path) -> Path:
    """A copy of a target whose tokenizer has no chat template."""
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    tc = dst / "tokenizer_config.json"
    cfg = json.loads(tc.read_text())
    cfg.pop("chat_template", None)
    tc.write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="session")
def healthy(tmp_path_factory, tiny_targets) -> dict:
    """{name: path} of healthy artifacts under env['root'] (never modified by a case)."""
    root = tmp_path_factory.mktemp("healthy")
    qa = root / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in qa_records()))
    target = tiny_targets["llama"]
    env = {"root": root, "target": target, "target2": tiny_targets["qwen2"], "qa": qa,
           "prep": root / "prep", "vocab": root / "vocab.safetensors", "vocab_small": root / "vocab16.safetensors",
           "cap": root / "cap", "run": root / "run", "sglang": root / "sglang"}
    _ok("data", "prepare", "--target", target, "--input", qa, "--out", env["prep"], "--eval-fraction", "0.25")
    _ok("vocab", "build", "--data", env["prep"], "--size", "64", "--out", env["vocab"])
    _ok("vocab", "build", "--data", env["prep"], "--size", "16", "--out", env["vocab_small"])
    _ok("capture", "--target", target, "--data", env["prep"], "--out", env["cap"], "--dtype", "fp32",
        "--batch-tokens", "400", "--shard-mb", "0.2")
    _ok("train", "--target", target, "--capture", env["cap"], "--vocab", env["vocab"], "--out", env["run"],
        *TRAIN_ARGS)
    env["ckpt"] = env["run"] / "final"
    _ok("export", env["ckpt"], "--to", "sglang", "--out", env["sglang"], "--target", target)
    env["notmpl"] = strip_template(target, root / "notmpl")
    return env


