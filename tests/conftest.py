"""Shared fixtures: tiny random targets (session-scoped), an isolated EYAS_HOME, the CLI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
PROMPTS = SHARED / "data" / "prompts"
KINDS = ("llama", "qwen2", "mistral", "gemma")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    """One tiny random target per architecture family: {kind: directory}."""
    root = tmp_path_factory.mktemp("targets")
    return {k: tiny.build_target(root / k, kind=k, tokenizer=tiny_tokenizer) for k in KINDS}


@pytest.fixture(scope="session")
def other_target(tmp_path_factory, tiny_tokenizer):
    """other_target(kind): a tiny random target of a family the suite does not run everywhere
    (tiny.py: gpt_oss, deepseek_v3, falcon, gpt_neox), built on first use."""
    root, made = tmp_path_factory.mktemp("other_targets"), {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = tiny.build_target(root / kind, kind=kind, tokenizer=tiny_tokenizer)
        return made[kind]
    return get


@pytest.fixture(scope="session")
def tiny_target(tiny_targets) -> Path:
    """The default tiny target: a 4-layer Llama, hidden 64, vocab ~256."""
    return tiny_targets["llama"]


@pytest.fixture(scope="session")
def builtin_target() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the user's cache (reused across runs)."""
    from eyas import targets

    return targets.resolve("smollm2-135m")


@pytest.fixture
def eyas_cli(capsys):
    """Run `eyas ARGS...` in-process; returns (exit code, stdout, stderr)."""
    from eyas.cli import main

    def run(*argv: str):
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def cli(eyas_cli, capsys):
    """`eyas_cli`, plus argparse's own usage errors (SystemExit 2) as (code, out, err)."""

    def run(*argv):
        try:
            return eyas_cli(*argv)
        except SystemExit as e:
            out = capsys.readouterr()
            return e.code, out.out, out.err

    return run


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and two threads spin badly on a shared 2-core box."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_drafter(tmp_path_factory, builtin_target):
    """A real SmolLM2 drafter trained on MT-bench answers (tests/smollm2_drafter.py), built once.
    EYAS_TEST_SMOLLM2_DRAFTER=DIR builds it in DIR the first time and reuses it afterwards (for
    development; CI builds it afresh)."""
    import smollm2_drafter as sd
    from eyas.cli import main

    os.environ.setdefault("EYAS_NO_PROGRESS", "1")
    keep = os.environ.get("EYAS_TEST_SMOLLM2_DRAFTER")
    if keep and (Path(keep) / "run" / "best").is_dir():
        return sd.existing(Path(keep), builtin_target)
    root = Path(keep) if keep else tmp_path_factory.mktemp("smollm2_drafter")
    root.mkdir(parents=True, exist_ok=True)
    return sd.build(root, builtin_target, PROMPTS, lambda *argv: main([str(a) for a in argv]))


@pytest.fixture(scope="session")
def vllm_ready():
    """Skip (one line saying why) where vLLM cannot be installed, e.g. beside a CUDA torch; under CI
    (CI=true), where `make test` installs it, its absence is a failure instead."""
    from eyas.serve import vllm_engine

    reason = vllm_engine.unavailable()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must run the real-engine tests: {reason}")
    if reason:
        pytest.skip(reason)
