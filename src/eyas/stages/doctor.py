"""`eyas doctor CKPT`: static, target-aware and dynamic contract checks of a drafter checkpoint.

Exit 0 when no finding is an error, 1 when any is (FindingsError after printing the
report), 2 for bad usage (EyasError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eyas.config import arg, command
from eyas.doctor.findings import REGISTRY
from eyas.errors import EyasError, FindingsError
from eyas.formats.engines import SERVING

ENGINE_CHOICES = (*SERVING, "all")


@dataclass(frozen=True, kw_only=True)
class DoctorConfig:
    """`eyas doctor`: what to check a drafter checkpoint against."""

    ckpt: Path = arg("drafter checkpoint directory (eyas, SGLang, vLLM, speculators, EAGLE)", positional=True)
    target: str | None = arg("target model (built-in name or local HF directory)", None)
    engine: str = arg("engine(s) to check against", "all", choices=ENGINE_CHOICES)
    data: Path | None = arg("prepared data directory (vocabulary coverage; prompts for the dynamic checks)", None)
    against: Path | None = arg("vocab file or another checkpoint to compare the draft vocabulary with", None)
    prompts: list[Path] | None = arg("prompt file(s) for the dynamic checks (needs --target), as for bench", None,
                                     metavar="FILE")
    max_model_len: int | None = arg("the context you serve at (vLLM's --max-model-len); default: the target's "
                                    "max_position_embeddings", None)
    num_prompts: int = arg("prompts used by the dynamic checks", 8)
    new_tokens: int = arg("target tokens generated per prompt", 32)
    steps: int = arg("draft steps measured (chain depth)", 5)
    device: str = arg("where the target runs for the embedding and dynamic checks: cpu, cuda, cuda:N or auto "
                      "(the teacher-forced drafter checks run on the CPU)", "cpu")
    no_decode: bool = arg("skip the real speculative-decoding cross-check (eyas.runtime) of the dynamic checks",
                          False)
    json: bool = arg("print a machine-readable JSON summary", False)


def register(sub) -> None:
    command(sub, "doctor", DoctorConfig, run, help="check a drafter checkpoint against every engine's contract",
            description="Static checks (keys each engine reads or skips, shapes, d2t/t2d, config vs weights, aux "
            "ids, NaN/Inf, untrained weights, dtypes); with --target: sizes, embedding, aux ids against the target's "
            "depth, engine support for its architecture; with --target and --prompts/--data: step-0 accuracy and "
            "acceptance per engine reading, the variant that restores it, predicted acceptance and engine flags. "
            f"Exit 0: no errors, 1: errors found, 2: bad usage. Finding ids: {', '.join(sorted(REGISTRY))}.")


def run(args: DoctorConfig) -> int:
    from eyas import targets
    from eyas.doctor.run import ALL_ENGINES, DoctorOptions, diagnose

    if not args.ckpt.is_dir():
        raise EyasError(f"{args.ckpt}: no such checkpoint directory; pass a drafter checkpoint directory")
    if args.prompts and not args.target:
        raise EyasError("--prompts needs --target (the dynamic checks run the target); add --target T")
    for f in args.prompts or []:
        if not f.exists():
            raise EyasError(f"--prompts {f}: no such file")
    if args.data is not None and not args.data.is_dir():
        raise EyasError(f"--data {args.data}: no such directory; pass a prepared data directory (eyas data prepare)")
    if args.against is not None and not args.against.exists():
        raise EyasError(f"--against {args.against}: no such file or directory")
    for flag, v, least in (("--num-prompts", args.num_prompts, 1), ("--steps", args.steps, 1),
                           ("--new-tokens", args.new_tokens, 2), ("--max-model-len", args.max_model_len, 1)):
        if v is not None and v < least:
            raise EyasError(f"{flag} {v}: must be >= {least}")
    targets.parse_device(args.device)  # a bad --device exits 2 before any work
    if args.target:  # the dynamic checks decode that many tokens per prompt, several times over
        room = targets.max_positions(targets.load_config(targets.resolve(args.target))) // 2
        if args.new_tokens > room:
            raise EyasError(f"--new-tokens {args.new_tokens}: at most {room} (half the target's positions; the "
                            "default 32 is enough to measure acceptance)")
    engines = ALL_ENGINES if args.engine == "all" else (args.engine,)
    rep = diagnose(DoctorOptions(args.ckpt, args.target, engines, args.engine != "all", args.data, args.against,
                                 args.prompts, args.num_prompts, args.new_tokens, args.steps,
                                 not args.no_decode, args.device, args.max_model_len))
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, default=_jsonable))
    else:
        print(rep.human())
    if rep.errors:
        raise FindingsError(f"{len(rep.errors)} error finding(s): {', '.join(sorted(set(rep.ids('error'))))}")
    return 0


def _jsonable(o):
    try:
        import torch

        if isinstance(o, torch.Tensor):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(o)
