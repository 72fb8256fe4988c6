"""SIGKILL a command at a point of its own progress (a file, a line, a checkpoint it has just
written), rerun it to completion, and compare the final artifacts with an uninterrupted run's.

Kills are triggered by what the command has observably done, never by wall time, so a kill
lands at the same step of the work however fast the machine runs (kills timed as shares of a
reference run's wall time all landed before the first checkpoint on a loaded machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.robustness.harness import tree_hash

EYAS = [sys.executable, "-m", "eyas"]
SAFETY_S = 300  # only for a command that never gets to its event; never decides an outcome
POLL_S = 0.002  # short: the kill should land right after the event, before much else is done


def child_env() -> dict:
    env = dict(os.environ)
    env.update(EYAS_NO_PROGRESS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    return env


def run(argv: list) -> subprocess.CompletedProcess:
    """Run to completion."""
    return subprocess.run(EYAS + [str(a) for a in argv], capture_output=True, text=True, timeout=SAFETY_S,
                          env=child_env())


def run_until(argv: list, event: Callable[[], bool], what: str) -> int | None:
    """Start the command and SIGKILL it as soon as `event()` holds. Returns the exit code when
    the command ended before the event (None when it was killed); fails, naming `what`, when
    it neither gets there nor ends within SAFETY_S."""
    proc = subprocess.Popen(EYAS + [str(a) for a in argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=child_env())
    deadline = time.monotonic() + SAFETY_S
    while not event():
        if proc.poll() is not None:
            return proc.returncode
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"`eyas {' '.join(map(str, argv[:2]))}` never got to {what} in {SAFETY_S} s")
        time.sleep(POLL_S)
    if proc.poll() is not None:  # it got there and ended before this poll saw it
        return proc.returncode
    proc.kill()  # SIGKILL: no handler runs, as in a power cut or the OOM killer
    proc.wait()
    return None


def artifact_hash(out: Path, ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """Hashes of the final artifacts (files whose paths contain an ignored part are skipped:
    logs and provenance that legitimately record times or argv)."""
    return {k: v for k, v in tree_hash(out).items() if v != "dir" and not any(part in k for part in ignore)}
