"""`eyas bench`: real speculative decoding against baselines, interleaved prompt by prompt
on the same prompts, in one run, with one report (report.json, report.md, PNG plots).

Methods: `plain` (the target alone in eyas's loop, KV cache: the reference every speedup is
relative to), `hf` (transformers `generate()`), `pld` (HF prompt-lookup decoding), `chain`
(eyas, k drafts), `tree` (eyas, EAGLE-2 dynamic tree), and `chain+lookup` / `tree+lookup`
(the same draft plus a prompt-lookup branch, verified in the same forward).

`--serve vllm` measures in the real engine instead (eyas.stages.bench_serve): vLLM alone, with
the drafter and with its model-free speculation, at several concurrency levels, eyas's runtime
(this module's `measure`) beside it on the same prompts and k.

Acceptance length = mean over verification steps of (accepted draft tokens + 1): the number
of tokens one target forward produces. Per-position acceptance[i] = share of steps whose
first i+1 drafts (tree: depth i+1) were all accepted.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from eyas import targets
from eyas.config import arg, command
from eyas.errors import EyasError, FindingsError
from eyas.formats.engines import EYAS, RUNTIME_ENGINES
from eyas.stages.common import (atomic_dir, emit, provenance, refuse_out_over_inputs, resolve_dtype,
                               write_json_atomic)

log = logging.getLogger(__name__)

BASELINES = ("plain", "hf", "pld")
PLD_TOKENS = 10
LOOKUP = "+lookup"  # chain+lookup / tree+lookup: the drafter's draft plus a prompt-lookup branch
EYAS_METHODS = ("chain", "tree", "chain" + LOOKUP, "tree" + LOOKUP)
# 5 tokens: the +lookup branch's length that paid best (docs/cpu-performance.md, "The prompt-lookup branch")
LOOKUP_TOKENS = 5
# --methods when not given: under --engine emulation only what the engine serves (the drafter alone)
DEFAULT_METHODS = "chain,tree,tree" + LOOKUP
ENGINE_METHODS = "chain,tree"
# default --draft-cutoff on a CPU, fp32 and bf16 (docs/cpu-performance.md, "The draft cutoff")
CPU_CUTOFF = 0.1
CPU_BF16_CUTOFF = 0.05
ENGINES = RUNTIME_ENGINES
SERVE_CONCURRENCY = "1,4,16"  # --concurrency: one request at a time, a few, a busy server
SERVE_ENGINES = ("vllm",)  # real engines `--serve` can start (SGLang's CPU path needs a kernel not on PyPI)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """`eyas bench`: every method on the same prompts, interleaved, one report."""

    target: str = arg("built-in name or local HF directory", targets.DEFAULT_TARGET)
    drafter: list[str] | None = arg("drafter checkpoint or training run (its best/); omit for the baselines only; "
                                    "several: a paired comparison (methods named tree@NAME)", None, metavar="D")
    prompts: list[str] = arg("prompt files (json/jsonl/txt/parquet/arrow; first user turn, chat template applied) "
                             "or `builtin-eval` = the eval split of --data", ["builtin-eval"], metavar="FILE")
    data: Path | None = arg("prepared data directory (for --prompts builtin-eval)", None)
    max_new_tokens: int = arg("tokens generated per prompt and method", 128)
    max_prompt_tokens: int = arg("keep the last N prompt tokens", 1024)
    k: int = arg("chain length: drafts per verification step", 5)
    tree: str = arg("TOPK,DEPTH,TOKENS of the dynamic tree; TOKENS counts the root", "4,5,16")
    draft_cutoff: float | None = arg(f"drop drafts whose path probability under the drafter is below P (output "
                                     f"unchanged); default {CPU_CUTOFF} fp32 / {CPU_BF16_CUTOFF} bf16 on a CPU, else 0",
                                     None, metavar="P")
    methods: str | None = arg(f"comma list of chain, tree, chain+lookup, tree+lookup (+lookup: a prompt-lookup "
                              f"branch beside each draft); default {DEFAULT_METHODS}, with --engine sglang|vllm "
                              f"{ENGINE_METHODS}", None)
    lookup_tokens: int = arg("length of the +lookup branch", LOOKUP_TOKENS)
    temperature: float = arg("sampling temperature; 0 = greedy", 0.0)
    top_p: float = arg("nucleus sampling with --temperature > 0", 1.0)
    baselines: str | None = arg("comma list of plain, hf, pld (plain always runs; default plain,hf,pld, with "
                                "--serve plain)", None)
    engine: str = arg("run the checkpoint as eyas does, or as SGLang / vLLM would load and feed it", "eyas",
                      choices=ENGINES)
    serve: str | None = arg("serve the target in the real engine, plain, with the drafter and with its ngram method, "
                            "at each --concurrency; eyas's runtime beside it", None, choices=SERVE_ENGINES)
    concurrency: str | None = arg(f"with --serve: requests in flight, one level per number (default "
                                  f"{SERVE_CONCURRENCY})", None, metavar="N,..")
    serve_methods: str | None = arg("with --serve: comma list of drafter, ngram, suffix (needs arctic-inference); "
                                    "default: drafter (with --drafter), ngram, and suffix where installed", None,
                                    metavar="M,..")
    eager: bool = arg("with --serve: skip vLLM's compilation (enforce_eager); default compiled", False)
    dtype: str = arg("fp32 (greedy output checked token for token against plain decoding), bf16, or auto "
                     "(what this machine decodes fastest)", "fp32", choices=("fp32", "bf16", "auto"))
    device: str = arg("cpu, cuda, cuda:N or auto", "cpu")
    no_prepack: bool = arg("keep PyTorch's plain CPU linear layers (default in fp32 on a CPU: prepacked weights, "
                           "same outputs)", False)
    threads: int | None = arg("torch CPU threads (default: torch's; on a shared CPU 1 avoids OpenMP stalls)", None)
    limit: int | None = arg("use N prompts, taken round-robin across categories in file order", None)
    repeats: int = arg("run every method R times per prompt (order rotated) and keep the median run", 1)
    seed: int = arg("sampling seed", 0)
    out: Path = arg("report directory", Path("bench-report"))
    force: bool = arg("replace a non-empty --out", False)
    json: bool = arg("print a machine-readable JSON summary", False)


def register(sub) -> None:
    command(sub, "bench", BenchConfig, run, help="speculative decoding vs baselines on the same prompts, one "
            "report", description=__doc__.split("\n\n")[0] + " Acceptance length = mean over verification "
            "steps of (accepted drafts + 1).")


# ---------------------------------------------------------------- inputs


def default_cutoff(device: torch.device, dtype: torch.dtype, engine: str = "eyas") -> float:
    """`--draft-cutoff` unless given. On a CPU, where each verified token costs: CPU_CUTOFF in fp32,
    CPU_BF16_CUTOFF in bf16 (on AMX many tokens verify for little more than one, so the cutoff pays
    by the draft steps it saves, at a lower probability). Else 0: on a GPU verification and draft
    steps cost little (launch-bound), and no cutoff was measured there. An emulated engine
    (`--engine sglang|vllm`) drafts its full budget, as the engine does."""
    if engine != EYAS or torch.device(device).type != "cpu":
        return 0.0
    return {torch.float32: CPU_CUTOFF, torch.bfloat16: CPU_BF16_CUTOFF}.get(dtype, 0.0)


def parse_tree(spec: str) -> tuple[int, int, int]:
    try:
        topk, depth, tokens = (int(x) for x in spec.split(","))
    except ValueError as e:
        raise EyasError(f"--tree {spec!r}: expected TOPK,DEPTH,TOKENS such as 4,5,16") from e
    if topk < 1 or depth < 1 or tokens < 2:
        raise EyasError(f"--tree {spec!r}: need TOPK >= 1, DEPTH >= 1, TOKENS >= 2")
    return topk, depth, tokens


def load_prompts(args: BenchConfig, tok) -> list[dict]:
    """[{id, category, ids (LongTensor)}] from prompt files or the eval split of --data (the config's
    prompts, data, limit and max_prompt_tokens)."""
    if args.prompts == ["builtin-eval"]:
        if not args.data:
            raise EyasError("--prompts builtin-eval needs --data DIR (a prepared data directory)")
        from eyas.formats.data import read_samples

        items = [(s.id, s.category, _first_user(s.messages)) for s in read_samples(Path(args.data), "eval")]
    else:
        from eyas.formats.prompts import load_prompt_files

        convs = load_prompt_files([Path(p) for p in args.prompts], flag="--prompts", keywords=("builtin-eval",))
        items = [(c.id, c.category, (c.user_turns or [""])[0]) for c in convs]
    items = spread([it for it in items if it[2].strip()], args.limit)
    if not items:
        where = f"the eval split of --data {args.data} (prepare it with --eval-fraction > 0)" \
            if args.prompts == ["builtin-eval"] else "those files"
        raise EyasError(f"--prompts {' '.join(args.prompts)}: no prompt with a user turn in {where}")
    return [{"id": i, "category": c, "ids": render(tok, text, args.max_prompt_tokens)} for i, c, text in items]


def spread(items: list[tuple], limit: int | None) -> list[tuple]:
    """The first `limit` items taken round-robin across categories (item[1]), each category in
    file order, so a limited bench covers every category instead of the file's first one."""
    if not limit or limit >= len(items):
        return items
    groups: dict[str, list[tuple]] = {}
    for it in items:
        groups.setdefault(it[1], []).append(it)
    out: list[tuple] = []
    for row in range(max(len(g) for g in groups.values())):
        out += [g[row] for g in groups.values() if row < len(g)]
    return out[:limit]


