"""`eyas target fetch | info`: materialise a target into the local cache, or describe it."""

from __future__ import annotations

from pathlib import Path

from eyas import targets
from eyas.stages.common import add_json_flag, emit


def register(sub) -> None:
    p = sub.add_parser("target", help="fetch or describe a target model",
                       description="Materialise a target into the local cache (fetch) or describe it (info).")
    tsub = p.add_subparsers(dest="target_command", metavar="ACTION", required=True)
    f = tsub.add_parser("fetch", help="convert a built-in target once / validate a local HF directory",
                        description="NAME: a built-in target (smollm2-135m) converted once into "
                        "$EYAS_HOME/targets (default ~/.cache/eyas); PATH: a local Hugging Face directory "
                        "to validate. Prints the resolved path. Never downloads.")
    f.add_argument("target", help="built-in name or local directory")
    add_json_flag(f)
    f.set_defaults(func=run_fetch)
    i = tsub.add_parser("info", help="layers, hidden size, vocab, default aux layers, chat template",
                        description="Describe a target: sizes, default aux layer ids [2, L//2, L-3] "
                        "(HF hidden_states index), chat template yes/no, fingerprint.")
    i.add_argument("target", help="built-in name or local directory")
    add_json_flag(i)
    i.set_defaults(func=run_info)


def run_fetch(args) -> int:
    path = targets.resolve(args.target)
    emit(args, {"path": str(path)}, str(path))
    return 0


def run_info(args) -> int:
    d = targets.info(targets.resolve(args.target))
    lines = [f"{k:22s} {v}" for k, v in d.items()]
    emit(args, d, "\n".join(lines))
    return 0
