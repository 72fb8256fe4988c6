"""What real vLLM does with a drafter directory: refuses to start, serves, and how well.

`probe(target, drafters, prompts)` serves each drafter in turn with EAGLE-3 chain drafting
(greedy, fp32, eager) and returns one `EngineOutcome` per drafter: `refuses` (vLLM raised
while starting or while serving; the first error line is kept) or `serves` with the
acceptance length read from vLLM's own counters
(`1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts`).

Several drafters share one child process (one `LLM` after another) because each start costs
tens of seconds of imports; the parent watches the child and, when it dies or hangs on one
drafter, records that drafter as refused and restarts a child for the rest. vLLM starts its
workers with `spawn`, so the child is this module run as `python -m eyas.doctor.vllm_probe`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REFUSES, FAILS, SERVES = "refuses", "fails", "serves"  # refuses to start | fails while serving | serves
MARK = "=== eyas vllm_probe: "  # the child prints it before each drafter, so the log splits per drafter


@dataclass
class EngineOutcome:
    """What vLLM did with one drafter directory."""

    drafter: str
    outcome: str  # 'refuses' | 'fails' | 'serves'
    accept_len: float | None = None  # serves: 1 + accepted / drafts
    drafts: int = 0
    error: str = ""  # refuses / fails: the engine's error line (its root cause where it printed one)
    seconds: float = 0.0

    def classify(self, healthy_accept: float, share: float = 0.5) -> str:
        """'refuses' | 'fails' | 'collapses' | 'unaffected': collapse is acceptance below
        1 + share * (healthy - 1), i.e. losing more than half of what the drafter gains."""
        if self.outcome != SERVES or self.accept_len is None:
            return self.outcome if self.outcome != SERVES else FAILS
        return "collapses" if self.accept_len < 1 + share * (healthy_accept - 1) else "unaffected"


def prompt_token_ids(target: Path, prompts_file: Path, limit: int) -> list[list[int]]:
    """The first user turn of each prompt, through the target's chat template."""
    from transformers import AutoTokenizer

    from eyas.formats.prompts import load_prompt_files

    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    for conv in load_prompt_files([prompts_file], flag="--prompts")[:limit]:
        first = [t for t in conv.turns if t["role"] == "user"][:1] or conv.turns[:1]
        ids = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _counters(llm) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_drafts"):
            out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0) or 0)
    return out


def _error_line(e: BaseException) -> str:
    """The most specific line of an engine failure (vLLM wraps worker errors in several layers)."""
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__ or e.__context__
    while cause is not None:
        text = f"{type(cause).__name__}: {cause}"
        cause = cause.__cause__ or cause.__context__
    return " ".join(text.split())[:400]


def serve_one(target: Path, drafter: Path, prompts: list[list[int]], k: int, new_tokens: int) -> EngineOutcome:
    """Start vLLM with `drafter`, generate greedily, shut it down (in this process)."""
    from vllm import SamplingParams

    from eyas.serve.vllm_engine import make_llm

    t0 = time.time()
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k}
    try:
        llm = make_llm(target, dtype="fp32", speculative_config=spec, enforce_eager=True, max_model_len=1024,
                       disable_log_stats=False)  # get_metrics() needs the stat loggers
    except Exception as e:  # noqa: BLE001 - any failure to start is the outcome being measured
        return EngineOutcome(str(drafter), REFUSES, error=_error_line(e), seconds=time.time() - t0)
    try:
        before = _counters(llm)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        after = _counters(llm)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        acc = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
            "vllm:spec_decode_num_accepted_tokens", 0)
        al = 1 + acc / drafts if drafts else None
        return EngineOutcome(str(drafter), SERVES, al, int(drafts), seconds=time.time() - t0)
    except Exception as e:  # noqa: BLE001 - an error while serving counts as a refusal
        return EngineOutcome(str(drafter), FAILS, error=_error_line(e),
                             seconds=time.time() - t0)
    finally:
        _shutdown(llm)


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the process exits soon anyway
        log.debug("vLLM engine shutdown failed", exc_info=True)
    del llm
    import gc

    gc.collect()