def _first_user(messages: list[dict]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def render(tok, text: str, max_tokens: int) -> torch.Tensor:
    """One user turn -> prompt ids with the chat template and the generation prompt."""
    msgs = [{"role": "user", "content": text}]
    if getattr(tok, "chat_template", None):
        s = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(s, add_special_tokens=False)["input_ids"]
    else:
        ids = tok(text)["input_ids"]
    return torch.tensor(ids[-max_tokens:], dtype=torch.long)


def eos_ids(model, tok) -> tuple[int, ...]:
    e = getattr(model.generation_config, "eos_token_id", None)
    e = e if e is not None else tok.eos_token_id
    return tuple(e) if isinstance(e, (list, tuple)) else ((e,) if e is not None else ())


# ---------------------------------------------------------------- running


def run_hf(model, prompt: torch.Tensor, s: runtime.DecodeSettings, pld: bool, device) -> dict:
    kw = dict(max_new_tokens=s.max_new_tokens, eos_token_id=list(s.eos_ids) or None,
              pad_token_id=(s.eos_ids or (0,))[0])
    if s.temperature > 0:
        kw.update(do_sample=True, temperature=s.temperature, top_p=s.top_p)
    else:
        kw.update(do_sample=False)
    if pld:
        kw["prompt_lookup_num_tokens"] = PLD_TOKENS
    ids = prompt[None].to(device)
    torch.manual_seed(s.seed)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"tokens": out[0, prompt.shape[0]:].tolist(), "wall_s": wall, "target_s": wall, "drafter_s": 0.0,
            "accepted": [], "first_drafts": []}


