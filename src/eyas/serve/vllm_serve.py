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
"""

from __future__ import annotations

import json
import logging
import os
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
    name: str = "vllm"


# ---------------------------------------------------------------- parent side


def serve(job: ServeJob, workdir: Path, on_request: Callable[[], None] | None = None,
          timeout_s: float | None = None) -> dict:
    """Run `job` in a child process; returns its result (see `run_job`).

    The child's output (vLLM's logs) goes to WORKDIR/NAME.log; a failed start raises EyasError
    quoting its last lines. `on_request` is called once per finished request (a progress bar).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    job_file, result_file = workdir / f"{job.name}.job.json", workdir / f"{job.name}.result.json"
    progress, log_file = workdir / f"{job.name}.progress", workdir / f"{job.name}.log"
    job_file.write_text(json.dumps(asdict(job)))
    for f in (result_file, progress):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "eyas.serve.vllm_serve", str(job_file), str(result_file), str(progress)]
    seen, t0 = 0, time.monotonic()
    with open(log_file, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env())
        try:
            while child.poll() is None:
                time.sleep(0.5)
                seen = _progress(progress, seen, on_request)
                if timeout_s and time.monotonic() - t0 > timeout_s:
                    child.kill()
                    raise EyasError(f"vLLM ({job.name}) ran past {timeout_s:.0f} s; see {log_file}")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    _progress(progress, seen, on_request)
    if child.returncode != 0 or not result_file.is_file():
        tail = " | ".join(log_file.read_text(errors="replace").strip().splitlines()[-6:])
        raise EyasError(f"vLLM ({job.name}) exited {child.returncode} before serving; its log {log_file} "
                        f"ends: {tail}")
    return json.loads(result_file.read_text())


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


def run_job(job: ServeJob, tick: Callable[[], None]) -> dict:
    """Start vLLM for `job`, warm it up, serve every concurrency level; the result is JSON-able."""
    from vllm import SamplingParams

    from eyas.serve.vllm_engine import make_llm

    t0 = time.perf_counter()
    llm = make_llm(Path(job.target), dtype=job.dtype, speculative_config=job.speculative_config,
                   enforce_eager=job.enforce_eager, max_model_len=job.max_model_len, seed=job.seed,
                   max_num_seqs=max(job.concurrency), enable_prefix_caching=False, disable_log_stats=False)
    start_s = time.perf_counter() - t0
    # warm-up: first-call costs (allocations, compiled graphs for the batch shapes) stay out of the numbers
    warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, seed=job.seed)
    for c in job.concurrency:
        run_level(llm, job.prompts[:1], c, warm, lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=job.max_new_tokens, seed=job.seed)
    levels = [run_level(llm, job.prompts, c, params, tick) for c in job.concurrency]
    import vllm

    return {"name": job.name, "vllm": vllm.__version__, "start_s": start_s,
            "speculative_config": job.speculative_config, "levels": levels}


def main(argv: list[str]) -> int:
    """Child entry: `python -m eyas.serve.vllm_serve JOB.json RESULT.json PROGRESS`."""
    job_file, result_file, progress = (Path(a) for a in argv)
    job = ServeJob(**json.loads(job_file.read_text()))
    with open(progress, "a") as p:
        def tick() -> None:
            p.write("1\n")
            p.flush()
        result = run_job(job, tick)
    tmp = result_file.with_name(result_file.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_file)
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: the guard keeps them from rerunning this
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
