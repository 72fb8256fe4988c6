"""Helpers shared by stage drivers: JSON summaries, atomic output directories, provenance, what a
config's `dtype: auto` means for its stage."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from eyas import __version__
from eyas.config import to_json
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io

log = logging.getLogger(__name__)
Config = TypeVar("Config")

# who runs the target in data prepare --regenerate and capture: eyas's own loop, or vLLM (eyas.serve)
TARGET_RUNNERS = ("eyas", "vllm")


def emit(args, summary: dict, human: str) -> None:
    """Print `summary` as JSON when `--json` was given, else the human text."""
    if getattr(args, "json", False):
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(human)


@contextmanager
def atomic_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; on success it replaces `out`, on failure it is
    removed, so a half-written output never exists under the final name."""
    out = Path(out)
    refuse_symlink_out(out)
    if out.exists() and not force and any(out.iterdir()):
        raise EyasError(f"--out {out} exists and is not empty; pass --force to replace it or choose another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp.*"):  # what a killed earlier run of this output left
        log.info("removing %s, left by an interrupted run", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp.", dir=out.parent))
    try:
        yield tmp
        ckpt_io.share(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def refuse_symlink_out(out: Path) -> None:
    """--out is replaced as a whole on success; a symbolic link there would be replaced, not
    followed, so it is refused up front (before any work)."""
    if Path(out).is_symlink():
        raise EyasError(f"--out {out} is a symbolic link; pass the directory it points to ({Path(out).resolve()}) "
                        "or another path")


def refuse_out_over_inputs(out: Path, inputs: dict[str, object]) -> None:
    """Exit 2 when `out` is one of the command's inputs or holds one: --force replaces --out,
    and would delete the input with it. `inputs`: {flag: path or list of paths}."""
    o = Path(out).resolve()
    for flag, paths in inputs.items():
        for p in paths if isinstance(paths, (list, tuple)) else [paths]:
            if p is None or str(p) in ("", "builtin", "builtin-eval", "builtin-public", "from-checkpoint"):
                continue
            q = Path(p).resolve()
            if q == o or o in q.parents:
                raise EyasError(f"--out {out} is (or holds) the input {flag} {p}; replacing it would delete that "
                                "input: choose another --out")
            if flag == "--target" and q in o.parents:  # nothing eyas writes belongs inside a model directory
                raise EyasError(f"--out {out} lies inside the --target directory {p}; choose an --out outside it")


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to `path` via a temp file + rename (never half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(cfg=None) -> dict:
    """What to store beside every artifact: the stage's resolved config (`cfg`, its frozen config
    dataclass, as JSON: paths as strings), versions, argv and git sha. `cfg=None` leaves the config
    out (a caller that has none)."""
    import torch
    import transformers

    assert cfg is None or dataclasses.is_dataclass(cfg), f"provenance takes a stage config, not {type(cfg)}"
    return {
        **({"config": to_json(cfg)} if cfg is not None else {}),
        "eyas": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "argv": sys.argv,
        "git_sha": git_sha(),
    }


def resolve_dtype(cfg: Config, rule: Callable[[str], str]) -> Config:
    """`cfg` with `dtype="auto"` replaced by `rule(cfg.device)`: each stage resolves its own config
    at its start with its own rule (`targets.fast_dtype`, or `targets.decode_dtype` for decoding),
    so a Python caller and the command line get the same dtype. Any other dtype is kept."""
    if cfg.dtype != "auto":
        return cfg
    dtype = rule(cfg.device)
    log.info("--dtype auto: %s on this machine", dtype)
    return dataclasses.replace(cfg, dtype=dtype)