def run_one(method: str, model, tr, dr, prompt, s: runtime.DecodeSettings, device) -> dict:
    from eyas import runtime

    if kind(method) in ("hf", "pld"):
        return run_hf(model, prompt, s, kind(method) == "pld", device)
    lookup = s.lookup if method.partition("@")[0].endswith(LOOKUP) else 0
    with torch.inference_mode():
        r = runtime.generate(tr, dr, prompt, runtime.DecodeSettings(**{**s.__dict__, "method": kind(method),
                                                                       "lookup": lookup}))
    return {"tokens": r.tokens, "wall_s": r.wall_s, "target_s": r.target_s, "drafter_s": r.drafter_s,
            "accepted": r.accepted, "first_drafts": r.first_drafts}


def drafter_names(paths: list[str]) -> list[str]:
    """Short unique names for several --drafter paths: the checkpoint directory's name (`RUN` for
    RUN/final, `RUN/best` for RUN/best), with more of the path where two would agree."""
    parts = [Path(p).resolve().parts for p in paths]
    if len(set(parts)) < len(parts):
        raise EyasError("--drafter: the same checkpoint is named twice; bench each drafter once")

    def name(ps: tuple[str, ...], k: int) -> str:
        if ps[-1] == "final" and len(ps) > 1:
            ps = ps[:-1]
        elif ps[-1] == "best":
            k += 1
        return "/".join(ps[-k:])

    depth = [1] * len(parts)
    while True:
        names = [name(ps, k) for ps, k in zip(parts, depth)]
        clash = [i for i, n in enumerate(names) if names.count(n) > 1]
        if not clash:
            return names
        for i in clash:
            depth[i] += 1


def method_list(args, names: list[str]) -> list[str]:
    """The baselines, then chain / tree per drafter: `tree` for one drafter, `tree@NAME` for several."""
    base = [b.strip() for b in args.baselines.split(",") if b.strip()]
    bad = [b for b in base if b not in BASELINES]
    if bad:
        raise EyasError(f"--baselines: unknown {bad}; use a comma list of {', '.join(BASELINES)}")
    eyas = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in eyas if m not in EYAS_METHODS]
    if bad:
        raise EyasError(f"--methods: unknown {bad}; use a comma list of {', '.join(EYAS_METHODS)}")
    grafted = [m for m in eyas if m.endswith(LOOKUP)]
    if grafted and args.engine != EYAS:
        raise EyasError(f"--methods {','.join(grafted)} with --engine {args.engine}: {args.engine} serves the drafter "
                        f"without a prompt-lookup branch; use --methods {ENGINE_METHODS} (or --engine eyas)")
    for flag, given in (("--baselines", base), ("--methods", eyas)):
        twice = sorted({m for m in given if given.count(m) > 1})
        if twice:  # a method run twice per prompt would shift every per-prompt figure after it
            raise EyasError(f"{flag}: {', '.join(twice)} named twice; name each method once")
    out = ["plain"] + [b for b in base if b != "plain"]
    return out + [m if len(names) == 1 else f"{m}@{n}" for n in names for m in eyas]


def drafter_of(method: str, names: list[str]) -> str | None:
    """The drafter name a bench method runs with (None for the baselines)."""
    if kind(method) not in ("chain", "tree"):
        return None
    return method.partition("@")[2] or names[0]


def kind(method: str) -> str:
    """The runtime method of a bench method name: `tree@NAME`, `tree+lookup@NAME` -> `tree`."""
    return method.partition("@")[0].removesuffix(LOOKUP)


