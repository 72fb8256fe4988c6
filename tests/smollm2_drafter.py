"""A real SmolLM2 drafter, trained in a minute on the target's own answers to a few MT-bench
prompts, for the tests that serve a drafter in a real engine (vLLM) and compare it with eyas.

It is small and over-fitted on purpose: served on the prompts it was trained on, it accepts
well above 1, so a loading fault (wrong keys, wrong d2t, no aux states) shows as a collapse.
Built once per test session through the real CLI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPT_FILE = "FastChat__mt_bench__question.jsonl"
N_PROMPTS = 48  # trained on
N_BENCH = 8  # served: the first of those, first turn only
ANSWER_TOKENS = 96


@dataclass(frozen=True)
class Smollm2Drafter:
    target: Path  # the HF directory of SmolLM2-135M-Instruct
    run: Path  # the `eyas train` run directory
    ckpt: Path  # its best/ checkpoint (eyas layout)
    data: Path  # the prepared (regenerated) data
    capture: Path  # its captured features
    vocab: Path  # its draft vocabulary
    prompts: Path  # a jsonl of the N_BENCH prompts it was trained on ({"turns": [...]})


def build(root: Path, target: Path, prompts_dir: Path, run_cli) -> Smollm2Drafter:
    """Prepare, build a vocabulary, capture and train into `root`; `run_cli(*argv)` -> exit code."""
    src = prompts_dir / PROMPT_FILE
    lines = src.read_text().splitlines()[:N_PROMPTS]
    train_prompts = root / "train_prompts.jsonl"
    train_prompts.write_text("\n".join(lines) + "\n")
    bench = root / "bench_prompts.jsonl"
    bench.write_text("\n".join(json.dumps({"turns": json.loads(x)["turns"][:1]}) for x in lines[:N_BENCH]) + "\n")
    data, vocab, cap, run = root / "data", root / "vocab.safetensors", root / "capture", root / "run"
    steps = (
        ("data", "prepare", "--target", target, "--input", train_prompts, "--out", data, "--regenerate",
         "--max-new-tokens", ANSWER_TOKENS, "--eval-fraction", "0.1", "--max-len", 512, "--dtype", "fp32"),
        ("vocab", "build", "--data", data, "--size", 2048, "--out", vocab),
        ("capture", "--target", target, "--data", data, "--out", cap, "--dtype", "fp32"),
        train_argv(target, cap, vocab, run),
    )
    for argv in steps:
        code = run_cli(*argv)
        assert code == 0, f"eyas {' '.join(map(str, argv))} exited {code}"
    return existing(root, target)


def train_argv(target: Path, capture: Path, vocab: Path, run: Path, max_steps: int = 300) -> tuple:
    """The fixture's `eyas train` (drafters with other --drafter-flags are trained the same way)."""
    return ("train", "--target", target, "--capture", capture, "--vocab", vocab, "--out", run, "--ttt", 3,
            "--epochs", 40, "--batch-tokens", 1024, "--max-len", 512, "--eval-every", 100, "--dtype", "fp32",
            "--max-steps", max_steps)


def existing(root: Path, target: Path) -> Smollm2Drafter:
    """The drafter `build` wrote into `root`."""
    return Smollm2Drafter(target=target, run=root / "run", ckpt=root / "run" / "best", data=root / "data",
                          capture=root / "capture", vocab=root / "vocab.safetensors",
                          prompts=root / "bench_prompts.jsonl")
