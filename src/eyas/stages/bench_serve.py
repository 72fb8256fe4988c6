"""`eyas bench --serve vllm`: the target served in real vLLM alone, with the drafter (EAGLE-3)
and with vLLM's model-free speculation (ngram; suffix where installed), at each concurrency level,
measured by vLLM's own counters; eyas's own runtime runs the same drafter, prompts and k beside
it (through `eyas.stages.bench.measure`). One run, one report (report.json, report.md, plots),
and the deployment line (eyas.serve.vllm_engine.deployment_line) chosen from what was measured.

Owns the orchestration and the report of that comparison. vLLM runs in child processes
(eyas.serve.vllm_serve), one engine start per configuration, each serving every level.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
from dataclasses import replace
from pathlib import Path

from eyas import targets
from eyas.errors import EyasError
from eyas.formats import checkpoint as ckpt_io
from eyas.formats import engines
from eyas.serve import vllm_engine
from eyas.serve.vllm_serve import ServeJob, serve
from eyas.stages import bench
from eyas.stages.common import atomic_dir, emit, provenance, refuse_out_over_inputs, write_json_atomic

log = logging.getLogger(__name__)

SERVE_METHODS = ("drafter", "ngram", "suffix")
PLAIN = "vllm plain"
NAMES = {"drafter": "vllm eagle3", "ngram": "vllm ngram", "suffix": "vllm suffix"}
DRAFTER_DIR = "vllm-drafter"  # where an eyas checkpoint is exported inside --out
CONTEXT_EDGES = (128, 256, 512, 1024, 2048, 4096)  # prompt-token buckets for acceptance by context length
DEFINITIONS = {
    "acceptance_length": "vLLM: 1 + spec_decode_num_accepted_tokens / spec_decode_num_drafts (its own counters); "
                         "eyas: mean over verification steps of (accepted drafts + 1) - the same quantity",
    "acceptance_by_position": "share of drafts (verification steps) whose first i+1 draft tokens were accepted",
    "concurrency": "requests in flight: the prompts cycled to at least N requests, N admitted at once and a new "
                   "one as each finishes (continuous batching); 1 = one request at a time",
    "tokens_per_s": "generated tokens of the level / its wall time (engine started and warmed up before)",
    "speedup": "tokens/s / tokens/s of vLLM plain at the same concurrency",
    "mismatches": "greedy outputs differing token for token from vLLM plain's for the same request",
}


def suffix_unavailable() -> str | None:
    """Why vLLM's suffix decoding cannot run here, or None."""
    if importlib.util.find_spec("arctic_inference") is None:
        return ("vLLM's suffix decoding needs the arctic-inference package (pip install arctic-inference), "
                "which is not installed")
    return None