def resolve(cfg: BenchConfig) -> BenchConfig:
    """The config with its defaults that depend on other flags filled in (--methods, --baselines,
    --concurrency); exits 2 (EyasError) on numbers bench cannot run with, before the target loads."""
    serve = cfg.serve is not None
    if cfg.methods is None:  # a real engine serves a chain: eyas's runtime runs the same beside it
        cfg = replace(cfg, methods="chain" if serve else DEFAULT_METHODS if cfg.engine == EYAS else ENGINE_METHODS)
    if cfg.baselines is None:
        cfg = replace(cfg, baselines="plain" if serve else "plain,hf,pld")
    if not serve:
        given = [f for f, v in (("--concurrency", cfg.concurrency), ("--serve-methods", cfg.serve_methods),
                                ("--eager", cfg.eager)) if v]
        if given:
            raise EyasError(f"{', '.join(given)}: only with --serve vllm (the real engine); add it, or drop them")
    elif cfg.concurrency is None:
        cfg = replace(cfg, concurrency=SERVE_CONCURRENCY)
    method_list(cfg, [])  # unknown, repeated or engine-less methods and baselines
    for flag, v in (("--k", cfg.k), ("--max-new-tokens", cfg.max_new_tokens), ("--limit", cfg.limit),
                    ("--threads", cfg.threads), ("--max-prompt-tokens", cfg.max_prompt_tokens),
                    ("--repeats", cfg.repeats), ("--lookup-tokens", cfg.lookup_tokens)):
        if v is not None and v < 1:
            raise EyasError(f"{flag} {v}: must be a positive integer")
    if not 0 <= cfg.temperature < math.inf:
        raise EyasError(f"--temperature {cfg.temperature}: must be a finite number >= 0 (0 = greedy), e.g. 0.7")
    if not 0 < cfg.top_p <= 1:
        raise EyasError(f"--top-p {cfg.top_p}: must lie in (0, 1], e.g. 0.95")
    if cfg.draft_cutoff is not None and not 0 <= cfg.draft_cutoff < 1:
        raise EyasError(f"--draft-cutoff {cfg.draft_cutoff}: must lie in [0, 1), e.g. {CPU_CUTOFF}")
    if cfg.drafter:
        drafter_names(cfg.drafter)  # the same checkpoint twice
    if cfg.drafter and not [m for m in cfg.methods.split(",") if m.strip()]:
        raise EyasError("--methods is empty: with --drafter, run chain and/or tree (e.g. --methods chain,tree)")
    return cfg


def run(cfg: BenchConfig) -> int:
    cfg = resolve_dtype(cfg, targets.decode_dtype)  # --dtype auto: what this machine decodes fastest
    if cfg.serve:  # the real engine: eyas.stages.bench_serve drives it
        from eyas.stages import bench_serve

        return bench_serve.run(cfg)
    if cfg.drafter:  # a training run stands for its best/ (else final/), as in every command taking a drafter
        from eyas.formats.checkpoint import resolve_drafter

        cfg = replace(cfg, drafter=[str(resolve_drafter(Path(p))[0]) for p in cfg.drafter])
    cfg = resolve(cfg)
    refuse_out_over_inputs(cfg.out, {"--drafter": cfg.drafter, "--data": cfg.data, "--prompts": cfg.prompts,
                                     "--target": targets.local_dir(cfg.target)})
    report, results, prompts, tok = measure(cfg)
    with atomic_dir(Path(cfg.out), cfg.force) as tmp:
        write_report(tmp, report, results, prompts, tok)
    report["out"] = str(Path(cfg.out).resolve())
    emit(cfg, report["summary"] | {"out": report["out"]}, human_summary(report))
    mism = report["summary"].get("greedy_mismatches")
    if cfg.dtype == "fp32" and cfg.temperature <= 0 and mism:
        raise FindingsError(f"eyas greedy output differs from plain greedy decoding on {mism} prompt(s) in fp32; "
                            f"see {report['out']}/report.json (a runtime bug: please report it)")
    return 0


