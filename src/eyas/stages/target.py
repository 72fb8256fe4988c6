"""`eyas target fetch | info`: materialise a target into the local cache, or describe it."""

from __future__ import annotations

from dataclasses import dataclass

from eyas import targets
from eyas.config import arg, command
from eyas.stages.common import emit


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    target: str = arg("built-in name or local directory", positional=True)
    json: bool = arg("print a machine-readable JSON summary", False)


def register(sub) -> None:
    p = sub.add_parser("target", help="fetch or describe a target model",
                       description="Materialise a target into the local cache (fetch) or describe it (info).")
    tsub = p.add_subparsers(dest="target_command", metavar="ACTION", required=True)
    command(tsub, "fetch", TargetConfig, fetch, help="convert a built-in target once / validate a local HF directory",
            description="NAME: a built-in target (smollm2-135m) converted once into $EYAS_HOME/targets (default "
            "~/.cache/eyas); PATH: a local Hugging Face directory to validate. Prints the resolved path. Never "
            "downloads.")
    command(tsub, "info", TargetConfig, info, help="layers, hidden size, vocab, default aux layers, chat template",
            description="Describe a target: sizes, default aux layer ids [2, L//2, L-3] (HF hidden_states index), "
            "chat template yes/no, fingerprint.")


def fetch(cfg: TargetConfig) -> int:
    path = targets.resolve(cfg.target)
    emit(cfg, {"path": str(path)}, str(path))
    return 0


def info(cfg: TargetConfig) -> int:
    d = targets.info(targets.resolve(cfg.target))
    lines = [f"{k:22s} {v}" for k, v in d.items()]
    emit(cfg, d, "\n".join(lines))
    return 0