def parse_concurrency(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError as e:
        raise EyasError(f"--concurrency {spec!r}: expected a comma list of positive integers, e.g. 1,4,16") from e
    if not levels or min(levels) < 1:
        raise EyasError(f"--concurrency {spec!r}: expected a comma list of positive integers, e.g. 1,4,16")
    return sorted(set(levels))


def serve_methods(args) -> list[str]:
    """The engine methods to run beside vLLM plain (validated)."""
    if args.serve_methods is None:
        wanted = (["drafter"] if args.drafter else []) + ["ngram"] + ([] if suffix_unavailable() else ["suffix"])
    else:
        wanted = [m.strip() for m in args.serve_methods.split(",") if m.strip()]
    bad = [m for m in wanted if m not in SERVE_METHODS]
    if bad:
        raise EyasError(f"--serve-methods: unknown {bad}; use a comma list of {', '.join(SERVE_METHODS)}")
    if "drafter" in wanted and not args.drafter:
        raise EyasError("--serve-methods drafter needs --drafter (an eyas checkpoint, run, or vllm export)")
    if "suffix" in wanted and suffix_unavailable():
        raise EyasError(f"--serve-methods suffix: {suffix_unavailable()}; install it or drop suffix")
    return list(dict.fromkeys(wanted))


def check_serve_args(args: bench.BenchConfig) -> tuple[bench.BenchConfig, list[int], list[str]]:
    """(the resolved config, concurrency levels, engine methods); bad --serve usage exits 2 before
    anything starts."""
    args = bench.resolve(args)
    if args.drafter and len(args.drafter) > 1:
        raise EyasError("--serve benches one --drafter per run (vLLM serves one drafter); run it once per drafter")
    if args.temperature > 0:
        raise EyasError(f"--temperature {args.temperature} with --serve: the real-engine bench runs greedy "
                        "(outputs are compared with vLLM plain); drop --temperature")
    if args.dtype not in vllm_engine.DTYPES:
        raise EyasError(f"--dtype {args.dtype} with --serve: vLLM runs {', '.join(vllm_engine.DTYPES)}")
    vllm_engine.require()
    return args, parse_concurrency(args.concurrency), serve_methods(args)


# ---------------------------------------------------------------- the drafter


def drafter_sides(path: Path, tmp: Path, final: Path, target: Path, args) -> dict:
    """How each side gets the drafter: {eyas: (dir, engine) for eyas's runtime, served: the
    directory vLLM loads now, deployed: its path once --out is in place, exported: bool}.
    An eyas checkpoint (or a run: its best/, else final/) is exported to the vllm layout in --out."""
    from eyas.stages import export

    path, picked = ckpt_io.resolve_drafter(Path(path))
    if ckpt_io.is_eyas_checkpoint(path):
        ckpt = path
        export.write_export(ckpt, "eyas", "vllm", tmp / DRAFTER_DIR, target=str(target), args=args)
        log.info("exported %s (%s) to the vllm layout: %s", ckpt, picked, final / DRAFTER_DIR)
        return {"eyas": (ckpt, "eyas"), "served": tmp / DRAFTER_DIR, "deployed": final / DRAFTER_DIR,
                "exported": True, "source": str(ckpt)}
    layout = engines.detect_layout(path)
    if "vllm" not in engines.native_engines(layout):
        raise EyasError(f"--drafter {path}: layout {layout}; --serve vllm takes an eyas checkpoint or run, or a "
                        f"vllm / speculators export (eyas convert {path} --to vllm --out DIR)")
    # eyas's runtime reads a foreign layout the way vLLM would load it (its emulation, --engine vllm)
    return {"eyas": (path, "vllm"), "served": path.resolve(), "deployed": path.resolve(), "exported": False,
            "source": str(path)}


# ---------------------------------------------------------------- running


def eyas_side(args, drafter: tuple[Path, str] | None):
    """eyas's runtime on the same prompts and k: `eyas bench`'s own measurement (plain + chain)."""
    # the engine drafts its full budget: so does eyas here unless told otherwise
    a = replace(args, serve=None, draft_cutoff=0.0 if args.draft_cutoff is None else args.draft_cutoff)
    if drafter:
        a = replace(a, drafter=[str(drafter[0])], engine=drafter[1])
    report, results, prompts, tok = bench.measure(a)
    gc.collect()  # the target's weights go before vLLM starts
    return report, results, prompts, tok


def jobs(args, target: Path, prompts: list[dict], levels: list[int], methods: list[str],
         spec_cfg: dict | None) -> list[ServeJob]:
    longest = max(int(p["ids"].numel()) for p in prompts)
    common = dict(target=str(target), prompts=[p["ids"].tolist() for p in prompts],
                  max_new_tokens=args.max_new_tokens, concurrency=levels, dtype=args.dtype,
                  enforce_eager=args.eager, seed=args.seed,
                  max_model_len=longest + args.max_new_tokens + args.k + 64)
    out = [ServeJob(name="plain", **common)]
    for m in methods:
        cfg = spec_cfg if m == "drafter" else {"method": m, "num_speculative_tokens": args.k}
        out.append(ServeJob(name=m, speculative_config=cfg, **common))
    return out


def run_jobs(job_list: list[ServeJob], workdir: Path) -> dict[str, dict]:
    from tqdm import tqdm

    out = {}
    for job in job_list:
        total = sum(max(len(job.prompts), c) for c in job.concurrency)
        with tqdm(total=total, desc=f"vllm {job.name}", unit="req",
                  disable=os.environ.get("EYAS_NO_PROGRESS") == "1") as bar:
            out[job.name] = serve(job, workdir, on_request=lambda: bar.update(1))
        log.info("vllm %s: engine started in %.0f s", job.name, out[job.name]["start_s"])
    return out


# ---------------------------------------------------------------- the report


def level_stats(level: dict, plain: dict) -> dict:
    st = {k: level[k] for k in ("concurrency", "requests", "tokens", "wall_s", "tokens_per_s")}
    st["speedup"] = level["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
    for k in ("acceptance_length", "acceptance_by_position", "drafts"):
        if k in level:
            st[k] = level[k]
    st["mismatches"] = sum(a != b for a, b in zip(level["outputs"], plain["outputs"]))
    return st


def crossover(levels: dict[str, dict]) -> tuple[int | None, int | None]:
    """(lowest concurrency where the method is slower than vLLM plain, the largest one below it)."""
    paying = None
    for c, st in sorted(levels.items(), key=lambda kv: int(kv[0])):
        if st["speedup"] < 1:
            return int(c), paying
        paying = int(c)
    return None, paying


def context_buckets(prompts: list[dict], served: dict[str, list[dict]]) -> dict:
    """Acceptance per prompt-length bucket (one request at a time): {bucket: {method: {..}}}.
    `served`: method -> per-prompt [{drafts, accepted}]."""
    def bucket(n: int) -> str:
        lo = 0
        for hi in CONTEXT_EDGES:
            if n < hi:
                return f"{lo}-{hi - 1}"
            lo = hi
        return f">={lo}"

    out: dict[str, dict] = {}
    for i, p in enumerate(prompts):
        b = bucket(int(p["ids"].numel()))
        for m, rows in served.items():
            cell = out.setdefault(b, {}).setdefault(m, {"prompts": 0, "drafts": 0, "accepted": 0})
            cell["prompts"] += 1
            cell["drafts"] += rows[i].get("drafts", 0)
            cell["accepted"] += rows[i].get("accepted", 0)
    for row in out.values():
        for cell in row.values():
            cell["acceptance_length"] = 1 + cell["accepted"] / cell["drafts"] if cell["drafts"] else None
    order = {f"{lo}-{hi - 1}": i for i, (lo, hi) in enumerate(zip((0,) + CONTEXT_EDGES, CONTEXT_EDGES))}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def eyas_rows(results: list[dict]) -> list[dict]:
    return [{"drafts": len(r["accepted"]), "accepted": sum(r["accepted"])} for r in results]


def eyas_methods(ereport: dict, eresults: dict, vplain: dict) -> dict:
    """eyas's runtime at one request in flight, against vLLM plain's outputs and tokens/s."""
    out = {}
    plain1 = vplain["levels"]["1"] if "1" in vplain["levels"] else None
    for m, st in ereport["summary"]["methods"].items():
        row = {k: st[k] for k in ("tokens", "wall_s", "tokens_per_s", "acceptance_length", "acceptance_by_position")
               if k in st}
        row["speedup_vs_eyas_plain"] = st["speedup"]
        if plain1:
            row["speedup"] = st["tokens_per_s"] / plain1["tokens_per_s"] if plain1["tokens_per_s"] else 0.0
            row["mismatches"] = sum(r["tokens"] != o for r, o in zip(eresults[m], plain1["outputs"]))
        out[f"eyas {m}"] = row
    return out


def build_report(args, prompts, levels, served: dict[str, dict], ereport, eresults, drafter: dict | None,
                 target: Path) -> dict:
    plain = served["plain"]
    vplain = {"levels": {str(lv["concurrency"]): lv for lv in plain["levels"]}}
    methods = {}
    for name, res in served.items():
        label = PLAIN if name == "plain" else NAMES[name]
        methods[label] = {"speculative_config": res["speculative_config"], "engine_start_s": res["start_s"],
                          "levels": {str(lv["concurrency"]): level_stats(lv, vplain["levels"][str(lv["concurrency"])])
                                     for lv in res["levels"]}}
    eyas = eyas_methods(ereport, eresults, vplain)
    summary = {"engine": "vllm", "vllm": plain["vllm"], "target": str(target), "drafter": drafter and drafter["source"],
               "served_drafter": drafter and str(drafter["deployed"]), "dtype": args.dtype,
               "compiled": not args.eager, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "k": args.k, "concurrency": levels, "methods": methods, "eyas": eyas,
               "eyas_draft_cutoff": ereport["summary"]["draft_cutoff"], "definitions": DEFINITIONS,
               "unsupported": {"suffix": suffix_unavailable()} if suffix_unavailable() else {}}
    spec = methods.get(NAMES["drafter"])
    if spec:
        cross, paying = crossover(spec["levels"])
        summary["crossover_concurrency"], summary["paying_up_to"] = cross, paying
    if 1 in levels:
        rows = {label: served[n]["levels"][0]["per_request"] for n, label in NAMES.items()
                if n in served and "per_request" in served[n]["levels"][0]}
        rows |= {f"eyas {m}": eyas_rows(r) for m, r in eresults.items() if bench.kind(m) in ("chain", "tree")}
        summary["acceptance_by_context"] = context_buckets(prompts, rows)
    return {"summary": summary, "provenance": provenance(args)}


def deployment(summary: dict, target: Path, drafter: dict) -> vllm_engine.DeploymentLine:
    """The line recommended from this run (or the one benched, when nothing could be measured)."""
    spec = summary["methods"][NAMES["drafter"]]["levels"]
    plain = summary["methods"][PLAIN]["levels"]
    measured = None
    one = spec.get("1")
    if one and one.get("acceptance_by_position"):
        measured = {"acceptance_by_position": one["acceptance_by_position"],
                    "acceptance_length": one["acceptance_length"], "speedup": one["speedup"], "k": summary["k"],
                    "crossover": summary.get("crossover_concurrency"), "paying_up_to": summary.get("paying_up_to")}
    if plain.get("1") is None:
        log.warning("no level at concurrency 1: the deployment line keeps k = %d", summary["k"])
    return vllm_engine.deployment_line(target, drafter["deployed"], dtype=summary["dtype"], measured=measured,
                                       k=summary["k"])


def stops_paying(summary: dict) -> str:
    cross = summary.get("crossover_concurrency")
    if NAMES["drafter"] not in summary["methods"]:
        return "no drafter served"
    if cross is None:
        return (f"the drafter paid at every measured concurrency (up to {max(summary['concurrency'])} requests in "
                "flight)")
    if cross == min(summary["concurrency"]):
        return f"the drafter was slower than vLLM plain already at {cross} request(s) in flight"
    return (f"speculation stops paying at {cross} requests in flight (the lowest measured concurrency where vLLM "
            f"with the drafter was slower than vLLM plain); it paid up to {summary['paying_up_to']}")


def _pos(acc: list[float] | None) -> str:
    return " ".join(f"{a:.2f}" for a in acc) if acc else "-"


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = ["# eyas bench --serve vllm\n",
             f"target `{s['target']}`, drafter `{s['drafter']}` (served from `{s['served_drafter']}`), vLLM "
             f"{s['vllm']} ({'compiled' if s['compiled'] else 'eager'}, prefix caching off), {s['dtype']}, greedy, "
             f"{s['prompts']} prompts, {s['max_new_tokens']} new tokens, k={s['k']}; eyas's runtime beside it at "
             f"one request in flight, draft cutoff {s['eyas_draft_cutoff']}\n",
             "| method | in flight | tok/s | speedup vs vLLM plain | acceptance length | per position | "
             "mismatches vs vLLM plain |", "|---|---|---|---|---|---|---|"]
    for r in table_rows(s):
        lines.append(f"| {r['method']} | {r['in_flight']} | {r['tok_s']} | {r['speedup']} | {r['accept']} | "
                     f"{r['per_position']} | {r['mismatches']} |")
    lines.append(f"\n**Where speculation stops paying:** {stops_paying(s)}.\n")
    if s.get("acceptance_by_context"):
        ms = sorted({m for row in s["acceptance_by_context"].values() for m in row})
        lines += ["## Acceptance by prompt length (tokens, one request at a time)\n",
                  "| prompt tokens | prompts | " + " | ".join(ms) + " |", "|---" * (len(ms) + 2) + "|"]
        for b, row in s["acceptance_by_context"].items():
            n = next(iter(row.values()))["prompts"]
            cells = [f"{row[m]['acceptance_length']:.2f}" if row.get(m, {}).get("acceptance_length") else "-"
                     for m in ms]
            lines.append(f"| {b} | {n} | " + " | ".join(cells) + " |")
    d = s.get("deployment")
    if d:
        lines += ["\n## Deployment line\n", d["rule"] + "\n", "```python", d["python"], "```", "```sh", d["cli"],
                  "```"] + [f"- {n}" for n in d["notes"]]
    lines.append("\n" + "\n".join(f"- {k}: {v}" for k, v in s["definitions"].items()))
    for m, why in s["unsupported"].items():
        lines.append(f"- not run: {m}: {why}")
    return "\n".join(lines) + "\n"


def table_rows(s: dict) -> list[dict[str, str]]:
    """The report's method rows as formatted cells, for report.md and the terminal alike: each
    method of the engine at each concurrency level, then eyas's runtime at one request in flight."""
    rows = []
    for m, row in s["methods"].items():
        for c, st in row["levels"].items():
            rows.append(_cells(m, c, st, str(st["mismatches"]) if m != PLAIN else "-"))
    for m, st in s["eyas"].items():
        rows.append(_cells(f"{m} (eyas runtime)", "1", st, str(st.get("mismatches", "-"))))
    return rows


def _cells(method: str, in_flight: str, st: dict, mismatches: str) -> dict[str, str]:
    return {"method": method, "in_flight": in_flight, "tok_s": f"{st['tokens_per_s']:.1f}",
            "speedup": f"{st['speedup']:.2f}x" if "speedup" in st else "-",
            "accept": f"{st['acceptance_length']:.2f}" if "acceptance_length" in st else "-",
            "per_position": _pos(st.get("acceptance_by_position")), "mismatches": mismatches}


def plots(out: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = {m: r["levels"].get("1", {}) for m, r in s["methods"].items()} | s["eyas"]
    for m, st in rows.items():
        acc = st.get("acceptance_by_position")
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{m} (τ={st['acceptance_length']:.2f})")
    ax.set(xlabel="draft position", ylabel="share of drafts accepted", ylim=(0, 1),
           title="Acceptance by position (one request in flight)")
    ax.legend() if ax.lines else ax.text(0.5, 0.5, "no speculation", ha="center")
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in s["methods"].items():
        cs = sorted(r["levels"], key=int)
        ax.plot([int(c) for c in cs], [r["levels"][c]["speedup"] for c in cs], marker="o", label=m)
    for m, st in s["eyas"].items():
        if "speedup" in st:
            ax.plot([1], [st["speedup"]], marker="*", ms=12, ls="", label=f"{m} (eyas runtime)")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="requests in flight", ylabel="tokens/s vs vLLM plain", title="Speedup by concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=100)
    plt.close(fig)


def human_summary(report: dict) -> str:
    s = report["summary"]
    rows = [f"{'method':22s} {'in flight':>9s} {'tok/s':>8s} {'speedup':>8s} {'accept':>7s} {'mismatch':>8s}"]
    for r in table_rows(s):
        name = r["method"].removesuffix(" (eyas runtime)")
        rows.append(f"{name:22s} {r['in_flight']:>9s} {r['tok_s']:>8s} {r['speedup']:>8s} {r['accept']:>7s} "
                    f"{r['mismatches']:>8}")
    rows.append(stops_paying(s))
    if s.get("deployment"):
        rows += ["deploy: " + s["deployment"]["cli"]]
    rows.append(f"report: {report['out']}/report.md")
    return "\n".join(rows)


def write_report(out: Path, report: dict, prompts: list[dict], served: dict, tok) -> None:
    plain1 = served["plain"]["levels"][0]
    per_prompt = [{"id": p["id"], "category": p["category"], "prompt_tokens": int(p["ids"].numel()),
                   **{NAMES.get(n, PLAIN): {k: v for k, v in r["levels"][0]["per_request"][i].items()}
                      for n, r in served.items() if "per_request" in r["levels"][0]}}
                  for i, p in enumerate(prompts)]
    write_json_atomic(out / "report.json", {**report, "per_prompt": per_prompt})
    (out / "report.md").write_text(markdown(report))
    write_json_atomic(out / "samples.json", [{"id": p["id"], "vllm plain": tok.decode(plain1["outputs"][i])}
                                             for i, p in enumerate(prompts[:5])])
    plots(out, report)


def run(args) -> int:
    """`eyas bench --serve vllm`."""
    args, levels, methods = check_serve_args(args)
    out = Path(args.out)
    refuse_out_over_inputs(out, {"--drafter": args.drafter, "--data": args.data, "--prompts": args.prompts,
                                 "--target": targets.local_dir(args.target)})
    target = targets.resolve(args.target)
    with atomic_dir(out, args.force) as tmp:
        drafter = drafter_sides(Path(args.drafter[0]), tmp, out.resolve(), target, args) if args.drafter else None
        ereport, eresults, prompts, tok = eyas_side(args, drafter and drafter["eyas"])
        # the drafter runs use the line eyas prints (export's default, with this run's k)
        spec_cfg = vllm_engine.deployment_line(target, drafter["served"], dtype=args.dtype, k=args.k) \
            .speculative_config if drafter else None
        served = run_jobs(jobs(args, target, prompts, levels, methods, spec_cfg), tmp / "vllm-logs")
        report = build_report(args, prompts, levels, served, ereport, eresults, drafter, target)
        s = report["summary"]
        if drafter and NAMES["drafter"] in s["methods"]:
            s["deployment"] = vars(deployment(s, target, drafter))
            s["benched_speculative_config"] = {**spec_cfg, "model": str(drafter["deployed"])}
        write_report(tmp, report, prompts, served, tok)
    report["out"] = str(out.resolve())
    mism = {m: st["mismatches"] for m, r in report["summary"]["methods"].items() for c, st in r["levels"].items()
            if c == "1" and m == NAMES["drafter"] and st["mismatches"]}
    if mism and args.dtype == "fp32":
        log.warning("vLLM with the drafter changed %s greedy output(s) of vLLM plain in fp32; see %s/report.json",
                    mism, report["out"])
    emit(args, report["summary"] | {"out": report["out"]}, human_summary(report))
    return 0