def measure(args: BenchConfig) -> tuple[dict, dict[str, list[dict]], list[dict], object]:
    """Load the target and drafters, run every method on every prompt: (report, results, prompts,
    tokenizer). `args` as `resolve` returns it; nothing is written."""
    from eyas import runtime

    device = targets.parse_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    tdir = targets.resolve(args.target)
    model, tok = targets.load(tdir, dtype=args.dtype, device=str(device))
    prompts = load_prompts(args, tok)
    limit = targets.max_positions(model.config)
    room = limit - max(p["ids"].numel() for p in prompts) - parse_tree(args.tree)[2] - args.k - args.lookup_tokens - 2
    if args.max_new_tokens > room:
        raise EyasError(f"--max-new-tokens {args.max_new_tokens}: the longest prompt leaves room for {max(room, 0)} "
                        f"new tokens within the target's {limit} positions; lower it (or --max-prompt-tokens)")
    names = drafter_names(args.drafter or [])
    drafters: dict[str, runtime.LoadedDrafter] = {}
    for name, path in zip(names, args.drafter or []):
        other = targets.trained_for_other(Path(path), tdir)
        if other:
            log.warning("%s (config or tokenizer differ); benching it anyway", other)
        drafters[name] = runtime.load_drafter(Path(path), model, args.engine, model.dtype, args.seed, tdir)
    methods = method_list(args, names)
    packed, drafter_weights = 0, None
    if not args.no_prepack:  # every method, hf and pld included, runs on the packed target
        packed = targets.prepack_for_decoding(model)
        for loaded in drafters.values():  # the target verifies every draft: fp16 drafter weights cost no exactness
            n = targets.prepack_for_decoding(loaded.drafter, weights="fp16")
            drafter_weights = "fp16" if n else drafter_weights
            packed += n or targets.prepack_for_decoding(loaded.drafter)
    cutoff = args.draft_cutoff if args.draft_cutoff is not None else default_cutoff(device, model.dtype, args.engine)
    s = runtime.DecodeSettings(k=args.k, tree=parse_tree(args.tree), cutoff=cutoff, lookup=args.lookup_tokens,
                               temperature=args.temperature,
                               top_p=args.top_p, max_new_tokens=args.max_new_tokens, eos_ids=eos_ids(model, tok),
                               seed=args.seed)
    timer = runtime.Timer(device)
    pairs = {n: runtime.runners(model, d, timer) for n, d in drafters.items()}  # name -> (target, drafter runner)
    base = next(iter(pairs.values()), None) or runtime.runners(model, None, timer)
    by_method = {m: pairs[drafter_of(m, names)] if kind(m) in ("chain", "tree") else base for m in methods}
    results = bench_loop(methods, model, by_method, prompts, s, device, args.repeats)
    report = build_report(args, methods, prompts, results, s, drafters, tdir)
    report["summary"]["prepacked_linears"] = packed
    report["summary"]["drafter_weights"] = drafter_weights or \
        (str(model.dtype).removeprefix("torch.") if drafters else None)
    if drafters and s.temperature <= 0:
        from eyas.formats.metrics import last_eval

        gap = {}
        for name, path in zip(names, args.drafter):
            tr, dr = pairs[name]
            mine = [m for m in methods if drafter_of(m, names) == name]
            gap |= first_draft_gap(tr, dr, prompts, results, mine, s, last_eval(Path(path).parent))
        report["summary"]["first_draft_gap"] = gap
    return report, results, prompts, tok


