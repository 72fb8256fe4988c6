"""Serving token prompts in a real vLLM engine, in a child process, and reading vLLM's own counters.

Owns the serve job (what to serve and how many requests in flight), the child that runs it
(`python -m eyas.serve.vllm_serve JOB.json RESULT.json`) and the parent side that starts it and
follows its progress. vLLM runs in a child so that its worker processes (started with `spawn`),
its memory and its global state (Prometheus registry, compilation caches) stay out of the
caller: pytest, the eyas CLI, eyas's own runtime measured beside it.

One job = one engine start = one configuration (plain, eagle3, ngram, ...). Each concurrency
level C keeps C requests in flight: the prompts cycled to at least C requests, C admitted at
once and a new one as soon as one finishes (vLLM's continuous batching). At C = 1 the counters
are read after every request, so acceptance is also known per prompt.

Several jobs can share one child (`serve_series`), one `LLM` after another, because each start
costs tens of seconds of imports: each job ends as one `Outcome` (vLLM refused to start, failed
while serving, or served, with its counters), and a child that dies or hangs on one job is
recorded against that job and restarted for the rest. `serve` is the series of one job.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from eyas.errors import EyasError

log = logging.getLogger(__name__)

# vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py), summed over engines.
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
WARMUP_TOKENS = 8
REFUSES, FAILS, SERVES = "refuses", "fails", "serves"  # raised while starting | raised while serving | served
MARK = "=== eyas vllm_serve: "  # the child prints it before each job and once its engine started


@dataclass(frozen=True)
class ServeJob:
    """One vLLM configuration served on token prompts at several concurrency levels."""

    target: str  # local HF directory of the target
    prompts: list[list[int]]  # prompt token ids (chat template already applied)
    max_new_tokens: int
    concurrency: list[int] = field(default_factory=lambda: [1])
    dtype: str = "fp32"
    speculative_config: dict | None = None  # None = the target alone
    enforce_eager: bool = True
    max_model_len: int | None = None
    seed: int = 0
    name: str = "vllm"  # also names its log file: letters, digits, '-', '_', '.'
    ignore_eos: bool = False  # every request generates max_new_tokens (the same work for every drafter)


@dataclass
class Outcome:
    """What vLLM did with one job of a series."""

    name: str
    outcome: str  # REFUSES | FAILS | SERVES
    result: dict | None = None  # SERVES: `run_job`'s result
    error: str = ""  # REFUSES / FAILS: the engine's root-cause line
    seconds: float = 0.0

    @property
    def acceptance_length(self) -> float | None:
        """vLLM's acceptance length at the first concurrency level (None: not served, or no drafts)."""
        return self.result["levels"][0].get("acceptance_length") if self.result else None


# ---------------------------------------------------------------- parent side


def serve(job: ServeJob, workdir: Path, on_request: Callable[[], None] | None = None,
          timeout_s: float | None = None) -> dict:
    """Run `job` in a child process; returns its result (see `run_job`).

    The child's output (vLLM's logs) goes to WORKDIR/NAME.log; a job vLLM did not serve raises
    EyasError quoting its root cause and the log's last lines. `on_request` is called once per
    finished request (a progress bar).
    """
    o = serve_series([job], workdir, on_request, timeout_s)[0]
    if o.outcome != SERVES:
        log_file = workdir / f"{job.name}.log"
        tail = " | ".join(log_file.read_text(errors="replace").strip().splitlines()[-6:])
        when = "before serving" if o.outcome == REFUSES else "while serving"
        raise EyasError(f"vLLM ({job.name}) failed {when}: {o.error}; its log {log_file} ends: {tail}")
    return o.result


def serve_series(jobs: list[ServeJob], workdir: Path, on_request: Callable[[], None] | None = None,
                 timeout_s: float | None = None) -> list[Outcome]:
    """Run every job, one `LLM` after another in one child process; one Outcome per job, in order.

    A child that dies (or runs one job past `timeout_s`) has that job recorded as REFUSES (it died
    before its engine started) or FAILS (after), and a new child takes the jobs after it. Each
    job's share of the child's output is written to WORKDIR/NAME.log.
    """
    names = [j.name for j in jobs]
    assert len(set(names)) == len(names), f"job names must be unique: {names}"
    workdir.mkdir(parents=True, exist_ok=True)
    todo, done = list(jobs), {}
    while todo:
        got, rc, log_text = _run_child(todo, workdir, on_request, timeout_s)
        segments = _segments(log_text)
        for o in got:
            if o.outcome != SERVES:  # vLLM's exception says "see root cause above": the worker printed it
                o.error = root_cause(segments.get(o.name, "")) or o.error
            done[o.name] = o
        for name, text in segments.items():
            (workdir / f"{name}.log").write_text(text)
        todo = [j for j in todo if j.name not in done]
        if not todo:
            break
        bad = todo.pop(0)  # the child died (or hung) on this job
        if bad.name not in segments:
            raise EyasError(f"the vLLM child exited {rc} before it began {bad.name}; its log "
                            f"{workdir / 'series.log'} ends: " + " | ".join(log_text.strip().splitlines()[-6:]))
        started = MARK + "started " + bad.name in log_text
        why = root_cause(segments[bad.name]) or f"exit code {rc}, no error printed"
        done[bad.name] = Outcome(bad.name, FAILS if started else REFUSES, error=f"engine process died: {why}")
    return [done[n] for n in names]


