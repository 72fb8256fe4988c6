"""Running vLLM work in a child process: the job file, the engine settings eyas passes through,
and the child's error channel.

Why a child: vLLM starts an engine process and workers (with `spawn`), sets process-wide
logging and thread settings, and must be shut down cleanly; running it in
`python -m eyas.serve.<module> job.json` keeps all of that out of the eyas process (and out of
a test session), frees every byte when the job ends, and turns an engine crash into an exit
code. The job's progress bar and vLLM's warnings go to the inherited stderr. The job writes
its results where the parent reads them (the regeneration work file, capture shards), so a
killed job loses only its unfinished unit of work.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from eyas.errors import EyasError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """How vLLM runs the target: its own parallelism and any other `vllm.LLM` keyword."""

    dtype: str = "bf16"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    extra: dict = field(default_factory=dict)  # e.g. enforce_eager, distributed_executor_backend, max_model_len


def parse_engine_args(dtype: str, tp: int, pp: int, vllm_args: str | None) -> EngineArgs:
    """Validate `--tensor-parallel-size`, `--pipeline-parallel-size` and `--vllm-args JSON`."""
    for flag, n in (("--tensor-parallel-size", tp), ("--pipeline-parallel-size", pp)):
        if n < 1:
            raise EyasError(f"{flag} {n}: must be >= 1 (the number of GPUs vLLM shards the target over)")
    extra: dict = {}
    if vllm_args:
        try:
            extra = json.loads(vllm_args)
        except json.JSONDecodeError as e:
            raise EyasError(f"--vllm-args {vllm_args!r}: not JSON ({e}); pass an object of vllm.LLM keywords, "
                            "e.g. '{\"enforce_eager\": true}'") from e
        if not isinstance(extra, dict):
            raise EyasError(f"--vllm-args {vllm_args!r}: must be a JSON object of vllm.LLM keywords")
    taken = {"model", "dtype", "tensor_parallel_size", "pipeline_parallel_size", "speculative_config",
             "kv_transfer_config"} & set(extra)
    if taken:
        raise EyasError(f"--vllm-args sets {sorted(taken)}, which eyas sets itself; use --dtype, "
                        "--tensor-parallel-size, --pipeline-parallel-size, and drop them from --vllm-args")
    return EngineArgs(dtype, tp, pp, extra)


def make_llm(target: Path, engine: EngineArgs, **kwargs):
    """`vllm_engine.make_llm` with the engine settings of a job (`kwargs` override `extra`)."""
    from eyas.serve import vllm_engine

    extra = {**engine.extra, **kwargs}
    return vllm_engine.make_llm(target, dtype=engine.dtype, tensor_parallel_size=engine.tensor_parallel_size,
                                pipeline_parallel_size=engine.pipeline_parallel_size, **extra)


def run_child(module: str, job: dict, job_path: Path) -> dict:
    """Run `python -m module job_path` with `job` and return what it reported; an EyasError in
    the child comes back as one here (exit 2), any other failure names the job file to rerun."""
    from eyas.serve import vllm_engine

    vllm_engine.require()
    job_path.parent.mkdir(parents=True, exist_ok=True)
    result = job_path.with_name(job_path.name + ".result")
    result.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job, indent=1, default=str) + "\n")
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would bury eyas's progress bar
    # stdout=2: the job's and vLLM's prints go to stderr, keeping eyas's stdout for its summary (--json)
    rc = subprocess.run([sys.executable, "-m", module, str(job_path)], env=env, stdout=2).returncode
    got = json.loads(result.read_text()) if result.is_file() else {}
    if "error" in got:
        raise EyasError(got["error"])
    if rc != 0 or not got:
        raise EyasError(f"the vLLM job ({module}, {job_path}) failed with exit code {rc} (its messages are "
                        "above); fix the cause and rerun the same command: finished work is kept")
    return got


def child_main(fn: Callable[[dict], dict]) -> None:
    """The child's entry: run `fn(job)` on the job file named in argv and report its result or
    the EyasError it raised (other exceptions print their traceback and exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    job_path = Path(sys.argv[1])
    result = job_path.with_name(job_path.name + ".result")
    job = json.loads(job_path.read_text())
    try:
        out = fn(job)
    except EyasError as e:
        result.write_text(json.dumps({"error": str(e)}) + "\n")
        sys.exit(e.exit_code)
    result.write_text(json.dumps(out) + "\n")


def engine_from_job(job: dict) -> EngineArgs:
    return EngineArgs(**job["engine"])


def engine_to_job(engine: EngineArgs) -> dict:
    return asdict(engine)