def bench_loop(methods, model, runners: dict, prompts, s, device, repeats: int = 1) -> dict[str, list[dict]]:
    """Every method on every prompt, interleaved prompt by prompt (same machine state); `runners`
    gives each method its (target runner, drafter runner or None). With
    repeats R > 1 each prompt runs every method R times, the method order rotated by one each
    time, and keeps each method's run of median wall time per token (the lower middle one for even
    R; its walls in `wall_s_runs`): one stall of the machine then lands in a discarded run. Every
    run is seeded alike (`s.seed`), so repeats decode the same tokens up to nondeterministic kernels."""
    from tqdm import tqdm

    from eyas import runtime

    warm = runtime.DecodeSettings(**{**s.__dict__, "max_new_tokens": 4})
    for m in methods:  # warm-up: first-call costs (allocations, kernels) stay out of the numbers
        run_one(m, model, *runners[m], prompts[0]["ids"], warm, device)
    results: dict[str, list[dict]] = {m: [] for m in methods}
    bar = tqdm(prompts, desc="bench", unit="prompt", disable=os.environ.get("EYAS_NO_PROGRESS") == "1")
    for p in bar:
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for r in range(repeats):
            for m in methods[r % len(methods):] + methods[:r % len(methods)]:
                runs[m].append(run_one(m, model, *runners[m], p["ids"], s, device))
        for m in methods:
            kept = sorted(runs[m], key=lambda x: x["wall_s"] / max(1, len(x["tokens"])))[(repeats - 1) // 2]
            results[m].append(kept | ({"wall_s_runs": [x["wall_s"] for x in runs[m]]} if repeats > 1 else {}))
        done = {m: sum(len(r["tokens"]) for r in results[m]) / max(1e-9, sum(r["wall_s"] for r in results[m]))
                for m in methods}
        bar.set_postfix({m: f"{v:.1f}t/s" for m, v in done.items()})
    return results


# ---------------------------------------------------------------- report


def method_stats(rs: list[dict]) -> dict:
    toks = sum(len(r["tokens"]) for r in rs)
    wall = sum(r["wall_s"] for r in rs)
    tgt, dft = sum(r["target_s"] for r in rs), sum(r["drafter_s"] for r in rs)
    out = {"tokens": toks, "wall_s": round(wall, 4), "tokens_per_s": toks / wall if wall else 0.0,
           "time_split": {"target": tgt / wall if wall else 0.0, "drafter": dft / wall if wall else 0.0,
                          "overhead": max(0.0, 1 - (tgt + dft) / wall) if wall else 0.0}}
    steps = [a for r in rs for a in r["accepted"]]
    if steps:
        depth = max(steps + [1])
        out["verify_steps"] = len(steps)
        out["acceptance_length"] = sum(a + 1 for a in steps) / len(steps)
        out["acceptance_by_position"] = [sum(a > i for a in steps) / len(steps) for i in range(depth)]
    return out


def step_cost(st: dict, plain: dict) -> None:
    """Add `step_cost` to a speculative method's stats: the wall time of one of its verification
    steps in units of one plain decoding step (wall per plain token), in all and for the target's
    and the drafter's share. Speedup = tokens per step / step cost, and tokens per step is about the
    acceptance length: the drafter pays when it accepts more than the step costs."""
    if not st.get("verify_steps") or not plain["tokens"] or not plain["wall_s"]:
        return
    rel = st["wall_s"] / st["verify_steps"] / (plain["wall_s"] / plain["tokens"])
    st["step_cost"] = {"total": rel, "target": rel * st["time_split"]["target"],
                       "drafter": rel * st["time_split"]["drafter"]}


def build_report(args, methods, prompts, results, s, drafters: dict, tdir) -> dict:
    per = {m: method_stats(results[m]) for m in methods}
    base = per["plain"]["tokens_per_s"]
    for m in methods:
        per[m]["speedup"] = per[m]["tokens_per_s"] / base if base else 0.0
        step_cost(per[m], per["plain"])
    cats = sorted({p["category"] for p in prompts})
    by_cat = {}
    for c in cats:
        idx = [i for i, p in enumerate(prompts) if p["category"] == c]
        st = {m: method_stats([results[m][i] for i in idx]) for m in methods}
        by_cat[c] = {m: {"speedup": st[m]["tokens_per_s"] / st["plain"]["tokens_per_s"]
                         if st["plain"]["tokens_per_s"] else 0.0, "prompts": len(idx),
                         **({"acceptance_length": st[m]["acceptance_length"]} if "acceptance_length" in st[m] else {})}
                     for m in methods}
    plain = [r["tokens"] for r in results["plain"]]
    mism = {m: sum(r["tokens"] != t for r, t in zip(results[m], plain)) for m in methods if m != "plain"}
    greedy = s.temperature <= 0
    summary = {
        "target": str(tdir), "drafter": args.drafter[0] if len(drafters) == 1 else args.drafter,
        "engine": args.engine, "dtype": args.dtype,
        "device": args.device, "prompts": len(prompts), "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature, "top_p": s.top_p, "k": s.k, "tree": list(s.tree),
        "draft_cutoff": s.cutoff, "repeats": args.repeats,
        "plain_tokens_per_s": base,
        "methods": {m: {k: v for k, v in per[m].items()} for m in methods},
        "mismatches_vs_plain": mism if greedy else None,
        "greedy_mismatches": sum(v for m, v in mism.items() if kind(m) in ("chain", "tree")) if greedy else None,
        "definitions": {"acceptance_length": "mean over verification steps of (accepted draft tokens + 1)",
                        "acceptance_by_position": "share of verification steps whose first i+1 drafts "
                        "(tree: depth i+1) were accepted",
                        "speedup": "tokens/s of the method / tokens/s of plain (eyas loop, target alone)",
                        "step_cost": "wall time of one verification step (drafting + verifying) / wall time of "
                        "one plain decoding step, with the target's and the drafter's parts; speedup = tokens per "
                        "step / step cost, where tokens per step is the acceptance length plus each prompt's first "
                        "token (from the prefill) spread over its steps"},
    }
    if len(drafters) > 1:
        summary["drafters"] = dict(zip(drafters, args.drafter))
    if drafters:  # several: each line prefixed with its drafter's name
        tag = (lambda n: f"{n}: ") if len(drafters) > 1 else (lambda n: "")  # noqa: E731
        summary["engine_notes"] = [tag(n) + x for n, d in drafters.items() for x in d.notes]
        summary["engine_missing"] = [tag(n) + x for n, d in drafters.items() for x in d.missing]
        summary["engine_skipped"] = [tag(n) + x for n, d in drafters.items() for x in d.skipped]
    return {"summary": summary, "by_category": by_cat, "provenance": provenance(args)}


GAP_NOTE = ("Reading it: val acc_0 -> teacher-forced (all positions) is the change of text (validation split vs "
            "these prompts' greedy answers); all positions -> step starts is selection (a step starts right after "
            "a rejection or a fully accepted run, which over-samples hard positions); step starts -> served should "
            "be nothing but the draft cutoff (steps whose first draft it held back) and, with +lookup, the lookup "
            "branch. Chain's agreement compares the drafter's own served first drafts with its teacher-forced "
            "guesses at the same steps: below 1.0 (beyond bf16 rounding) the runtime feeds the drafter something "
            "training did not. Tree's served column counts any of the root's children (compare tf_topK_at_steps "
            "in report.json).")


def first_draft_gap(tr, dr, prompts, results, methods, s, val: dict | None) -> dict:
    """Why served first-draft acceptance differs from validation acc_0, in measured steps (greedy only).

    On each method's own output, the drafter's teacher-forced step-0 guesses (the target's features
    over the whole finished sequence, as training scores them) give top-1 accuracy over every
    drafted position (`tf_all`: validation text -> these prompts) and at the positions where
    verification steps started (`tf_at_steps`: steps start right after a rejection, so they
    over-sample hard positions). `served_first` is the share of those steps whose first draft the
    target accepted (with `+lookup`, the lookup branch's too). For chain, the drafter's own first
    draft of each step must be its teacher-forced guess (`agreement`, over the steps where the
    draft cutoff let it propose one: `proposed`), else the runtime feeds the drafter something
    training did not (the seeds' failure)."""
    from eyas import runtime

    in_vocab = torch.zeros(dr.vocab_size, dtype=torch.bool)
    in_vocab[dr.target_ids.cpu()] = True
    topk = s.tree[0]
    guesses: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # chain and tree mostly share outputs
    out = {}
    for m in (x for x in methods if kind(x) in ("chain", "tree")):
        all_hits, oov, served, tf1, tfk, same, proposed = [], [], [], [], [], [], []
        for j, (p, r) in enumerate(zip(prompts, results[m])):
            n0 = p["ids"].shape[0]
            seq = torch.cat([p["ids"], torch.tensor(r["tokens"], dtype=torch.long)])
            if seq.shape[0] - n0 < 2:
                continue
            key = (j, tuple(r["tokens"]))
            if key not in guesses:
                guesses[key] = runtime.teacher_forced(tr, dr, seq, topk)
            guess = guesses[key]  # row i guesses seq[i+2]
            truth = seq[2:]
            hit1, hitk = guess[:, 0] == truth, (guess == truth[:, None]).any(1)
            all_hits += hit1[n0 - 1:].tolist()
            oov += (~in_vocab[truth[n0 - 1:]]).tolist()
            n = n0
            for a, first in zip(r["accepted"], r["first_drafts"]):
                if n - 1 < truth.shape[0]:  # the step's first draft guessed a token that was kept
                    served.append(a >= 1)
                    tf1.append(bool(hit1[n - 1]))
                    tfk.append(bool(hitk[n - 1]))
                    proposed.append(first >= 0)
                    if first >= 0:
                        same.append(first == int(guess[n - 1, 0]))
                n += a + 1
        if not served:
            continue
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        g = {"val_acc_0": val.get("acc_0") if val else None, "tf_all": mean(all_hits),
             "tf_at_steps": mean(tf1), "served_first": mean(served), "steps": len(served),
             "positions": len(all_hits), "out_of_vocab": mean(oov)}
        if kind(m) == "chain":
            g["agreement"], g["proposed"] = (mean(same) if same else None), mean(proposed)
        else:
            g[f"tf_top{topk}_at_steps"] = mean(tfk)
        out[m] = g
    return out


def write_report(out: Path, report: dict, results, prompts, tok) -> None:
    per_prompt = [{"id": p["id"], "category": p["category"], "prompt_tokens": int(p["ids"].shape[0]),
                   **{m: {"tokens": len(results[m][i]["tokens"]), "wall_s": round(results[m][i]["wall_s"], 4),
                          **({"wall_s_runs": [round(w, 4) for w in results[m][i]["wall_s_runs"]]}
                             if "wall_s_runs" in results[m][i] else {}),
                          **({"acceptance_length": sum(a + 1 for a in results[m][i]["accepted"])
                              / len(results[m][i]["accepted"])} if results[m][i]["accepted"] else {})}
                      for m in results}}
                  for i, p in enumerate(prompts)]
    write_json_atomic(out / "report.json", {**report, "per_prompt": per_prompt})
    (out / "report.md").write_text(markdown(report))
    samples = [{"id": p["id"], "plain": tok.decode(results["plain"][i]["tokens"])} for i, p in enumerate(prompts[:5])]
    write_json_atomic(out / "samples.json", samples)
    plots(out, report)


def markdown(report: dict) -> str:
    s = report["summary"]
    who = ", ".join(f"{n} = `{d}`" for n, d in s["drafters"].items()) if s.get("drafters") else f"`{s['drafter']}`"
    lines = ["# eyas bench\n", f"target `{s['target']}`, drafter {who} (engine {s['engine']}), "
             f"{s['dtype']} on {s['device']}, {s['prompts']} prompts, {s['max_new_tokens']} new tokens, "
             f"temperature {s['temperature']}, chain k={s['k']}, tree topk,depth,tokens={s['tree']}, "
             + (f"draft cutoff {s['draft_cutoff']} (drafts below that path probability are not proposed, so "
                "acceptance lengths are of the pruned drafts; `--draft-cutoff 0` for the full budget), "
                if s.get("draft_cutoff") else "")
             + f"{s.get('prepacked_linears', 0)} linear layers prepacked (`--no-prepack`: 0)"
             + (", the drafter's in fp16 (fbgemm; the target verifies every draft)"
                if s.get("drafter_weights") == "fp16" else "")
             + (f", each method run {s['repeats']} times per prompt, the run of median wall time per token kept"
                if s.get("repeats", 1) > 1 else "") + "\n",
             "| method | tok/s | speedup vs plain | acceptance length | step cost (target + drafter) | target | "
             "drafter | overhead |",
             "|---|---|---|---|---|---|---|---|"]
    for m, st in s["methods"].items():
        ts = st["time_split"]
        al = f"{st['acceptance_length']:.2f}" if "acceptance_length" in st else "-"
        sc = st.get("step_cost")
        cost = f"{sc['total']:.2f} ({sc['target']:.2f} + {sc['drafter']:.2f})" if sc else "-"
        lines.append(f"| {m} | {st['tokens_per_s']:.1f} | {st['speedup']:.2f}x | {al} | {cost} | "
                     f"{ts['target']:.0%} | {ts['drafter']:.0%} | {ts['overhead']:.0%} |")
    lines.append("\n" + "\n".join(f"- {k}: {v}" for k, v in s["definitions"].items()))
    if s.get("mismatches_vs_plain") is not None:
        lines.append(f"- greedy outputs differing from plain (per method): {s['mismatches_vs_plain']}")
    if s.get("first_draft_gap"):
        lines += ["\n## First-draft acceptance: validation vs served\n",
                  "| method | val acc_0 | teacher-forced, all positions | teacher-forced, at step starts | "
                  "served | steps | chain agreement |", "|---|---|---|---|---|---|---|"]
        for m, g in s["first_draft_gap"].items():
            val = f"{g['val_acc_0']:.3f}" if g["val_acc_0"] is not None else "-"
            agree = f"{g['agreement']:.3f}" if g.get("agreement") is not None else "-"
            lines.append(f"| {m} | {val} | {g['tf_all']:.3f} | {g['tf_at_steps']:.3f} | {g['served_first']:.3f} | "
                         f"{g['steps']} | {agree} |")
        lines.append("\n" + GAP_NOTE)
    lines.append("\n## Speedup by category\n")
    methods = list(s["methods"])
    lines += ["| category | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for c, row in report["by_category"].items():
        speedups = " | ".join(f"{row[m]['speedup']:.2f}x" for m in methods)
        lines.append(f"| {c} ({row['plain']['prompts']}) | {speedups} |")
    for note in s.get("engine_notes") or []:
        lines.append(f"\n> engine: {note}")
    return "\n".join(lines) + "\n"


def plots(out: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, st in s["methods"].items():
        if "acceptance_by_position" in st:
            acc = st["acceptance_by_position"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{m} (τ={st['acceptance_length']:.2f})")
    ax.set(xlabel="draft position (tree: depth)", ylabel="share of steps accepted", ylim=(0, 1),
           title="Acceptance by position")
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no drafter", ha="center")
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=100)
    plt.close(fig)
    cats = list(report["by_category"])
    methods = list(s["methods"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) + 2), 4))
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax.bar([i + j * w for i in range(len(cats) + 1)],
               [report["by_category"][c][m]["speedup"] for c in cats] + [s["methods"][m]["speedup"]], w, label=m)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cats) + 1)], cats + ["all"], rotation=30)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="speedup vs plain", title="Speedup per method and prompt category")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)


