"""`eyas doctor CKPT`: static, target-aware and dynamic contract checks of a drafter checkpoint.

Exit 0 when no finding is an error, 1 when any is (FindingsError after printing the
report), 2 for bad usage (EyasError).
"""

from __future__ import annotations

import json
from pathlib import Path

from eyas.doctor.findings import REGISTRY
from eyas.errors import EyasError, FindingsError
from eyas.formats.engines import SERVING
from eyas.stages.common import add_json_flag

ENGINE_CHOICES = (*SERVING, "all")


def register(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check a drafter checkpoint against every engine's contract",
        description="Static checks (keys each engine reads or skips, shapes, d2t/t2d, config vs weights, aux ids, "
                    "NaN/Inf, untrained weights, dtypes); with --target: sizes, embedding, aux ids against the "
                    "target's depth, engine support for its architecture; with --target and --prompts/--data: "
                    "step-0 accuracy and acceptance per engine reading, the variant that restores it, predicted "
                    "acceptance and engine flags. Exit 0: no errors, 1: errors found, 2: bad usage. "
                    f"Finding ids: {', '.join(sorted(REGISTRY))}.")
    p.add_argument("ckpt", type=Path, help="drafter checkpoint directory (eyas, SGLang, vLLM, speculators, EAGLE)")
    p.add_argument("--target", default=None, help="target model (built-in name or local HF directory)")
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="all", help="engine(s) to check against")
    p.add_argument("--data", type=Path, default=None, help="prepared data directory (vocabulary coverage; "
                   "prompts for the dynamic checks)")
    p.add_argument("--against", type=Path, default=None, help="vocab file or another checkpoint to compare "
                   "the draft vocabulary with")
    p.add_argument("--prompts", type=Path, nargs="+", action="extend", default=None, metavar="FILE",
                   help="prompt file(s) for the dynamic checks (needs --target), as for bench: several after "
                   "one flag, or the flag repeated")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts used by the dynamic checks")
    p.add_argument("--new-tokens", type=int, default=32, help="target tokens generated per prompt")
    p.add_argument("--steps", type=int, default=5, help="draft steps measured (chain depth)")
    p.add_argument("--device", default="cpu", help="where the target runs for the embedding and dynamic checks: "
                   "cpu, cuda, cuda:N or auto (default cpu; the teacher-forced drafter checks run on the CPU)")
    p.add_argument("--no-decode", action="store_true", help="skip the real speculative-decoding cross-check "
                   "(eyas.runtime) of the dynamic checks")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args) -> int:
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
                           ("--new-tokens", args.new_tokens, 2)):
        if v < least:
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
                                 not args.no_decode, args.device))
    if getattr(args, "json", False):
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