def probe(target: Path, drafters: list[Path], prompts_file: Path, *, k: int = 3, new_tokens: int = 48,
          num_prompts: int = 4, per_drafter_timeout: float = 300.0) -> dict[str, EngineOutcome]:
    """Serve every drafter in real vLLM (child processes); {drafter path: outcome}."""
    todo, out = [str(d) for d in drafters], {}
    while todo:
        with tempfile.TemporaryDirectory() as tmp:
            res = Path(tmp) / "results.jsonl"
            cmd = [sys.executable, "-m", "eyas.doctor.vllm_probe", "--target", str(target), "--prompts",
                   str(prompts_file), "--out", str(res), "--k", str(k), "--new-tokens", str(new_tokens),
                   "--num-prompts", str(num_prompts), *todo]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
            log_text = _watch(proc, res, per_drafter_timeout)
            done = [EngineOutcome(**json.loads(x)) for x in res.read_text().splitlines()] if res.exists() else []
        segments = _segments(log_text)
        for o in done:
            if o.outcome != SERVES:
                o.error = _root_cause(segments.get(o.drafter, "")) or o.error
            out[o.drafter] = o
            todo.remove(o.drafter)
        if todo and proc.returncode != 0 or todo and not done:
            bad = todo.pop(0)  # the child died (or hung) serving this one
            out[bad] = EngineOutcome(bad, REFUSES, error="engine process died: "
                                     + (_root_cause(segments.get(bad, "")) or "no error printed"))
    return out


def _segments(log_text: str) -> dict[str, str]:
    """The child's output split at the per-drafter marks: {drafter: its lines}."""
    out, cur = {}, None
    for line in log_text.splitlines():
        if line.startswith(MARK):
            cur = line[len(MARK):].strip()
            out[cur] = ""
        elif cur is not None:
            out[cur] += line + "\n"
    return out


def _root_cause(text: str) -> str:
    """The last exception line of a traceback vLLM printed, skipping its wrappers (the exception
    the caller sees only says 'see root cause above'; a worker or the engine core printed the
    cause, as '(Worker pid=N) ERROR date time [file:line] ValueError: ...')."""
    found = [m.group(1) for m in map(_EXC_LINE.match, text.splitlines()) if m]
    specific = [ln for ln in found if not any(w in ln for w in _WRAPPERS)]
    return " ".join((specific or found or [""])[-1].split())[:400]


_EXC_LINE = re.compile(r"^\s*(?:\([^)]*\)\s*)?(?:[A-Z]+ \S+ \S+ \[[^\]]*\]\s*)?((?:[\w.]+(?:Error|Exception)):\s.*)$")
_WRAPPERS = ("root cause", "stack trace", "EngineDeadError", "Engine core initialization failed")


def _watch(proc: subprocess.Popen, res: Path, per_drafter: float) -> str:
    """Wait for the child; kill it when one drafter takes longer than `per_drafter` seconds."""
    lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    last, seen = time.time(), 0
    while proc.poll() is None:
        time.sleep(1.0)
        now = len(res.read_text().splitlines()) if res.exists() else 0
        if now != seen:
            last, seen = time.time(), now
        if time.time() - last > per_drafter:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and the engine processes it started
            lines.append(f"TimeoutError: no result within {per_drafter:.0f} s")
    reader.join(timeout=5)
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="serve drafters in real vLLM one after another (child of probe())")
    p.add_argument("drafters", nargs="+", type=Path)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--num-prompts", type=int, default=4)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    prompts = prompt_token_ids(a.target, a.prompts, a.num_prompts)
    for d in a.drafters:
        print(MARK + str(d), flush=True)
        o = serve_one(a.target, d, prompts, a.k, a.new_tokens)
        with open(a.out, "a") as f:
            f.write(json.dumps(asdict(o)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