def _run_child(jobs: list[ServeJob], workdir: Path, on_request: Callable[[], None] | None,
               timeout_s: float | None) -> tuple[list[Outcome], int, str]:
    """One child serving `jobs` in turn: (the outcomes it wrote, its exit code, its output).
    It is killed, with the engine processes it started, when no job ends within `timeout_s`."""
    jobs_file, results, progress, log_file = (workdir / f"series.{x}" for x in ("jobs.json", "results.jsonl",
                                                                               "progress", "log"))
    jobs_file.write_text(json.dumps([asdict(j) for j in jobs]))
    for f in (results, progress):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "eyas.serve.vllm_serve", str(jobs_file), str(results), str(progress)]
    seen, ended, last, timed_out = 0, 0, time.monotonic(), ""
    with open(log_file, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
        try:
            while child.poll() is None:
                time.sleep(0.5)
                seen = _progress(progress, seen, on_request)
                if len(_lines(results)) != ended:
                    ended, last = len(_lines(results)), time.monotonic()
                if timeout_s and time.monotonic() - last > timeout_s:
                    timed_out = f"TimeoutError: vLLM ran one job past {timeout_s:.0f} s\n"
                    _kill(child)
        finally:
            if child.poll() is None:
                _kill(child)
    _progress(progress, seen, on_request)
    text = log_file.read_text(errors="replace") + timed_out
    return [Outcome(**json.loads(x)) for x in _lines(results)], child.returncode, text


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)  # the child and the engine processes it started (own session)
    except ProcessLookupError:
        pass
    child.wait()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _segments(log_text: str) -> dict[str, str]:
    """The child's output split at the per-job marks: {job name: its lines}."""
    out: dict[str, str] = {}
    cur = None
    for line in log_text.splitlines():
        if line.startswith(MARK + "job "):
            cur = line[len(MARK + "job "):].strip()
            out[cur] = ""
        elif cur is not None:
            out[cur] += line + "\n"
    return out


def root_cause(text: str) -> str:
    """The last exception line of a traceback vLLM printed, skipping its wrappers: the exception
    the caller sees only says 'see root cause above'; a worker or the engine core printed the
    cause, as '(Worker pid=N) ERROR date time [file:line] ValueError: ...'."""
    found = [m.group(1) for m in map(_EXC_LINE.match, text.splitlines()) if m]
    specific = [ln for ln in found if not any(w in ln for w in _WRAPPERS)]
    return " ".join((specific or found or [""])[-1].split())[:400]


_EXC_LINE = re.compile(r"^\s*(?:\([^)]*\)\s*)?(?:[A-Z]+ \S+ \S+ \[[^\]]*\]\s*)?((?:[\w.]+(?:Error|Exception)):\s.*)$")
_WRAPPERS = ("root cause", "stack trace", "EngineDeadError", "Engine core initialization failed")


def _progress(path: Path, seen: int, on_request: Callable[[], None] | None) -> int:
    try:
        done = len(path.read_text().splitlines())
    except OSError:
        return seen
    for _ in range(done - seen):
        if on_request:
            on_request()
    return max(done, seen)


def _child_env() -> dict:
    env = dict(os.environ)
    # the child imports eyas from the same place as this process (a source checkout or site-packages)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    return env


# ---------------------------------------------------------------- child side


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters now: {drafts, draft_tokens, accepted, per_pos}."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted"}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in names:
            out[names[m.name]] += int(m.value)
        elif isinstance(m, Vector) and m.name == PER_POS:
            vals = list(m.values)
            pad = max(len(vals), len(out["per_pos"]))
            out["per_pos"] = [a + b for a, b in zip(out["per_pos"] + [0] * pad, vals + [0] * pad)][:pad]
    return out


def delta(after: dict, before: dict) -> dict:
    """Counters accumulated between two `counters` readings."""
    n = max(len(after["per_pos"]), len(before["per_pos"]))
    pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
    return {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
            "per_pos": [a - b for a, b in zip(pad(after["per_pos"]), pad(before["per_pos"]))]}


def acceptance(c: dict) -> dict:
    """Acceptance length and per-position acceptance from counters (vLLM's own definitions:
    1 + accepted / drafts; position i = accepted at position i / drafts)."""
    if not c["drafts"]:
        return {}
    return {"acceptance_length": 1 + c["accepted"] / c["drafts"],
            "acceptance_by_position": [a / c["drafts"] for a in c["per_pos"]], "drafts": c["drafts"],
            "accepted": c["accepted"]}


