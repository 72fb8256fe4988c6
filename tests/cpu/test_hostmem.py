"""eyas.cpu.hostmem: glibc's thresholds raised once per process, unless the user chose otherwise."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = str(Path(__file__).with_name("hostmem_probe.py"))


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "EYAS_MALLOC"))}
    env.pop("LD_PRELOAD", None)
    return env


def probe(**env) -> str:
    out = subprocess.run([sys.executable, PROBE, "once"], env={**clean_env(), **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_thresholds_raised_once_and_user_settings_respected():
    assert probe() == "True True"
    assert probe(EYAS_MALLOC="default") == "False False"
    assert probe(MALLOC_ARENA_MAX="2") == "False False"
    assert probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000") == "False False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_freed_large_buffer_is_reused_not_faulted_in_again():
    """The effect itself: after a 64 MB buffer is freed, the next one costs no new page faults."""
    faults = {arm: int(subprocess.run([sys.executable, PROBE, "faults", arm], env=clean_env(), capture_output=True, text=True,
                                      check=True).stdout) for arm in ("0", "1")}
    pages = 5 * (64 << 20) // resource.getpagesize()
    assert faults["0"] > pages // 2  # glibc's default: each buffer mapped and faulted in afresh
    assert faults["1"] < pages // 20  # retained: the same pages again