def cutoff_note(cutoff: float) -> str:
    return (f"accept: of the drafts above the draft cutoff {cutoff} (the rest are never proposed); "
            "--draft-cutoff 0 measures the full budget")


def method_rows(methods: dict, draft_cutoff: float | None) -> list[str]:
    """The per-method table of a report's summary, as `eyas bench` and `eyas quickstart` print it."""
    w = max([8] + [len(m) for m in methods])
    rows = [f"{'method':{w}s} {'tok/s':>8s} {'speedup':>8s} {'accept':>7s} {'step cost':>10s} {'overhead':>9s}"]
    for m, st in methods.items():
        al = f"{st['acceptance_length']:.2f}" if st.get("acceptance_length") is not None else "-"
        cost = f"{st['step_cost']['total']:.2f}x" if st.get("step_cost") else "-"
        over = f"{st['time_split']['overhead']:.0%}" if st.get("time_split") else "-"
        rows.append(f"{m:{w}s} {st['tokens_per_s']:8.1f} {st['speedup']:7.2f}x {al:>7s} {cost:>10s} {over:>9s}")
    if any(st.get("step_cost") for st in methods.values()):
        rows.append("step cost: one verification step (drafting + verifying) in plain decoding steps; "
                    "speedup ~ accept / step cost")
    if draft_cutoff:
        rows.append(cutoff_note(draft_cutoff))
    return rows


def human_summary(report: dict) -> str:
    s = report["summary"]
    rows = method_rows(s["methods"], s.get("draft_cutoff"))
    if s.get("greedy_mismatches") is not None:
        rows.append(f"greedy mismatches vs plain: {s['mismatches_vs_plain']}")
    for m, g in (s.get("first_draft_gap") or {}).items():
        val = f"val {g['val_acc_0']:.3f} -> " if g["val_acc_0"] is not None else ""
        rows.append(f"{m} first draft: {val}teacher-forced {g['tf_all']:.3f} -> at step starts "
                    f"{g['tf_at_steps']:.3f} -> served {g['served_first']:.3f}")
    rows.append(f"report: {report['out']}/report.md")
    return "\n".join(rows)