def _requests(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts cycled to at least `concurrency` requests, so that many can be in flight."""
    n = max(len(prompts), concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def run_level(llm, prompts: list[list[int]], concurrency: int, params, tick: Callable[[], None]) -> dict:
    """Serve the requests of one level with `concurrency` in flight; tokens/s over the level's wall time."""
    engine = llm.llm_engine
    reqs = _requests(prompts, concurrency)
    outputs: list[list[int] | None] = [None] * len(reqs)
    per_request: list[dict] = []
    before, t0 = counters(llm), time.perf_counter()
    nxt, in_flight = 0, 0
    started: dict[str, tuple[float, dict]] = {}
    while nxt < len(reqs) or in_flight:
        while nxt < len(reqs) and in_flight < concurrency:
            rid = f"c{concurrency}-{nxt}"
            started[rid] = (time.perf_counter(), counters(llm) if concurrency == 1 else {})
            engine.add_request(rid, {"prompt_token_ids": reqs[nxt]}, params)
            nxt, in_flight = nxt + 1, in_flight + 1
        for out in engine.step():
            if not out.finished:
                continue
            i = int(out.request_id.rsplit("-", 1)[1])
            outputs[i], in_flight = list(out.outputs[0].token_ids), in_flight - 1
            if concurrency == 1:  # one request at a time: the counters' change is this request's
                t_start, c0 = started[out.request_id]
                per_request.append({"wall_s": time.perf_counter() - t_start, "tokens": len(outputs[i]),
                                    **acceptance(delta(counters(llm), c0))})
            tick()
    wall = time.perf_counter() - t0
    c = delta(counters(llm), before)
    tokens = sum(len(o or []) for o in outputs)
    return {"concurrency": concurrency, "requests": len(reqs), "wall_s": wall, "tokens": tokens,
            "tokens_per_s": tokens / wall if wall else 0.0, "counters": c, **acceptance(c),
            "outputs": outputs, **({"per_request": per_request} if per_request else {})}


def start(job: ServeJob):
    """vLLM's `LLM` for `job` (with the stat loggers `counters` reads)."""
    from eyas.serve.vllm_engine import make_llm

    return make_llm(Path(job.target), dtype=job.dtype, speculative_config=job.speculative_config,
                    enforce_eager=job.enforce_eager, max_model_len=job.max_model_len, seed=job.seed,
                    max_num_seqs=max(job.concurrency), enable_prefix_caching=False, disable_log_stats=False)


def run_job(job: ServeJob, tick: Callable[[], None], llm=None, start_s: float = 0.0) -> dict:
    """Serve every concurrency level of `job` after a warm-up (on `llm`, or one started here);
    the result is JSON-able."""
    from vllm import SamplingParams

    if llm is None:
        t0 = time.perf_counter()
        llm = start(job)
        start_s = time.perf_counter() - t0
    # warm-up: first-call costs (allocations, compiled graphs for the batch shapes) stay out of the numbers
    warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, seed=job.seed)
    for c in job.concurrency:
        run_level(llm, job.prompts[:1], c, warm, lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=job.max_new_tokens, seed=job.seed, ignore_eos=job.ignore_eos)
    levels = [run_level(llm, job.prompts, c, params, tick) for c in job.concurrency]
    import vllm

    return {"name": job.name, "vllm": vllm.__version__, "start_s": start_s,
            "speculative_config": job.speculative_config, "levels": levels}


def run_one(job: ServeJob, tick: Callable[[], None]) -> Outcome:
    """Start, serve and shut down one job of a series, turning vLLM's exceptions into its outcome."""
    t0 = time.perf_counter()
    print(MARK + "job " + job.name, flush=True)
    try:
        llm = start(job)
    except Exception as e:  # noqa: BLE001 - a failure to start is the outcome being measured
        return Outcome(job.name, REFUSES, error=error_line(e), seconds=time.perf_counter() - t0)
    print(MARK + "started " + job.name, flush=True)
    try:
        result = run_job(job, tick, llm, time.perf_counter() - t0)
        return Outcome(job.name, SERVES, result, seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - so is a failure while serving
        return Outcome(job.name, FAILS, error=error_line(e), seconds=time.perf_counter() - t0)
    finally:
        _shutdown(llm)


def error_line(e: BaseException) -> str:
    """The innermost exception of a chain, on one line (vLLM wraps worker errors in several layers)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return " ".join(f"{type(e).__name__}: {e}".split())[:400]


def _shutdown(llm) -> None:
    """Stop the engine core and its workers, so the next job's `LLM` starts on a free machine."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: a dead engine has nothing left to stop
        log.debug("vLLM engine shutdown failed", exc_info=True)
    del llm
    gc.collect()


def main(argv: list[str]) -> int:
    """Child entry: `python -m eyas.serve.vllm_serve JOBS.json RESULTS.jsonl PROGRESS`: serves the
    jobs in turn and appends one Outcome line per job to RESULTS.jsonl as it ends."""
    jobs_file, results, progress = (Path(a) for a in argv)
    jobs = [ServeJob(**j) for j in json.loads(jobs_file.read_text())]
    with open(progress, "a") as p:
        def tick() -> None:
            p.write("1\n")
            p.flush()
        for job in jobs:
            o = run_one(job, tick)
            with open(results, "a") as f:
                f.write(json.dumps(asdict(o)) + "\n")
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: the guard keeps them from rerunning this
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
