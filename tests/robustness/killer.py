"""SIGKILL a command at seeded random points, rerun it to completion, and compare the final
artifacts with an uninterrupted run's, byte for byte."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.robustness.harness import tree_hash

EYAS = [sys.executable, "-m", "eyas"]


def child_env() -> dict:
    env = dict(os.environ)
    env.update(EYAS_NO_PROGRESS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    return env


def run(argv: list, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """Run to completion; returns (result, wall seconds)."""
    t0 = time.monotonic()
    r = subprocess.run(EYAS + [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, env=child_env())
    return r, time.monotonic() - t0


def run_and_kill(argv: list, after_s: float) -> int | None:
    """Start the command, SIGKILL it after `after_s` seconds; returns its exit code if it finished first."""
    proc = subprocess.Popen(EYAS + [str(a) for a in argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env())
    deadline = time.monotonic() + after_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return None


def kill_points(seed: int, n: int, lo: float, hi: float) -> list[float]:
    rng = random.Random(seed)
    return sorted(rng.uniform(lo, hi) for _ in range(n))


def artifact_hash(out: Path, ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """Hashes of the final artifacts (files whose paths contain an ignored part are skipped:
    logs and provenance that legitimately record times or argv)."""
    return {k: v for k, v in tree_hash(out).items() if v != "dir" and not any(part in k for part in ignore)}
